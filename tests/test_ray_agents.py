"""Checkpoint agents of the peer-memory tier, one per Ray node, supervised by the Ray executor
(tidal.exec.ray_agents), on the session's real 3-node Ray cluster: a buddy ring over the nodes, ranks
told their node's agent and the others, a job that checkpoints to the peer tier (every save) and to a
shared disk (every third) losing a node at a moment the agents left hold a newer step than the disk,
the ring closing over the nodes left, and the job's next attempt restoring that step - the lost
node's shards from its buddy's memory (the lost node's own memory directory deleted, as if the machine
were gone), not an older or a later step from the disk.

The loss is a machine's: every process of the node stops at one instant (``node_loss``). With Ray's
``remove_node`` alone the node's rank and agent went on for ~0.75 s: the rank trained on and committed
a step to the shared disk that its dead agent never got, and the next attempt restored it from the
disk instead of the buddy's newer memory (what ``tidal demo ray --cycle`` must not do)."""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from plane_proc import wait_until
from tidal.control.node_memory import agent_namespaces
from tidal.demo.node_loss import kill_when_peer_newest, worth_a_look
from tidal.exec import procs
from tidal.exec.protocol import LaunchRequest

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"


def status(addr: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}/status", timeout=5) as r:
        return json.loads(r.read())


def test_agents_in_a_ring_and_a_restore_from_the_lost_nodes_buddy(ray_cluster, tmp_path):
    from tidal.exec.ray_exec import RayExecutor

    ray_cluster.state_roots.append(tmp_path / "jobs")
    ex = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60, ckpt_agents=True)
    try:
        ex.nodes()
        addrs = dict(ex.agents.addresses)
        assert sorted(addrs) == ["n1", "n2", "n3"]
        ring = {n: status(a)["buddy"]["address"] for n, a in addrs.items()}
        assert ring == {"n1": addrs["n2"], "n2": addrs["n3"], "n3": addrs["n1"]}
        # They run with the plane's key (kept in the state dir): without the job's token, 403.
        assert all(status(a)["auth"] for a in addrs.values())
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(f"http://{addrs['n1']}/v1/jobs/p-test", timeout=5)

        home = str(tmp_path / "disk")  # every node sees it: a step committed there outlives the node
        env = {"TIDAL_CKPT_TIERS": json.dumps(["peer", {"url": home, "every": 3}]),
               "TIDAL_CKPT_INTERVAL_STEPS": "10"}
        cmd = (sys.executable, str(WORKER), "--steps", "1000000", "--pad-mib", "1", "--step-s", "0.05")
        handle = ex.launch(LaunchRequest("p", 1, cmd, {"n2": 1, "n3": 1}, env=env), time.time())
        on_n3 = [r["pid"] for r in handle["ranks"] if r["node"] == "n3"] + [status(addrs["n3"])["pid"]]
        wait_until(
            "a step committed in the peer tier",
            lambda: (ex.observe(time.time())["p"].progress.tiers.get("peer") or [0])[0] >= 20,
            120,
        )
        looked = {"peer": None}

        def look() -> dict | None:  # rank 1's agent and memory go with n3; its buddy n1 holds a copy
            peer = worth_a_look(ex.observe(time.time())["p"].progress.tiers, looked["peer"])
            if peer is None:
                return None
            looked["peer"] = peer
            return kill_when_peer_newest(ray_cluster.cluster, ray_cluster.nodes["n3"], home,
                                         [addrs["n1"], addrs["n2"]], token=ex.agents.agent_token)

        held = wait_until("a moment the agents of n1 and n2 hold a newer step than the disk", look, 60)
        ray_cluster.nodes.pop("n3")
        assert not [p for p in on_n3 if procs.alive(p)], "a process of the lost node still runs"
        at = held["peer"].committed
        assert at is not None and at > (held["disk"].committed or -1) and at >= 20, held
        shutil.rmtree(ex.shm_root / "n3")  # as if the machine were gone: its memory (agent, staging) too
        wait_until("rank 1 lost", lambda: ex.observe(time.time())["p"].ranks[1].lost, 60)
        ex.kill("p")
        wait_until("every rank gone", lambda: ex.observe(time.time())["p"].done, 60)
        ex.release("p")
        wait_until(
            "the ring closed over n1 and n2",
            lambda: (
                sorted(ex.nodes() and ex.agents.addresses) == ["n1", "n2"]
                and status(addrs["n2"])["buddy"]["address"] == addrs["n1"]
            ),
            60,
        )
        assert status(addrs["n1"])["buddy"]["address"] == addrs["n2"]

        ex.launch(LaunchRequest("p", 2, cmd, {"n1": 1, "n2": 1}, env=env), time.time())
        p = wait_until(
            "the next attempt training",
            lambda: (o := ex.observe(time.time())["p"]).progress.first_step and o.progress,
            120,
        )
        assert p.restore_tier == "peer" and p.start_step == at, (p, held)
        # A plane restarted on the same state dir has the same key: its agents keep running as they are
        # (an agent given another key is restarted), and the job's token stays valid.
        pids = {n: status(a)["pid"] for n, a in ex.agents.addresses.items()}
        again = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60,
                            ckpt_agents=True)
        again.nodes()
        assert {n: status(a)["pid"] for n, a in again.agents.addresses.items()} == pids
        ex.kill("p")
        wait_until("every rank gone", lambda: ex.observe(time.time())["p"].done, 60)
        ex.release("p")
        # The plane's sweep frees an ended job's steps from every agent (the AgentMemory protocol).
        (ns,) = agent_namespaces({"checkpoint": {"tiers": json.loads(env["TIDAL_CKPT_TIERS"])}})
        assert ns in ex.agent_jobs() and ex.free_agent_job(ns)
        assert ns not in ex.agent_jobs() and not ex.free_agent_job(ns)
    finally:
        if ex.agents is not None:
            ex.agents.stop_all()
        ray_cluster.restore()

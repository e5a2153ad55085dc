"""Checkpoint agents of the peer-memory tier, one per Ray node, supervised by the Ray executor
(tidal.exec.ray_agents), on the session's real 3-node Ray cluster: a buddy ring over the nodes, ranks
told their node's agent and the others, a job that checkpoints to the peer tier only losing a node,
the ring closing over the nodes left, and the job's next attempt restoring the lost node's shards
from its buddy's memory (the lost node's own memory directory deleted, as if the machine were gone)."""

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

        env = {"TIDAL_CKPT_TIERS": '["peer://p-test"]', "TIDAL_CKPT_INTERVAL_STEPS": "10"}
        cmd = (sys.executable, str(WORKER), "--steps", "1000000", "--pad-mib", "1")
        ex.launch(LaunchRequest("p", 1, cmd, {"n2": 1, "n3": 1}, env=env), time.time())
        ob = wait_until(
            "a step committed in the peer tier",
            lambda: (
                (o := ex.observe(time.time())["p"]).progress.tiers.get("peer")
                and o.progress.tiers["peer"][0] >= 20
                and o
            ),
            120,
        )
        at = ob.progress.tiers["peer"][0]

        ray_cluster.remove("n3")  # rank 1's agent and memory go with it; its buddy n1 holds a copy
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
        assert p.restore_tier == "peer" and p.start_step >= at, p
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
    finally:
        if ex.agents is not None:
            ex.agents.stop_all()
        ray_cluster.restore()

"""Live lending on the Ray executor: serving nodes are Ray nodes by their Tidal name, spot
jobs run on the GPUs they lend, and a reclaim takes the GPUs back, on the session's real 3-node Ray
cluster (tests/ray_cluster.py: ``n1`` 2 GPUs, ``n2`` 1, ``n3`` 1).

``tidal up --executor ray`` runs as a process with ``serving.nodes: {n1: 2, n3: 1}`` (so ``n2`` is the
one training GPU) and a replayed trace whose nights are quiet: at midnight the plan lends a GPU, a
spot job of exactly 2 GPUs runs on ``n2`` and the lent GPU (its rank there pinned to that Ray node),
before the morning rise it gets its notice, its ranks leave, and the GPU goes back to serving before
the deadline. A serving node the cluster lacks is one line at start.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

from plane_proc import Plane, wait_until
from tidal.control.client import TidalClient
from tidal.exec import procs

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
SERVING = {"n1": 2, "n3": 1}
DAY = 86400


def load(t: float) -> float:
    """A smooth day (the forecast learns it exactly): 10% from 22:00 to 05:00, full from 08:00 to 19:00."""
    h = t % DAY / 3600

    def ramp(x: float) -> float:
        return 0.1 + 0.9 * (1 - math.cos(math.pi * x)) / 2

    return 0.1 if h < 5 or h >= 22 else ramp((h - 5) / 3) if h < 8 else 1.0 if h < 19 else ramp((22 - h) / 3)


def wait_with_events(admin, what, pred, timeout_s=60.0):
    """``wait_until`` that prints the plane's events when it times out."""
    return wait_until(what, pred, timeout_s, lambda: "; events:\n" + "\n".join(
        f"{e['job']}: {e['kind']} {e['from']}->{e['to']}: {e['message']}" for e in admin.events()))


def night_trace(path: Path, days: int = 3) -> Path:
    path.write_text("seconds,load\n" + "".join(f"{t},{load(t):.4f}\n" for t in range(0, days * DAY, 600)))
    return path


def config(trace: Path, nodes: dict) -> dict:
    """Replayed from 22:00 of its third day at 1000x: about 20 s of quiet night before the notice."""
    return {
        "restart_backoff_s": 0.2,
        "hang_timeout_s": 60,
        "startup_timeout_s": 120,
        "kill_slack_s": 5,
        "loop_interval_s": 0.2,
        "serving": {
            "trace": str(trace),
            "nodes": nodes,
            # 3 serving GPUs and a 1.5 h lead (serving time): at the default 0.5 % the budget ledger's
            # guarantee lets nothing be lent (one GPU away risks more than two days of budget; see
            # docs/loaning.md, "Small pools lend nothing under it").
            "shortfall_budget": 0.05,
            "speedup": 1000,
            "start_s": 2 * DAY + 22 * 3600,
            "history_days": 2,
            "grace_s": 3,
            "final_checkpoint_s": 1,
            "release_s": 0.5,
            "warmup_s": 1,
            "restart_cost_s": 2,
        },
    }


def test_serving_nodes_unknown_to_ray_are_one_line_at_start(ray_cluster, tmp_path):
    from tidal.control.config import ControlConfig
    from tidal.control.server import build

    trace = night_trace(tmp_path / "night.csv")
    for i, (nodes, msg) in enumerate(
        [
            (
                {"serve-0": 2},
                "serving.nodes: serve-0 not in the Ray cluster (a serving node "
                "is the Ray node labelled tidal.io/node=NAME; the cluster has "
                "['n1', 'n2', 'n3'])",
            ),
            ({"n1": 4}, "serving.nodes: n1 has 4 GPUs there but 2 in the Ray cluster"),
        ]
    ):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(trace, nodes)))
        with pytest.raises(SystemExit) as e:
            build(tmp_path / f"s{i}", "auto", config=ControlConfig.load(tmp_path / "c.yaml"), executor="ray",
                  ray_address=ray_cluster.address)
        assert str(e.value) == f"tidal up: {msg}", e.value


def test_a_spot_job_on_a_lent_gpu_of_a_ray_node_is_reclaimed(ray_cluster, tmp_path):
    trace = night_trace(tmp_path / "night.csv")
    cfg = config(trace, SERVING)
    # From 01:00 at 400x: the loan comes in the first seconds and the notice about 45 s later (at 06:00,
    # as the morning rise nears). With about 20 s (1000x from 22:00) a loaded CI machine once had the
    # ranks at no step yet (no checkpoint) when the notice came.
    cfg["serving"]["speedup"] = 400
    cfg["serving"]["start_s"] = 2 * DAY + 1 * 3600
    p = Plane(tmp_path, yaml.safe_dump(cfg), gpus=None,
              args=("--executor", "ray", "--ray-address", ray_cluster.address))
    ray_cluster.state_roots.append(p.state / "jobs")
    job = None
    try:
        p.start()
        admin = p.admin

        def wait_for(what, pred, timeout_s=60.0):
            return wait_with_events(admin, what, pred, timeout_s)

        pool = {n["name"]: (n["gpus"], n["pool"]) for n in admin.pool()["nodes"]}
        assert pool == {"n1": (2, "serving"), "n2": (1, "training"), "n3": (1, "serving")}, pool
        lab = TidalClient(p.url, admin.create_tenant("lab", quota_gpus=0, weight=1.0)["token"])
        job = lab.submit({"name": "spot", "kind": "spot", "gpus": 2, "workdir": str(tmp_path), "grace_s": 3,
                          "max_restarts": 0, "command": [sys.executable, str(WORKER), "--steps", "1000000",
                                                         "--pad-mib", "1", "--step-s", "0.05"],
                          "env": {"TIDAL_CKPT_INTERVAL_STEPS": "10"}})["id"]
        j = wait_for("the job running on a lent GPU", lambda: (j := lab.job(job))["state"] == "running"
                     and j["progress"].get("step") and j)
        lent_node = next(n for n in j["placement"] if n in SERVING)
        assert j["placement"] == {"n2": 1, lent_node: 1}, j["placement"]
        assert sorted(r["node"] for r in j["handle"]["ranks"]) == sorted(["n2", lent_node])
        s = admin.serving()
        assert s["lending"] and {ln["node"]: ln["gpus"] for ln in s["loans"]} == {lent_node: 1}, s["loans"]
        pids = [r["pid"] for r in j["handle"]["ranks"]]

        # The morning rise: a notice, the ranks leave (exit 75 after a checkpoint), the GPU serves again.
        ret = wait_for(
            "the GPU returned to serving", lambda: [e for e in admin.events() if e["kind"] == "return"], 150
        )[0]
        assert (
            ret["data"]["node"] == lent_node and ret["data"]["gpus"] == 1 and ret["data"]["margin_s"] >= 0
        ), ret
        kinds = [e["kind"] for e in admin.events() if e["kind"] in ("loan", "reclaim", "return")]
        assert kinds[:3] == ["loan", "reclaim", "return"], admin.events()
        stops = [e for e in lab.events(job) if e["to"] == "preempting"]
        assert stops and "(reclaim" in stops[0]["message"], stops
        assert not [pid for pid in pids if procs.alive(pid)]
        j = lab.job(job)
        assert j["state"] == "pending" and j["restarts"] == 0 and (j["ckpt_step"] or 0) > 0, j
        s = wait_for(
            "the GPU serving again", lambda: (s := admin.serving())["serving_capacity_gpus"] == 3 and s
        )
        st = s["stats"]
        assert s["lent_gpus"] == 0 and st["reclaims_missed"] == 0 and st["double_counted_steps"] == 0, s
        assert s["adapter"]["released"] == {"n1": 0, "n3": 0}
    finally:
        p.stop()
        if job is not None:  # a failed run may leave the attempt's actors and placement group in the cluster
            from tidal.exec.ray_exec import RayExecutor

            RayExecutor(p.state / "jobs", address=ray_cluster.address)._remove_leftovers(job)


def test_a_peer_tier_may_use_the_executors_own_agents_only(tmp_path):
    """``tiers: [peer, DIR]`` with no agent named: refused unless the plane runs its own agents (``tidal up
    --executor ray --ckpt-agents``); an agent the tenant names still needs ``checkpoint_endpoints``."""
    from tidal.control.locations import LocationPolicy, check

    own = str(tmp_path / "tenants" / "a" / "run")
    for tier, own_agents, ok in [("peer", False, False), ("peer", True, True),
                                 ({"kind": "peer", "agent": "10.0.0.9:7000"}, True, False),
                                 ({"kind": "peer", "peers": ["10.0.0.9:7000"]}, True, False)]:
        policy = LocationPolicy(tmp_path / "tenants", own_agents=own_agents)
        problems, _, home = check({"tiers": [tier, own]}, "a", False, policy, lambda _: [], lambda _: None)
        assert (not problems) == ok, (tier, own_agents, problems)
        assert ok or ("this plane runs none" if tier == "peer" else "is not allowed (checkpoint_endpoints") \
            in problems[0][1]


def test_a_lent_ray_node_removed_ends_its_loans_and_serves_again_after_it_is_back(ray_cluster, tmp_path):
    """The serving node the spot job's rank runs on (its raylet SIGKILLed): its loans end, the job is
    requeued as on any node loss; the plane is SIGKILLed while the node is gone and a new one starts
    without it; the node comes back and serves again after its warm-up (then it may be lent again)."""
    trace = night_trace(tmp_path / "night.csv")
    cfg = config(trace, SERVING)
    cfg["serving"]["speedup"] = 400  # about a minute of night: a loss, a plane restart and a return fit in it
    p = Plane(tmp_path, yaml.safe_dump(cfg), gpus=None,
              args=("--executor", "ray", "--ray-address", ray_cluster.address))
    ray_cluster.state_roots.append(p.state / "jobs")
    job = lent_node = None
    try:
        p.start()
        admin = p.admin

        def wait_for(what, pred, timeout_s=60.0):
            return wait_with_events(admin, what, pred, timeout_s)

        def kind(k):
            return [e for e in admin.events() if e["kind"] == k]

        lab = TidalClient(p.url, admin.create_tenant("lab", quota_gpus=0, weight=1.0)["token"])
        job = lab.submit({"name": "spot", "kind": "spot", "gpus": 2, "workdir": str(tmp_path), "grace_s": 3,
                          "max_restarts": 0, "command": [sys.executable, str(WORKER), "--steps", "1000000",
                                                         "--pad-mib", "1", "--step-s", "0.05"]})["id"]
        j = wait_for("the job running on a lent GPU", lambda: (j := lab.job(job))["state"] == "running" and j)
        lent_node = next(n for n in j["placement"] if n in SERVING)
        ray_cluster.remove(lent_node)
        (lost,) = wait_for("the serving node lost", lambda: kind("serving_node_lost"))
        assert lost["data"]["node"] == lent_node and lost["data"]["jobs"] == [job], lost
        assert lost["data"]["lent_gpus"] == 1 and "nothing is reclaimed" in lost["message"]
        s = admin.serving()
        assert lent_node in s["lost_nodes"] and s["serving_gpus"] == 3 - SERVING[lent_node], s
        assert all(ln["node"] != lent_node for ln in s["loans"]) and not kind("return")
        wait_for("the job requeued after the node loss", lambda: kind("node_lost") and
                 lab.job(job)["state"] in ("pending", "admitted", "running")
                 and lent_node not in (lab.job(job)["placement"] or {}))
        p.crash()  # SIGKILL between the loss and the return: the node is still gone at the restart
        p.start()
        admin = p.admin
        s = admin.serving()
        assert lent_node in s["lost_nodes"] and len(kind("serving_node_lost")) == 1, s
        ray_cluster.add(lent_node)
        wait_for("the node back", lambda: kind("serving_node_back"))
        ready = wait_for("the node serving again", lambda: [e for e in kind("serving_ready")
                                                             if e["data"].get("rejoined")])
        assert ready[0]["data"]["node"] == lent_node
        s = admin.serving()
        assert lent_node in s["pool_nodes"] and s["serving_gpus"] == 3 and not s["lost_nodes"], s
        assert s["stats"]["double_counted_steps"] == 0 and s["stats"]["reclaims_missed"] == 0, s
    finally:
        p.stop()
        if lent_node is not None and lent_node not in ray_cluster.nodes:
            ray_cluster.add(lent_node)
        if job is not None:
            from tidal.exec.ray_exec import RayExecutor

            RayExecutor(p.state / "jobs", address=ray_cluster.address)._remove_leftovers(job)

"""End to end on Ray: ``tidal up --executor ray --ray-address`` as a real process against a real
3-node Ray cluster (tests/ray_cluster.py), real training ranks (tests/workers/train_worker.py, DDP
over gloo) across nodes.

One scenario, in order: an elastic spot job (2-3 GPUs) trains across two nodes and checkpoints to
the shared disk; ``tidal up`` is killed with SIGKILL and started again: it re-adopts the running
ranks (named actors), launches nothing; the node holding two of its ranks is removed from the
cluster (its raylet SIGKILLed): the plane notices, kills the other ranks, requeues the job (not a
failure) and relaunches it on the 2 GPUs left, resharded from the newest checkpoint on disk; the node
comes back and is seen; the job is cancelled and the plane killed again at once: started again, it leaves
no GPU of the cluster held. Detection and recovery times are printed (``pytest -s``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from plane_proc import Plane, wait_until
from tidal.control.client import TidalClient

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
CONFIG = """
restart_backoff_s: 0.2
hang_timeout_s: 60
startup_timeout_s: 120
kill_slack_s: 5
loop_interval_s: 0.2
scheduler: {min_runtime_before_preempt_s: 0, preempt_grace_s: 30}
"""


def events(c: TidalClient, job: str, kind: str) -> list[dict]:
    return [e for e in c.events(job) if e["kind"] == kind]


def test_node_loss_requeues_and_resumes_resharded(ray_cluster, tmp_path):
    p = Plane(tmp_path, CONFIG, gpus=None, args=("--executor", "ray", "--ray-address", ray_cluster.address))
    ray_cluster.state_roots.append(p.state / "jobs")
    try:
        p.start()
        admin = p.admin

        def wait_for(what, pred, timeout_s=120.0):
            return wait_until(what, pred, timeout_s, lambda: "; events:\n" + "\n".join(
                f"{e['job']}: {e['kind']} {e['from']}->{e['to']}: {e['message']}" for e in admin.events()))

        pool = admin.pool()
        assert sorted((n["name"], n["gpus"]) for n in pool["nodes"]) == [("n1", 2), ("n2", 1), ("n3", 1)]
        lab = TidalClient(p.url, admin.create_tenant("lab", quota_gpus=0, weight=1.0)["token"])
        job = lab.submit(
            {
                "name": "elastic",
                "kind": "spot",
                "gpus": {"min": 2, "max": 3},
                "workdir": str(tmp_path),
                "max_restarts": 0,
                "command": [sys.executable, str(WORKER), "--steps", "1000000", "--pad-mib", "1",
                            "--step-s", "0.05"],
                "env": {"TIDAL_CKPT_INTERVAL_STEPS": "10"},
            }
        )["id"]
        wait_for("a checkpoint", lambda: (lab.job(job)["progress"].get("ckpt_step") or 0) >= 10)
        j = lab.job(job)
        placement = j["placement"]
        assert sum(placement.values()) == 3 and len(placement) == 2, placement
        pids = [r["pid"] for r in j["handle"]["ranks"]]

        # kill -9 of the plane: the new one re-adopts the ranks by their actors' names, starts nothing.
        p.crash()
        p.start()
        admin, lab = p.admin, TidalClient(p.url, lab.token)
        adopted = wait_for("the adoption", lambda: events(admin, job, "adopted"))
        assert f"re-adopted attempt 1, 3 of 3 ranks running (pids {pids})" in adopted[0]["message"]
        before = lab.job(job)["progress"]["step"]
        wait_for("progress after the adoption", lambda: lab.job(job)["progress"]["step"] > before + 3)
        assert len(events(admin, job, "launch")) == 1

        # The node with two of its ranks goes (raylet SIGKILLed): detected, requeued, resumed on 2 GPUs.
        big = max(placement, key=lambda n: placement[n])
        at_loss = lab.job(job)["progress"]
        t0 = time.time()
        ray_cluster.remove(big)
        lost = wait_for("the node loss", lambda: events(admin, job, "node_lost"), 60)[0]
        detect_s = lost["time_s"] - t0
        assert big in lost["message"] and lost["data"]["nodes"] == [big]
        rec = wait_for("training again", lambda: events(admin, job, "recovered"), 120)[0]
        j = lab.job(job)
        assert j["restarts"] == 0 and j["state"] == "running" and j["attempt"] == 2
        assert big not in j["placement"] and sum(j["placement"].values()) == 2
        requeue = [e for e in lab.events(job) if e["to"] == "pending" and e["from"] == "running"]
        assert requeue and requeue[0]["data"]["node_lost"]
        d = rec["data"]
        assert d["world_size"] == 2 and d["was_world_size"] == 3
        assert (
            d["start_step"] >= at_loss["durable_ckpt_step"] and d["restore_tier"] == "disk"
        )  # n1's memory went with it
        assert [e["data"]["node"] for e in admin.events() if e["kind"] == "node"
                and (e["data"] or {}).get("left")] == [big]
        m = admin.metrics()
        assert "tidal_node_losses_total 1.0" in m and "tidal_node_loss_recovery_seconds_count 1.0" in m
        print(
            f"\nnode loss ({big}, raylet SIGKILLed): detected {detect_s:.2f} s after the kill; "
            "training again "
            f"{d['recovery_s']:.2f} s after detection ({detect_s + d['recovery_s']:.2f} s in all) on "
            f"{d['world_size']} ranks from step {d['start_step']} (tier {d['restore_tier']}), "
            f"{d['lost_steps']} steps redone"
        )

        # The node returns: the plane sees it (the job growing back onto it: tests/test_ray_long.py).
        ray_cluster.add(big)
        wait_for("the node back", lambda: any(e["kind"] == "node" and (e["data"] or {}).get("joined")
                                              for e in admin.events()), 60)
        lab.cancel(job)
        wait_for("the cancel", lambda: lab.job(job)["state"] == "cancelled", 60)

        # kill -9 as soon as the cancel is stored (its release not yet done, at times): the plane started
        # again releases what it does not adopt; every GPU of the cluster is free.
        p.crash()
        p.start()
        import ray

        import ray_cluster as rcm

        ray.init(address=ray_cluster.address, log_to_driver=False)
        try:
            assert rcm.held() == []
        finally:
            ray.shutdown()
    finally:
        p.stop()
        ray_cluster.restore()

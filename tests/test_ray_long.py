"""The longest Ray scenario, not run by ``make test`` (CI):
``TIDAL_RAY_LONG=1 pytest -s tests/test_ray_long.py``.

The GPT example (examples/gpt/train.py), FSDP2 and DDP, as a spot job of 2-3 GPUs through ``tidal up
--executor ray`` across nodes of the session's Ray cluster (tests/ray_cluster.py): the node holding
two ranks is lost mid-run, the job resumes on 2 ranks resharded from disk, the node comes back and
the job grows back to 3, and runs to the end. Then ``tidal verify-resume``'s check: an uninterrupted
run of the same job on 3 local ranks must have consumed the same global batch at every step, with the
loss within its tolerance (different world sizes sum in another order).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from plane_proc import Plane, wait_until
from tidal.bench.runs import Segment, SegmentResult, example_script, job_env, run_segment
from tidal.bench.verify import VerifyConfig, compare
from tidal.control.client import TidalClient

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray_long,
    pytest.mark.skipif(
        os.environ.get("TIDAL_RAY_LONG") != "1",
        reason="the longest Ray scenario (~2-2.5 min per layout): TIDAL_RAY_LONG=1 runs it",
    ),
]
CONFIG = """
restart_backoff_s: 0.2
hang_timeout_s: 120
startup_timeout_s: 180
kill_slack_s: 5
loop_interval_s: 0.2
scheduler: {min_runtime_before_preempt_s: 0, preempt_grace_s: 30}
"""


def attempts(jobs_dir: Path, job: str) -> list[SegmentResult]:
    """Each attempt's progress records, as ``compare`` takes them (the newest record of a step wins)."""
    out = []
    for adir in sorted((jobs_dir / job).glob("attempt-*"), key=lambda p: int(p.name.split("-")[1])):
        launch = json.loads((adir / "launch.json").read_text())
        records = {}
        for r in range(launch["world_size"]):
            p = adir / "progress" / f"progress-r{r:05d}.jsonl"
            records[r] = (
                [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
            )
        out.append(SegmentResult(Segment(launch["world_size"], "?"), [], 0.0, None, 0.0, records))
    return out


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_gpt_survives_node_loss_and_resumes_the_same_curve(ray_cluster, tmp_path, layout):
    cfg = VerifyConfig(steps=40, baseline=(3, layout), plan=[(3, layout)], global_batch=12, micro_batch=2,
                       ckpt_every=5)
    script = example_script()
    p = Plane(tmp_path, CONFIG, gpus=None, args=("--executor", "ray", "--ray-address", ray_cluster.address))
    ray_cluster.state_roots.append(p.state / "jobs")
    try:
        p.start()
        admin = p.admin

        def wait_for(what, pred, timeout_s=300.0):
            return wait_until(what, pred, timeout_s, lambda: "; events:\n" + "\n".join(
                f"{e['job']}: {e['kind']} {e['from']}->{e['to']}: {e['message']}" for e in admin.events()))

        lab = TidalClient(p.url, admin.create_tenant("lab", quota_gpus=0, weight=1.0)["token"])
        job = lab.submit(
            {
                "name": f"gpt-{layout}",
                "kind": "spot",
                "gpus": {"min": 2, "max": 3},
                "workdir": str(script.parent),
                "max_restarts": 0,
                "command": [sys.executable, str(script), "--parallel", layout, *cfg.job_args()],
            }
        )["id"]
        wait_for("a checkpoint", lambda: (lab.job(job)["progress"].get("durable_ckpt_step") or 0) >= 10)
        placement = lab.job(job)["placement"]
        big = max(placement, key=lambda n: placement[n])
        t0 = time.time()
        ray_cluster.remove(big)
        lost = wait_for("the node loss", lambda: [e for e in admin.events(job) if e["kind"] == "node_lost"])[
            0
        ]
        rec = wait_for("training again", lambda: [e for e in admin.events(job) if e["kind"] == "recovered"])[
            0
        ]
        ray_cluster.add(big)
        wait_for("the end", lambda: lab.job(job)["state"] in ("succeeded", "failed", "cancelled"), 600)
        j = lab.job(job)
        assert j["state"] == "succeeded" and j["restarts"] == 0, j["message"]
        d = rec["data"]
        print(
            f"\n{layout}: node {big} lost, detected {lost['time_s'] - t0:.2f} s after the kill, "
            "training again "
            f"{d['recovery_s']:.2f} s later on {d['world_size']} ranks from step {d['start_step']} "
            f"(tier {d['restore_tier']}); attempts {j['attempt']}"
        )
        resumed = attempts(p.state / "jobs", job)
        assert [r.segment.world for r in resumed][:2] == [3, 2]
    finally:
        p.stop()
        ray_cluster.restore()
    work = tmp_path / "baseline"
    shm = Path(
        tempfile.mkdtemp(prefix="tidal-ray-long-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    try:
        base = [run_segment(Segment(3, layout), script, cfg.job_args(), work, 0, env=job_env(work, shm),
                            timeout_s=600)]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result = compare(cfg, base, resumed)
    print(f"{layout}: same global batch at every step: {result['indices_identical']}; max relative loss "
          f"difference {result['max_rel_loss_diff']:.2e} at step {result['max_rel_loss_diff_step']} "
          f"(rtol {result['rtol']})")
    assert result["ok"], {
        k: result[k]
        for k in (
            "indices_identical",
            "first_index_mismatch_step",
            "missing_steps",
            "max_rel_loss_diff",
            "max_rel_loss_diff_step",
        )
    }

"""``tidal bench resume`` runs end to end on a tiny model: a notice, then resumes from node memory and
from disk as later attempts of one job (sandboxed ranks, one checkpoint key); bad options refused first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BENCH = [sys.executable, "-c", "from tidal.bench.cli import app; app()", "resume"]


@pytest.mark.slow
def test_bench_resume_json_resumes_from_node_memory_and_disk(tmp_path):
    proc = subprocess.run([*BENCH, "--world", "1", "--layout", "ddp", "--n-embd", "12", "--n-layer", "1",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = json.loads(proc.stdout)["runs"]
    assert run["notice"]["exit_codes"] and run["notice"]["committed_tiers"]
    assert {n: r["tier"] for n, r in run["resume"].items()} == {"node_memory": "shm", "disk": "disk"}
    assert run["resume"]["node_memory"]["restored_step"] == run["notice"]["stop_step"]
    assert 0 < run["resume"]["disk"]["restored_step"] <= run["notice"]["stop_step"]  # disk may lag the notice
    assert all(r["first_step_s"] > 0 for r in run["resume"].values())


def test_bench_resume_refuses_a_model_the_job_cannot_build(tmp_path):
    proc = subprocess.run([*BENCH, "--n-embd", "32"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "--n-embd 32" in proc.stderr

"""``python -m tidal.train.torchrun``: 75 when the ranks were preempted, torchrun's own code otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.contract import EXIT_PREEMPTED
from tidal.train.torchrun import preempted

WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
plan = sys.argv[1].split(",")
code = plan[rank]
if code == "wait":
    time.sleep(60)  # stopped by the agent when another rank exits
sys.exit(int(code))
"""


def launch(tmp_path: Path, plan: str, module: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.1", str(script), plan],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("plan, expected", [
    ("75,wait", EXIT_PREEMPTED),  # a rank stopped on a notice; the agent stopped the other with SIGTERM
    ("3,wait", 1),  # a real failure (the other rank SIGTERMed) stays a failure
    ("0,0", 0),
])
def test_exit_code_says_preempted(tmp_path, plan, expected):
    p = launch(tmp_path, plan, "tidal.train.torchrun")
    assert p.returncode == expected, p.stderr[-2000:]


@pytest.mark.slow
def test_plain_torchrun_folds_75_into_1(tmp_path):
    """Why the wrapper exists (torch 2.13): the elastic agent reports a preemption as a failure."""
    assert launch(tmp_path, "75,75", "torch.distributed.run").returncode == 1


def test_rule():
    assert preempted([75]) and preempted([75, -15]) and preempted([75, 75])
    assert not preempted([-15]) and not preempted([75, 1]) and not preempted([]) and not preempted([75, -9])

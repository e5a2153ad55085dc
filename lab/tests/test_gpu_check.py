"""``lab/gpu_check.py`` stays runnable without a GPU, with only what the GPU machine's image has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# -- the GPU check, run on CPU with only what the GPU machine's image has ------------------------

BLOCKER = """
import runpy, sys
BLOCK = {"fastapi", "sqlalchemy", "uvicorn", "obstore", "pydantic", "starlette", "ray"}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(name + " is not on the GPU machine")
sys.meta_path.insert(0, Blocker())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_gpu_check_runs_without_a_gpu_and_without_server_packages(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    tiny = "--n-layer 1 --n-embd 16 --n-head 2 --block 16 --global-batch 2 --micro-batch 2 --log-every 1"
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER,
            str(REPO / "lab" / "gpu_check.py"),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--sizes-gb",
            "0.004,0.006",
            "--d2h-gb",
            "0.004",
            "--repeat",
            "1",
            "--width",
            "256",
            "--gpt-steps",
            "2",
            "--gpt-args",
            tiny,
            "--scratch",
            str(tmp_path / "scratch"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["skipped"] == []
    assert res["d2h"]["pageable"]["gbps"] > 0
    plain = res["ckpt_0.004gb"]["plain"]
    assert plain["shm_tier"] and plain["stall_over_floor"] > 0
    assert res["ckpt_0.004gb"]["overlapped"]["staged_s"]["median"] > 0
    assert "overlapped" not in res["ckpt_0.006gb"]
    assert res["reshard"]["equal"] and res["reshard"]["tiers"] == ["disk"]
    assert res["reshard"]["read_amplification"] >= 1.0
    g = res["gpt"]
    assert [g[k]["rc"] for k in ("single", "single_resumed", "fsdp_torchrun")] == [0, 0, 0]
    assert g["single"]["steps_committed"][-1] == 2 and g["single_resumed"]["steps_committed"][-1] == 4

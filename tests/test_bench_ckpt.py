"""``tidal bench ckpt`` runs end to end on a tiny state and reports every number (never judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tidal.bench.ckpt import LOAD_METRICS, RATIOS, SAVE_METRICS


@pytest.mark.slow
def test_bench_ckpt_json(tmp_path):
    scratch, shm = tmp_path / "scratch", tmp_path / "shm"
    env = {**os.environ, "TIDAL_SHM_DIR": str(shm)}
    proc = subprocess.run(
        [sys.executable, "-c", "from tidal.bench.cli import app; app()",
         "ckpt", "--size-gb", "0.005", "--repeat", "1", "--json", "--dir", str(scratch)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)

    machine = result["machine"]
    assert machine["cpu_count"] > 0 and machine["torch"] and machine["platform"]
    assert isinstance(machine["cuda"], bool)
    assert result["size_bytes"] > 0 and result["tensors"] > 0
    assert result["repeat"] == 1
    for group, metrics in (("save", SAVE_METRICS), ("load", LOAD_METRICS)):
        assert set(result[group]) == set(metrics)
        for comp, names in metrics.items():
            assert set(result[group][comp]) == set(names)
            for name in names:
                s = result[group][comp][name]
                assert len(s["samples"]) == 1 and all(x > 0 for x in s["samples"]), (comp, name)
                assert s["median"] > 0
    assert set(result["ratios"]) == set(RATIOS)
    assert all(v > 0 for v in result["ratios"].values())
    assert {n for n, (_, _, goal) in RATIOS.items() if goal is not None} == set(result["targets"])
    for t in result["targets"].values():
        assert isinstance(t["pass"], bool) and t["target_max"] > 0
    assert result["notes"]
    assert "peers" not in result  # the peer engines are the lab's (python -m lab ckpt-peers)

    # Everything the run made is gone: the scratch directory's content and the shm staging.
    assert list(scratch.iterdir()) == []
    assert not (shm / "tidal").exists() or list((shm / "tidal").iterdir()) == []

"""``tidal bench tiers`` runs end to end on a tiny state (real SeaweedFS, real agents) and reports
every number it promises (never judged here: timings are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_tiers_json(tmp_path):
    env = {**os.environ, "TIDAL_SHM_DIR": str(tmp_path / "shm")}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tidal.bench.cli import app; app()",
            "tiers",
            "--size-mb",
            "2",
            "--repeat",
            "1",
            "--train-s",
            "1",
            "--rounds",
            "2",
            "--interval-s",
            "0.5",
            "--model-mb",
            "0.25",
            "--json",
            "--dir",
            str(tmp_path / "scratch"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert set(r["persist"]) == {"disk", "s3", "peer"} and set(r["load"]) == {"shm", "disk", "s3", "peer"}
    tr = r["train"]
    modes = ["none", "tidal", "tidal_s3_every_6", "dcp_async"]
    assert [x["mode"] for x in tr["runs"]] == modes and tr["rounds"] == 2
    for x in tr["runs"]:
        assert len(x["segment_steps_per_s"]) == 2 and x["steps_per_s"] > 0
        assert (x["saves"] > 0) == (x["mode"] != "none")
    assert set(tr["overhead"]) == set(tr["overhead_paired"]) == set(modes[1:])
    assert "paired: tidal" in " ".join(proc.stderr.split())
    assert not list((tmp_path / "scratch").iterdir())  # the scratch directory is removed at the end

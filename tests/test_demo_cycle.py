"""`tidal demo cycle`, shortened: real `tidal up` pieces, real GPT workers on virtual serving nodes.

Five hours of the shipped serving profile from 04:00 at 600x (30 s): the jobs grow onto lent serving
GPUs during the night trough, get reclaim notices before the morning rise, shrink or stop
after a final checkpoint, and every GPU goes back before its deadline. The API's view is checked at
every poll for a job on a serving node beyond what is lent there.
"""

from __future__ import annotations

import pytest
from rich.console import Console

from tidal.demo.cycle import CycleOptions, run_cycle

pytestmark = pytest.mark.slow


def test_a_short_night_lends_and_takes_back_in_time(tmp_path):
    opts = CycleOptions(
        speedup=600.0,
        hours=5.0,
        start_hour=4.0,
        history_days=2,
        serving_nodes="4x2",
        jobs=2,
        max_ranks=3,
        grace_s=5.0,
        final_checkpoint_s=2.0,
        release_s=1.0,
        warmup_s=2.0,
        restart_cost_s=5.0,
    )
    out = run_cycle(opts, Console(file=open(tmp_path / "view.txt", "w")))  # noqa: SIM115 (closed at exit)
    live = out["live"]
    assert not out["double_counted"], out["double_counted"]
    assert live["lent_gpus_total"] > 0 and live["used_gpu_hours"] > 0, live
    assert live["returned_gpus"] > 0 and live["returns_missed"] == 0, live
    assert live["worst_margin_s"] is not None and live["worst_margin_s"] >= 0
    assert live["reclaim_notices"] > 0
    assert all(j["ckpt_step"] is not None for j in live["jobs"])
    assert out["simulator"]["loaned_gpu_hours"] > 0
    assert out["ok"]

"""The scale run's synthetic jobs."""

from __future__ import annotations

import pytest

from lab.sim_scale import synthetic_trace


def test_synthetic_trace_total_work():
    jobs = synthetic_trace(500, days=3, gpus_per_node=8, seed=0, total_work_gpu_s=1e9)
    assert len(jobs) == 500 and sum(j.work_gpu_s for j in jobs) == pytest.approx(1e9)
    assert all(j.max_gpus == j.min_gpus for j in jobs if j.kind == "dedicated")

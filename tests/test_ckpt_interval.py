"""Checkpoint interval policy: the formulas, the clamps, and the decisions per job."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sched_fixtures import nodes, run, snap, tenants
from tidal.model import Loan, SetCkptInterval
from tidal.policy.ckpt_interval import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    CkptIntervalConfig,
    checkpoint_interval_s,
    daly_interval_s,
    job_mtti_s,
    mtti_s,
    plan_ckpt_intervals,
)


@pytest.mark.parametrize(("gpus", "rate", "risk", "want_s"), [
    (8, 1e-4, 0.0, 3600 / 8e-4),
    (8, 1e-4, 0.5, 3600 / 0.5008),
    (0, 1e-4, 0.0, math.inf),
    (16_384, LLAMA3_FAILURES_PER_GPU_HOUR, 0.0, 54 * 24 * 3600 / 419),  # Llama 3: one every ~3.1 h
])
def test_mtti(gpus, rate, risk, want_s):
    assert mtti_s(gpus, rate, risk) == pytest.approx(want_s)


@pytest.mark.parametrize(
    ("stall_s", "mtti", "young_s", "daly_s"),
    [
        # sqrt(2 * 60 * 86400) = 3219.94; Daly adds (1/3) sqrt(x) + x/9 with x = 60 / 172800.
        (60.0, 86_400.0, 3219.94 + 60, 3219.94 * (1 + math.sqrt(60 / 172_800) / 3 + 60 / 172_800 / 9)),
        (
            1.0,
            11_136.0,
            math.sqrt(2 * 11_136) + 1,
            math.sqrt(2 * 11_136) * (1 + math.sqrt(1 / 22_272) / 3 + 1 / 22_272 / 9),
        ),
        (0.0, 3600.0, 0.0, 0.0),
        (500.0, 200.0, math.sqrt(2 * 500 * 200) + 500, 200.0 + 500.0),  # stall >= 2 MTTI: Daly's tau = M
    ],
)
def test_young_and_daly(stall_s, mtti, young_s, daly_s):
    assert daly_interval_s(stall_s, mtti) == pytest.approx(daly_s, rel=1e-5)


@pytest.mark.parametrize(
    ("stall_s", "mtti", "persist_s", "want_s"),
    [
        (0.0, 3600.0, 0.0, 30.0),  # free saves: as often as the floor allows
        (0.05, 1e9, 0.0, 3600.0),  # almost no risk: the ceiling bounds unmodelled losses
        (
            0.5,
            11_136.0,
            0.0,
            pytest.approx(math.sqrt(2 * 0.5 * 11_136) * (1 + math.sqrt(0.5 / 22_272) / 3 + 0.5 / 22_272 / 9)),
        ),
        (0.5, 11_136.0, 200.0, 200.0),  # not faster than the durable tier can take a checkpoint
        (1.0, math.inf, 0.0, 3600.0),
    ],
)
def test_clamped_interval(stall_s, mtti, persist_s, want_s):
    assert checkpoint_interval_s(stall_s, mtti, CkptIntervalConfig(), persist_s) == want_s


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 600), st.floats(0, 600), st.floats(1, 1e7), st.floats(1, 1e7))
def test_interval_grows_with_stall_and_mtti_and_stays_in_bounds(d1, d2, m1, m2):
    cfg = CkptIntervalConfig()
    lo_d, hi_d = sorted((d1, d2))
    lo_m, hi_m = sorted((m1, m2))
    assert checkpoint_interval_s(lo_d, lo_m, cfg) <= checkpoint_interval_s(hi_d, lo_m, cfg) + 1e-9
    assert checkpoint_interval_s(lo_d, lo_m, cfg) <= checkpoint_interval_s(lo_d, hi_m, cfg) + 1e-9
    assert cfg.min_interval_s <= checkpoint_interval_s(d1, m1, cfg) <= cfg.max_interval_s


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="stall_s >= 0"):
        daly_interval_s(-1.0, 10.0)
    with pytest.raises(ValueError, match="min_interval_s"):
        CkptIntervalConfig(min_interval_s=100.0, max_interval_s=10.0)


def test_plan_per_job():
    """A job on a loaned node with surprise-reclaim risk checkpoints more often than the same job on
    the training pool; unmeasured, stopping and barely-changed jobs get no decision."""
    cfg = CkptIntervalConfig(failure_rate_per_gpu_hour=1e-3)
    n = nodes((8, 8, 8, 8, 8), (8,))
    loans = [Loan("s0", 8, reclaim_risk_per_hour=0.5)]
    t_mtti = mtti_s(8, 1e-3)
    l_mtti = mtti_s(8, 1e-3, 0.5)
    jobs = [
        run("train", {"t0": 8}, ckpt_stall_s=2.0),
        run("loaned", {"s0": 8}, ckpt_stall_s=2.0),
        run("unmeasured", {"t1": 8}),
        run("stopping", {"t2": 8}, releasing={"t2": 8}, ckpt_stall_s=2.0),
        run("steady", {"t3": 8}, ckpt_stall_s=2.0, ckpt_interval_s=daly_interval_s(2.0, t_mtti) * 1.1),
        run("moved", {"t4": 8}, ckpt_stall_s=2.0, ckpt_interval_s=daly_interval_s(2.0, t_mtti) * 2),
    ]
    s = snap(0.0, n, tenants(("a", 0)), [j for j in jobs], loans)
    assert job_mtti_s(jobs[1], {"s0": loans[0]}, cfg) == pytest.approx(l_mtti)
    got = plan_ckpt_intervals(s, cfg)
    assert got == [
        SetCkptInterval("train", pytest.approx(daly_interval_s(2.0, t_mtti))),
        SetCkptInterval("loaned", pytest.approx(daly_interval_s(2.0, l_mtti))),
        SetCkptInterval("moved", pytest.approx(daly_interval_s(2.0, t_mtti))),
    ]
    assert got[1].interval_s < got[0].interval_s

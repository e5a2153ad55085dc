"""Budget pacing (tidal.policy.budget_pacing) and the calibrator it moves."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from tidal.policy.budget_pacing import pace_update, paced_aim
from tidal.policy.loan import LoanContext, TidalPolicy


def test_pace_tightens_ahead_of_the_share_and_loosens_behind():
    assert paced_aim(0.8, 0.01, (0.0, 0.0), 1.0) == 0.8  # no demand yet
    assert paced_aim(0.8, 0.01, (2.0, 100.0), 0.0) == 0.8  # off
    assert paced_aim(0.8, 0.01, (1.0, 100.0), 1.0) == pytest.approx(0.8)  # on its share
    assert paced_aim(0.8, 0.01, (2.0, 100.0), 1.0) == pytest.approx(0.2)  # twice its share: the floor
    assert paced_aim(0.8, 0.01, (0.0, 100.0), 1.0) == pytest.approx(1.0)  # nothing spent: the ceiling
    w = pace_update((10.0, 1000.0), 1.0, 50.0, 600.0, 600.0)
    assert w == pytest.approx((5.0 + 600.0, 500.0 + 30000.0))


def _run(gain: float) -> tuple[float, float]:
    """A daily cycle, then from day 4 a client as large as the rest that comes on at random hours: the
    realized shortfall runs ahead of its share; the margin z after day 6 and the shortfall of days 4-6."""
    rng = np.random.default_rng(1)
    cfg = TidalPolicy.build(0.005, 600.0, horizon_s=6 * 3600.0).config
    pol = TidalPolicy(replace(cfg, pacing_gain=gain, ledger_allowance_pool_h=math.inf))
    st, lent, burst = pol.initial_state(), 0, 0
    at_shift = st
    for i in range(7 * 144):
        t = i * 600.0
        y = 40 + 20 * math.sin(2 * math.pi * t / 86400.0)
        if i >= 4 * 144:
            burst = burst - 1 if burst > 0 else (int(rng.integers(3, 12)) if rng.random() < 0.04 else 0)
            y += 50.0 if burst > 0 else 0.0
        if i == 4 * 144:
            at_shift = st
        plan, st = pol(LoanContext(t, 128, y, lent_gpus=lent), st)
        lent = plan.lendable_gpus
    return st.z, (st.shortfall_gpu_s - at_shift.shortfall_gpu_s) / (st.demand_gpu_s - at_shift.demand_gpu_s)


def test_pacing_raises_the_margin_when_shortfall_runs_ahead():
    z_off, short_off = _run(0.0)
    z_on, short_on = _run(1.0)
    assert z_on > z_off and short_on <= short_off

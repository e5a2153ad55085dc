"""The online promise (tidal.policy.budget_pacing) and the policy it moves."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from tidal.policy.budget_pacing import loosened, pace_update, promise
from tidal.policy.loan import LoanContext, TidalConfig, TidalPolicy


def test_the_promise_tightens_at_once_ahead_of_the_share_and_loosens_only_by_the_budget_left():
    assert promise((0.0, 0.0), 0.01, 2.0, 4.0) == (1.0, 1.0)  # no demand yet
    assert promise((2.0, 100.0), 0.01, 0.0, 4.0) == (1.0, 1.0)  # off
    assert promise((0.5, 100.0), 0.01, 2.0, 4.0) == pytest.approx((1.0, 0.5))  # half the share left
    assert promise((1.0, 100.0), 0.01, 2.0, 4.0) == pytest.approx((1.0, 0.0))  # on its share: nothing left
    assert promise((2.0, 100.0), 0.01, 2.0, 4.0) == pytest.approx((3.0, 0.0))  # twice its share
    assert promise((9.0, 100.0), 0.01, 2.0, 4.0) == (4.0, 0.0)  # the cap
    assert loosened(1.3, 0.0) == 1.3 and loosened(0.5, 1.0) == 0.5
    assert loosened(0.5, 0.0) == 1.0 and loosened(0.5, 0.5) == pytest.approx(0.75)
    assert pace_update((10.0, 1000.0), 1.0, 50.0, 600.0, 600.0) == pytest.approx((605.0, 30500.0))
    # asymmetric: one miss spends the window's budget at once; it comes back only as the window forgets
    w, b = (0.0, 0.0), 0.005
    for _ in range(144):
        w = pace_update(w, 0.0, 50.0, 600.0, 86400.0)
    w = pace_update(w, 60.0, 50.0, 600.0, 86400.0)
    assert promise(w, b, 2.0, 4.0)[0] > 1.0
    lefts = []
    for _ in range(144):
        w = pace_update(w, 0.0, 50.0, 600.0, 86400.0)
        lefts.append(promise(w, b, 2.0, 4.0)[1])
    assert lefts[5] < 0.2 and 0 < lefts[-1] < 0.8


def _run(cfg: TidalConfig, shift: bool = True) -> tuple[float, float, float]:
    """A daily cycle, then from day 4 (``shift``) a client as large as the rest that comes on at random
    hours: the margin z after day 6, the shortfall ratio of days 4-6 and the GPUs lent on days 1-3."""
    rng = np.random.default_rng(1)
    pol = TidalPolicy(replace(cfg, ledger_allowance_pool_h=math.inf))
    st, lent, burst, lent_before = pol.initial_state(), 0, 0, 0
    at_shift = st
    for i in range(7 * 144):
        t = i * 600.0
        y = 40 + 20 * math.sin(2 * math.pi * t / 86400.0)
        if i >= 4 * 144 and shift:
            burst = burst - 1 if burst > 0 else (int(rng.integers(3, 12)) if rng.random() < 0.04 else 0)
            y += 50.0 if burst > 0 else 0.0
        if i == 4 * 144:
            at_shift = st
        plan, st = pol(LoanContext(t, 128, y, lent_gpus=lent), st)
        lent = plan.lendable_gpus
        lent_before += lent if 144 <= i < 4 * 144 else 0
    short = (st.shortfall_gpu_s - at_shift.shortfall_gpu_s) / (st.demand_gpu_s - at_shift.demand_gpu_s)
    return st.z, short, lent_before


def test_the_promise_tightens_when_shortfall_runs_ahead_and_lends_more_while_it_runs_behind():
    base = TidalPolicy.build(0.005, 600.0, horizon_s=6 * 3600.0).config
    off = replace(base, pacing_gain=0.0, pacing_floor=1.0, pacing_half_life_s=86400.0)  # a day's window
    _, short_off, lent_off = _run(off)
    _, short_on, lent_on = _run(replace(off, pacing_gain=2.0, pacing_floor=0.5))
    assert short_on < 0.8 * short_off and lent_on > lent_off  # days 1-3: nothing spent, the reserve loosened
    assert _run(replace(off, pacing_gain=2.0))[1] < 0.8 * short_off  # tightening alone
    assert _run(replace(off, pacing_floor=0.5))[1] > short_off  # loosening without tightening: worse


def test_the_default_promise_tightens_with_a_week_of_memory_and_never_loosens():
    base = TidalPolicy.build(0.005, 600.0, horizon_s=6 * 3600.0).config
    assert (base.pacing_gain, base.pacing_half_life_s, base.pacing_floor) == (2.0, 7 * 86400.0, 1.0)
    off = replace(base, pacing_gain=0.0)
    z_off, short_off, lent_off = _run(off)
    z_on, short_on, lent_on = _run(base)
    assert short_on < 0.9 * short_off and lent_on == lent_off  # tighter on the shift; days 1-3 as without
    assert _run(base, shift=False)[1:] == _run(off, shift=False)[1:]  # no overrun: nothing moves


def test_bad_promise_settings_name_the_field():
    for bad in ({"pacing_gain": -1.0}, {"pacing_cap": 0.5}, {"pacing_floor": 0.0}, {"pacing_floor": 1.5}):
        with pytest.raises(ValueError, match="pacing_floor"):
            replace(TidalConfig(), **bad)

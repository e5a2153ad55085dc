"""The joint tail reserve (``TidalConfig.tail_joint``): the pairs it records, the reserve it sizes from
them, and the policy with it (budget kept on a regime change, state through the codec)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from test_loan import noisy_series  # a daily cycle, noise, rare bursts; a regime change on day 3
from tidal.policy import codec
from tidal.policy import joint_reserve as jr
from tidal.policy.forecast import ForecastConfig
from tidal.policy.loan import LoanContext, LoanTiming, TidalConfig, TidalPolicy

LEAD20 = LoanTiming(notice_s=0, final_checkpoint_s=0, release_s=0, warmup_s=1200, restart_cost_s=0)


def test_window_pair_is_the_worst_miss_above_the_centers_and_above_the_bounds():
    paths = jr.empty_paths(2)
    paths = jr.push_path(paths, 0.0, [10.0, 12.0], [3.0, 4.0])  # made at 0: targets 600, 1200
    paths = jr.push_path(paths, 600.0, [11.0, 13.0], [1.0, 9.0])  # made at 600: targets 1200, 1800
    # at 1200, y = 20: misses 20 - 12 = 8 (2 steps ahead, margin 4) and 20 - 11 = 9 (1 step, margin 1)
    assert jr.window_pair(paths, 1200.0, 20.0, 600.0) == (9.0, 8.0)
    assert jr.window_pair(paths, 1800.0, 20.0, 600.0) == (7.0, -2.0)  # only the plan of 600 targets it
    assert jr.window_pair(paths, 3000.0, 20.0, 600.0) is None  # nothing recorded targets it
    assert jr.window_pair(paths, 1500.0, 20.0, 600.0) is None  # off the grid


def test_the_reserve_covers_only_what_the_margin_in_force_did_not():
    """Ten lead windows, one missed by the whole mean. Its margin in force covered all but 5 % of it:
    the max rule needs no reserve for a 1 % budget (at most 5 % / 10 windows short whatever R), the
    default rule (as if z were 0) 0.9 of the mean. Covered all but 20 %: the max rule needs 0.9 (a
    reserve below the margin in force adds nothing), the additive rule 0.1 on top of the margin."""
    mean = 50.0

    def reserve(miss, uncovered, mode):
        ex = jr.excess_row((miss * mean, uncovered * mean), mean, mode)
        return jr.reserve_gpus(ex, 10.0, mean, 0.01, mode) / mean

    default = jr.reserve_gpus(jr.excess_row((mean, mean), mean, "max"), 10.0, mean, 0.01, "max") / mean
    assert default == pytest.approx(0.9)
    assert reserve(1.0, 0.05, "max") == 0.0
    assert reserve(1.0, 0.05, "add") == 0.0
    assert reserve(1.0, 0.2, "max") == pytest.approx(0.9)
    assert reserve(1.0, 0.2, "add") == pytest.approx(0.1)
    assert reserve(1.0, -0.3, "max") == 0.0  # covered with room
    # the prior (two windows missed by half the mean, nothing covered) alone, no history
    assert jr.reserve_gpus(None, 0.0, mean, 0.01, "max", 0.5, 2.0) / mean == pytest.approx(0.49)
    assert jr.reserve_gpus(None, 0.0, mean, 0.01, "max") == 0.0


def _run(cfg: TidalConfig, demand: np.ndarray, n: int = 100):
    pol = TidalPolicy(cfg)
    state, lent, plans = pol.initial_state(), 0, []
    for k, d in enumerate(demand):
        ctx = LoanContext(now_s=600.0 * k, serving_gpus=n, demand_gpus=float(d), lent_gpus=lent)
        p, state = pol(ctx, state)
        lent = p.lendable_gpus
        plans.append(p)
    return pol, state, plans


def test_a_margin_that_covers_every_spike_leaves_no_joint_reserve():
    """Demand 20 of 100 GPUs with a one-step spike to 60 every 4 hours, z held at 20 error scales: once
    the error scale is learnt the margin in force covers the spikes, so the joint reserve is 0 where the
    default one (sized as if z were 0) keeps 15-40 GPUs; the plan's margin is then z x scale alone."""
    demand = np.where(np.arange(3 * 144) % 24 == 23, 60.0, 20.0)[:-3]
    base = dict(shortfall_budget=0.01, forecast=ForecastConfig(horizon_s=3600.0), timing=LEAD20,
                initial_z=20.0, calibration_rate_per_h=0.0, ledger_allowance_pool_h=math.inf)
    pol_d, st_d, plans_d = _run(TidalConfig(**base), demand)
    pol_j, st_j, plans_j = _run(TidalConfig(**base, tail_joint="max"), demand)
    assert 15.0 < pol_d._reserve(st_d.forecast) < 40.0
    joint = pol_j._joint_observe(st_j, math.nan, math.nan, False)
    assert pol_j._reserve(st_j.forecast, joint) == 0.0  # 34.5 GPUs by the default rule
    assert st_j.joint_weight > 400  # every scored lead window went in
    assert sum(p.lendable_gpus for p in plans_j) > sum(p.lendable_gpus for p in plans_d)


@pytest.mark.parametrize("mode", ["max", "add"])
def test_joint_reserve_keeps_the_budget_through_a_regime_change(mode):
    demand = noisy_series(days=7, seed=1)
    cfg = TidalConfig(shortfall_budget=0.005, forecast=ForecastConfig(horizon_s=3600.0), timing=LEAD20,
                      tail_joint=mode)
    _, state, plans = _run(cfg, demand)
    assert state.shortfall_ratio <= 0.005
    assert sum(p.lendable_gpus for p in plans) / float(np.sum(100 - demand)) > 0.55


def test_joint_state_round_trips_and_an_older_state_switches_it_on():
    demand = noisy_series(days=2, seed=2)
    cfg = TidalConfig(shortfall_budget=0.005, forecast=ForecastConfig(horizon_s=3600.0), timing=LEAD20,
                      tail_joint="max")
    pol, state, _ = _run(cfg, demand[:200])
    back = codec.decode(json.loads(json.dumps(codec.encode(state))))
    assert np.array_equal(back.joint_excess, state.joint_excess)
    assert np.array_equal(back.joint_paths, state.joint_paths, equal_nan=True)
    assert back.joint_weight == state.joint_weight
    # a state stored before the joint reserve (no joint fields) continues with it switched on
    old_pol, old, _ = _run(TidalConfig(**{**cfg.__dict__, "tail_joint": ""}), demand[:200])
    doc = codec.encode(old)
    for k in ("joint_excess", "joint_weight", "joint_paths"):
        doc.pop(k)
    st = codec.decode(doc)
    lent = 0
    for k in range(200, 260):
        ctx = LoanContext(now_s=600.0 * k, serving_gpus=100, demand_gpus=float(demand[k]), lent_gpus=lent)
        p, st = pol(ctx, st)
        lent = p.lendable_gpus
    assert st.joint_weight > 50 and st.joint_paths.shape == (2, 5)
    # a stored memory that is not one (NaN excess, a negative weight, paths of another lead) starts afresh
    # instead of planning from it: NaN would size no reserve at all
    for bad in ({"joint_excess": np.full(jr.GRID.size, np.nan)}, {"joint_weight": -1.0}):
        excess, weight, _ = pol._joint_observe(replace(state, **bad), 600.0 * 200, math.nan, False)
        assert weight == 0.0 and not excess.any()
    other_lead = replace(state, joint_paths=np.zeros((3, 7)))
    _, _, paths = pol._joint_observe(other_lead, 600.0 * 200, math.nan, False)
    assert paths.shape == (2, 5) and np.isnan(paths).all()


def test_tail_joint_must_be_a_known_mode():
    with pytest.raises(ValueError, match="tail_joint"):
        TidalConfig(tail_joint="maximum")

"""``lab.forecast.bound``: margins over Tidal's forecast tuned with hindsight."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lab.forecast.bound import (
    _tune_z,
    contexts,
    largest_k,
    per_context_z,
    run,
    shrink_errors,
)
from lab.forecast.fluid import lent_from_upper
from lab.forecast.study import fluid_score


def test_lent_from_upper_takes_the_highest_bound_of_the_lead_and_the_demand_now():
    demand = np.array([10.0, 30.0, np.nan, 5.0])
    upper = np.array([[12.0, 20.5], [25.0, 25.0], [1.0, 1.0], [np.nan, 3.0]])
    # step 0: floor(64 - 20.5) = 43; step 1: demand now 30 > bound 25 -> 34; step 2: no observation now,
    # so only the bound limits (as in plan_loans) -> 63; step 3: a NaN bound lends nothing
    assert lent_from_upper(demand, upper, 64).tolist() == [43, 34, 63, 0]


def test_contexts_split_by_level_over_the_running_mean_and_time_of_day():
    times = np.array([0.0, 6 * 3600.0, 13 * 3600.0, 20 * 3600.0])
    demand = np.array([10.0, 10.0, 40.0, np.nan])
    # running means 10, 10, 20, 20 (the gap holds 40): levels 1, 1, 2, 2 -> buckets (edges 0.8, 1.2) 1, 1, 2,
    # 2
    # time of day in 4 buckets: 0, 1, 2, 3
    assert contexts(times, demand, (0.8, 1.2), 4).tolist() == [4, 5, 10, 11]


def _series(days: int = 4, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(days * 144)
    d = (30 + 12 * np.sin(2 * np.pi * t / 144)) * np.exp(rng.normal(0, 0.12, t.size))
    d[(t % 144 == 100) & (t > 144)] *= 1.8  # an evening burst every day
    return 600.0 * t, d


def test_constant_z_is_the_smallest_within_the_budget_and_contexts_never_do_worse():
    times, demand = _series()
    n, lead, warmup, budget = 64, 2, 144, 0.01
    center = np.stack([np.roll(demand, 1), np.roll(demand, 1)], axis=1)  # last value as the center
    center[0] = np.nan
    scale = np.full_like(center, 3.0)
    z = _tune_z(demand, center, scale, n, lead, warmup, budget)

    def short(zz: float) -> float:
        return fluid_score(lent_from_upper(demand, center + zz * scale, n), demand, n, lead, warmup)[
            "shortfall_strict"
        ]

    assert z > 0 and short(z) <= budget < short(z - 0.02)
    ctx = contexts(times, demand, (0.8, 1.2), 6)
    found = per_context_z(demand, center, scale, ctx, n, lead, warmup, budget, np.arange(0.0, 12.0001, 0.25))
    assert found is not None
    zs, s = found
    assert s["shortfall_strict"] <= budget
    assert len(set(zs[np.unique(ctx)].tolist())) > 1  # it did use the contexts


def test_run_reports_every_rule_against_the_oracle(tmp_path, capsys):
    times, demand = _series()
    p = tmp_path / "synthetic.csv"
    p.write_text(
        "seconds,requests_per_second\n"
        + "".join(f"{t:.0f},{v:.4f}\n" for t, v in zip(times, demand, strict=True))
    )
    result = run([p], serving_gpus=64, budgets=(0.01,), warmup_days=1.0, as_json=True)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    rows = result["traces"]["synthetic"]["budgets"]["0.01"]
    assert list(rows) == ["tidal (online)", "reactive (hindsight)", "constant z (hindsight)",
                          "per-context z (hindsight, in-sample)",
                          "constant z, errors x k to reach 0.85x (hindsight)",
                          "reactive holding all 4 rotations (hindsight)",
                          "constant z holding all 4 rotations (hindsight)",
                          "the same, errors x k to reach 0.85x (hindsight)", "oracle"]
    robust = rows["constant z holding all 4 rotations (hindsight)"]
    assert len(robust["rotations_shortfall"]) == 4 and max(robust["rotations_shortfall"]) <= 0.01
    assert robust["harvest"] <= rows["constant z (hindsight)"]["harvest"]  # holding more costs, never gains
    assert rows["reactive holding all 4 rotations (hindsight)"]["shortfall_strict"] <= 0.01
    for rule in ("constant z, errors x k to reach 0.85x (hindsight)",
                 "the same, errors x k to reach 0.85x (hindsight)"):
        r = rows[rule]
        assert r["margin"].startswith("k=1:") or r["harvest_over_oracle"] >= 0.85 - 1e-9, (rule, r)
    assert rows["oracle"]["harvest_over_oracle"] == 1.0 and rows["oracle"]["shortfall_strict"] == 0.0
    for rule in ("reactive (hindsight)", "constant z (hindsight)", "per-context z (hindsight, in-sample)"):
        assert rows[rule]["shortfall_strict"] <= 0.01
    assert (
        rows["per-context z (hindsight, in-sample)"]["harvest"] >= rows["constant z (hindsight)"]["harvest"]
    )
    assert all(0.0 <= r["harvest"] <= 1.0 and not math.isnan(r["harvest_over_oracle"]) for r in rows.values())


def test_errors_shrink_toward_the_truth_and_largest_k_bisects():
    center = np.array([[10.0, 12.0], [np.nan, 5.0]])
    truth = np.array([[14.0, 12.0], [7.0, np.nan]])
    assert shrink_errors(center, truth, 1.0).tolist()[0] == [10.0, 12.0]
    assert shrink_errors(center, truth, 0.0).tolist()[0] == [14.0, 12.0]
    assert shrink_errors(center, truth, 0.5)[0, 0] == 12.0
    half = shrink_errors(center, truth, 0.5)
    assert np.isnan(half[1, 0]) and half[1, 1] == 5.0  # no truth: the forecast as made
    assert largest_k(lambda k: k <= 0.37, tol=0.001) == pytest.approx(0.37, abs=0.001)
    assert largest_k(lambda k: True) is None  # the forecast as made is enough
    assert math.isnan(largest_k(lambda k: False))  # not even the truth reaches it


# --- lab.forecast.rotate ------------------------------------------------------------------


def test_rotate_days_moves_whole_days_to_the_end():
    from lab.forecast.rotate import rotate_days

    d = np.arange(6.0)  # three days of two steps
    assert rotate_days(d, 1, 2).tolist() == [2, 3, 4, 5, 0, 1]
    assert rotate_days(d, 0, 2).tolist() == d.tolist()
    with pytest.raises(ValueError, match="at least one whole day"):
        rotate_days(d[:1], 0, 2)


def test_rotations_report_each_budget_and_reject_days_outside_the_trace(tmp_path, capsys):
    from lab.forecast.rotate import run as rotate_run
    from lab.forecast.study import fluid_score as score

    times, demand = _series(days=4)
    p = tmp_path / "synthetic.csv"
    p.write_text(
        "seconds,requests_per_second\n"
        + "".join(f"{t:.0f},{v:.4f}\n" for t, v in zip(times, demand, strict=True))
    )
    result = rotate_run(
        [p], serving_gpus=64, budgets=(0.01, 0.05), rotations=[0, 2], warmup_days=1.0, as_json=True
    )
    capsys.readouterr()
    tr = result["traces"]["synthetic"]
    assert [(r["rotation"], r["budget"]) for r in tr["runs"]] == [(0, 0.01), (0, 0.05), (2, 0.01), (2, 0.05)]
    s = tr["summary"]["0.01"]
    assert s["rotations"] == 2 and s["met"] == sum(
        r["meets_budget"] for r in tr["runs"] if r["budget"] == 0.01
    )
    assert s["worst_shortfall"] == max(r["shortfall_strict"] for r in tr["runs"] if r["budget"] == 0.01)
    # rotation 0 is the trace as recorded: the same as driving the policy directly
    from lab.forecast.study import run_policy
    from tidal.policy.forecast import ForecastConfig
    from tidal.policy.loan import LoanTiming, TidalConfig, TidalPolicy

    timing = LoanTiming(notice_s=0, final_checkpoint_s=0, release_s=0, warmup_s=1200.0, restart_cost_s=0)
    written = np.round(demand, 4)  # as the CSV holds it
    d = 64 * written / written.max()
    lent, _ = run_policy(
        TidalPolicy(
            TidalConfig(
                shortfall_budget=0.01,
                timing=timing,
                forecast=ForecastConfig(step_s=600.0, horizon_s=6 * 3600.0),
            )
        ),
        times,
        d,
        64,
    )
    assert tr["runs"][0]["shortfall_strict"] == pytest.approx(score(lent, d, 64, 2, 144)["shortfall_strict"])
    with pytest.raises(ValueError, match=r"--rotations \[4\]: trace 'synthetic' has days 0..3"):
        rotate_run([p], serving_gpus=64, budgets=(0.01,), rotations=[4], warmup_days=1.0)

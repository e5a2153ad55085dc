"""The fluid model of lending (an early estimate, not the simulator) and the baselines tuned with
hindsight, shared by ``python -m lab forecast``, ``forecast-bound``, ``forecast-rotate`` and
``generalize``: see :mod:`lab.forecast.study`'s docstring for the shortfall definitions.

:func:`run_policy` drives a policy over a demand series (each decision at t sees data up to t);
:func:`fluid_score` scores what it lent. ``_tune_margin``/``_tune_offset`` bisect a baseline's knob
on the scored period itself (hindsight) to the largest harvest within a budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.policy.baselines import NightWindowPolicy
from tidal.policy.loan import LoanContext


def fluid_score(lent: np.ndarray, demand: np.ndarray, n: int, lead: int, warmup: int,
                day_steps: int = 144) -> dict[str, Any]:
    """Shortfall ratios (simple and strict) and harvest of a lent series; see the module docstring.

    ``worst_day`` is the scored day (index from the trace start, ``day_steps`` long) whose strict
    shortfall is the largest share of the whole scored period's shortfall.
    """
    d = np.nan_to_num(demand)
    ok = ~np.isnan(demand)
    idx = np.arange(warmup, len(d))
    idx = idx[ok[idx]]
    away_strict = np.array([lent[u - lead: u].max() for u in idx])
    away_issue = lent[idx - lead]
    demand_sum = float(d[idx].sum())
    short = np.maximum(0.0, d[idx] - (n - away_strict))
    by_day = np.bincount(idx // day_steps, weights=short)
    worst = int(np.argmax(by_day))
    return {
        "worst_day": {
            "day": worst,
            "share_of_shortfall": float(by_day[worst] / short.sum()) if short.sum() else 0.0,
        },
        "shortfall_strict": float(short.sum()) / demand_sum,
        "shortfall_issue": float(np.maximum(0.0, d[idx] - (n - away_issue)).sum()) / demand_sum,
        "harvest": float(lent[idx].sum()) / float((n - d[idx]).sum()),
        "mean_lent_gpus": float(lent[idx].mean()),
    }


def run_policy(policy: Any, times_s: np.ndarray, demand: np.ndarray, n: int,
               future: bool = False) -> tuple[np.ndarray, Any]:
    """Drive ``policy`` over the series; every lendable GPU is lent. Returns (lent per step, final state)."""
    state = policy.initial_state()
    lent = np.zeros(len(demand), dtype=int)
    prev = 0
    horizon = getattr(policy, "horizon_s", 0.0)
    for t in range(len(demand)):
        fut = None
        if future:
            k = max(1, math.ceil(horizon / (times_s[1] - times_s[0]) - 1e-9))
            fut = demand[t + 1: t + 1 + k]
        ctx = LoanContext(
            now_s=float(times_s[t]),
            serving_gpus=n,
            demand_gpus=float(demand[t]),
            lent_gpus=prev,
            future_demand_gpus=fut,
        )
        plan, state = policy(ctx, state)
        lent[t] = prev = plan.lendable_gpus
    return lent, state


def _tune_margin(make: Callable[[float], np.ndarray], demand: np.ndarray, n: int, lead: int, warmup: int,
                 budget: float) -> float:
    """Smallest margin (GPUs, to 0.01) whose strict shortfall is within ``budget`` (hindsight)."""
    lo, hi = 0.0, float(n)
    if fluid_score(make(lo), demand, n, lead, warmup)["shortfall_strict"] <= budget:
        return lo
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        if fluid_score(make(mid), demand, n, lead, warmup)["shortfall_strict"] <= budget:
            hi = mid
        else:
            lo = mid
    return hi


def _reactive_lent(demand: np.ndarray, n: int, margin: float) -> np.ndarray:
    """Vectorized :class:`ReactivePolicy` with no minimum loan window (checked against it below)."""
    last = demand.copy()
    for t in range(1, len(last)):  # hold the last observation through gaps
        if math.isnan(last[t]):
            last[t] = last[t - 1]
    up = np.where(np.isnan(last), float(n), last + margin)
    free = np.clip(np.floor(n - up + 1e-9), 0, n)
    now_cap = np.where(np.isnan(demand), n, np.floor(n - np.nan_to_num(demand) + 1e-9))
    return np.minimum(free, now_cap).astype(int)


def _night_lent(
    policy: NightWindowPolicy, times_s: np.ndarray, n: int, margin: float, lead: int
) -> np.ndarray:
    """Vectorized :class:`NightWindowPolicy` with no minimum loan window: lend ``N - margin`` when
    every grid point of the next lead time is inside the window."""
    step = times_s[1] - times_s[0]
    ahead = times_s[:, None] + step * np.arange(1, lead + 1)[None, :]
    inside = policy.in_window(ahead).all(axis=1)
    return np.where(inside, np.clip(np.floor(n - min(float(n), margin) + 1e-9), 0, n), 0).astype(int)


def night_window(
    demand: np.ndarray, step_s: float, hours: float, period_s: float = 86400.0
) -> tuple[float, float]:
    """(start_s, end_s) of the lowest-mean-demand ``hours`` of the period, from the whole series
    (hindsight)."""
    period = round(period_s / step_s)
    width = max(1, round(hours * 3600 / step_s))
    n = len(demand) // period * period
    prof = np.nanmean(demand[:n].reshape(-1, period), axis=0)
    sums = [np.nansum(prof[(np.arange(width) + s) % period]) for s in range(period)]
    s = int(np.argmin(sums))
    return s * step_s, ((s + width) % period) * step_s


def _tune_offset(make: Callable[[float], np.ndarray], demand: np.ndarray, n: int, lead: int, warmup: int,
                 budget: float, lo: float, hi: float) -> float:
    """Smallest ``x`` in ``[lo, hi]`` (to 0.01) whose strict shortfall is within ``budget`` (hindsight; ``hi``
    if none)."""
    def ok(x: float) -> bool:
        return fluid_score(make(x), demand, n, lead, warmup)["shortfall_strict"] <= budget
    if ok(lo):
        return lo
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def lent_from_upper(demand: np.ndarray, upper: np.ndarray, n: int) -> np.ndarray:
    """What the loan plan lends from a bound over the lead time (no minimum loan window): the floor of
    ``N - max(upper)``, and at most ``N - demand now``. NaN bounds lend nothing."""
    top = np.nanmax(np.where(np.isnan(upper), np.inf, upper), axis=1) if upper.ndim == 2 else upper
    free = np.clip(np.floor(n - np.where(np.isfinite(top), top, n) + 1e-9), 0, n)
    now = np.where(np.isnan(demand), n, np.floor(n - np.nan_to_num(demand) + 1e-9))
    return np.minimum(free, now).astype(int)

"""The baselines Tidal's loan policy is compared with, each with a fixed margin knob (GPUs), in the same
interface as :class:`~tidal.policy.loan.TidalPolicy` (a context and a state in, a plan and a state out):
:class:`ReactivePolicy` (lend what is idle now minus the margin), :class:`NightWindowPolicy` (lend
``N - margin`` during fixed hours) and :class:`OraclePolicy` (given the future demand). Pure, as the
rest of :mod:`tidal.policy`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tidal.policy.loan import EPS, LoanContext, LoanPlan, LoanTiming, plan_loans


def _grid(now_s: float, step_s: float, horizon_s: float) -> np.ndarray:
    return now_s + step_s * np.arange(1, max(1, math.ceil(horizon_s / step_s - EPS)) + 1)


@dataclass(frozen=True)
class ReactivePolicy:
    """Lend what is idle now minus ``margin_gpus``; reclaim when that shrinks (no look-ahead).

    Its upper bound is flat at ``demand now + margin``, so its plans carry no deadlines: it
    reclaims only once a new observation shows less idle capacity, a lead time too late unless the
    margin absorbs the rise. Holds its last bound through missing observations.
    """

    margin_gpus: float = 0.0
    step_s: float = 600.0
    horizon_s: float = 6 * 3600.0
    timing: LoanTiming = field(default_factory=LoanTiming)

    def initial_state(self) -> float:
        return math.nan  # the last observed demand

    def __call__(self, ctx: LoanContext, state: float) -> tuple[LoanPlan, float]:
        last = state if math.isnan(ctx.demand_gpus) else float(ctx.demand_gpus)
        times = _grid(ctx.now_s, self.step_s, self.horizon_s)
        level = float(ctx.serving_gpus) if math.isnan(last) else last + self.margin_gpus
        plan = plan_loans(
            now_s=ctx.now_s,
            serving_gpus=ctx.serving_gpus,
            lent_gpus=ctx.lent_gpus,
            demand_now_gpus=ctx.demand_gpus,
            times_s=times,
            upper_gpus=np.full(times.shape, level),
            timing=self.timing,
            margin_gpus=self.margin_gpus,
        )
        return plan, last


@dataclass(frozen=True)
class NightWindowPolicy:
    """Lend ``N - margin_gpus`` GPUs from ``start_s`` to ``end_s`` of every ``period_s`` (a day).

    Times are positions in the period (``t mod period``); a window may wrap past the period's end
    (start 22 h, end 6 h). Demand is not looked at: the margin alone protects serving. Loans are
    planned to be back at the window's end.
    """

    start_s: float
    end_s: float
    margin_gpus: float = 0.0
    period_s: float = 86400.0
    step_s: float = 600.0
    horizon_s: float = 6 * 3600.0
    timing: LoanTiming = field(default_factory=LoanTiming)

    def initial_state(self) -> None:
        return None

    def in_window(self, t_s: np.ndarray | float) -> np.ndarray:
        pos = np.mod(t_s, self.period_s)
        a, b = self.start_s % self.period_s, self.end_s % self.period_s
        return (pos >= a) & (pos < b) if a <= b else (pos >= a) | (pos < b)

    def __call__(self, ctx: LoanContext, state: None) -> tuple[LoanPlan, None]:
        times = _grid(ctx.now_s, self.step_s, self.horizon_s)
        n = float(ctx.serving_gpus)
        upper = np.where(self.in_window(times), min(n, self.margin_gpus), n)
        plan = plan_loans(now_s=ctx.now_s, serving_gpus=ctx.serving_gpus, lent_gpus=ctx.lent_gpus,
                          demand_now_gpus=math.nan, times_s=times, upper_gpus=upper,
                          timing=self.timing, margin_gpus=self.margin_gpus)
        return plan, None


@dataclass(frozen=True)
class OraclePolicy:
    """Knows the future: plans from ``ctx.future_demand_gpus + margin_gpus`` (the upper bound).

    ``ctx.future_demand_gpus[k]`` is demand at ``now + (k + 1) * step_s``; NaN entries (unknown) and
    points past the array count as the full pool.
    """

    margin_gpus: float = 0.0
    step_s: float = 600.0
    horizon_s: float = 6 * 3600.0
    timing: LoanTiming = field(default_factory=LoanTiming)

    def initial_state(self) -> None:
        return None

    def __call__(self, ctx: LoanContext, state: None) -> tuple[LoanPlan, None]:
        if ctx.future_demand_gpus is None:
            raise ValueError("OraclePolicy needs ctx.future_demand_gpus (demand at now + k * step_s)")
        times = _grid(ctx.now_s, self.step_s, self.horizon_s)
        n = float(ctx.serving_gpus)
        fut = np.full(times.shape, n)
        known = np.asarray(ctx.future_demand_gpus, dtype=float)[: times.size]
        fut[: known.size] = np.where(np.isnan(known), n, known + self.margin_gpus)
        plan = plan_loans(now_s=ctx.now_s, serving_gpus=ctx.serving_gpus, lent_gpus=ctx.lent_gpus,
                          demand_now_gpus=ctx.demand_gpus, times_s=times, upper_gpus=fut,
                          timing=self.timing, margin_gpus=self.margin_gpus)
        return plan, None

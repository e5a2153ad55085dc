"""The baselines Tidal's loan policy is compared with, each with a fixed margin knob (GPUs), in the
interface of :class:`~tidal.policy.loan.TidalPolicy`: :class:`ReactivePolicy` (idle now minus the
margin), :class:`NightWindowPolicy` (``N - margin`` during fixed hours) and :class:`OraclePolicy`
(given the future demand). Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.policy.loan import EPS, LoanContext, LoanPlan, LoanTiming, plan_loans


@dataclass(frozen=True, kw_only=True)
class _Baseline:
    """What every baseline has: its margin (GPUs), the grid and horizon it plans on, the loan timing."""

    margin_gpus: float = 0.0
    step_s: float = 600.0
    horizon_s: float = 6 * 3600.0
    timing: LoanTiming = field(default_factory=LoanTiming)

    def initial_state(self) -> Any:
        return None

    def _grid(self, now_s: float) -> np.ndarray:
        return now_s + self.step_s * np.arange(1, max(1, math.ceil(self.horizon_s / self.step_s - EPS)) + 1)

    def _plan(self, ctx: LoanContext, times: np.ndarray, upper: np.ndarray, demand_now: float) -> LoanPlan:
        return plan_loans(now_s=ctx.now_s, serving_gpus=ctx.serving_gpus, lent_gpus=ctx.lent_gpus,
                          demand_now_gpus=demand_now, times_s=times, upper_gpus=upper, timing=self.timing,
                          margin_gpus=self.margin_gpus)


@dataclass(frozen=True, kw_only=True)
class ReactivePolicy(_Baseline):
    """Lend what is idle now minus ``margin_gpus``; no look-ahead, so its plans carry no deadlines and it
    reclaims only once an observation shows less idle capacity. Holds its last bound through gaps."""

    def initial_state(self) -> float:
        return math.nan  # the last observed demand

    def __call__(self, ctx: LoanContext, state: float) -> tuple[LoanPlan, float]:
        last = state if math.isnan(ctx.demand_gpus) else float(ctx.demand_gpus)
        times = self._grid(ctx.now_s)
        level = float(ctx.serving_gpus) if math.isnan(last) else last + self.margin_gpus
        return self._plan(ctx, times, np.full(times.shape, level), ctx.demand_gpus), last


@dataclass(frozen=True, kw_only=True)
class NightWindowPolicy(_Baseline):
    """Lend ``N - margin_gpus`` GPUs from ``start_s`` to ``end_s`` of every ``period_s`` (positions in the
    period; the window may wrap past its end), blind to demand; loans are due back at the window's end."""

    start_s: float
    end_s: float
    period_s: float = 86400.0

    def in_window(self, t_s: np.ndarray | float) -> np.ndarray:
        pos = np.mod(t_s, self.period_s)
        a, b = self.start_s % self.period_s, self.end_s % self.period_s
        return (pos >= a) & (pos < b) if a <= b else (pos >= a) | (pos < b)

    def __call__(self, ctx: LoanContext, state: None) -> tuple[LoanPlan, None]:
        times = self._grid(ctx.now_s)
        n = float(ctx.serving_gpus)
        upper = np.where(self.in_window(times), min(n, self.margin_gpus), n)
        return self._plan(ctx, times, upper, math.nan), None


@dataclass(frozen=True, kw_only=True)
class OraclePolicy(_Baseline):
    """Plans from ``ctx.future_demand_gpus + margin_gpus`` (``[k]``: demand at ``now + (k + 1) * step_s``;
    NaN and points past the array count as the full pool): the upper bound."""

    def __call__(self, ctx: LoanContext, state: None) -> tuple[LoanPlan, None]:
        if ctx.future_demand_gpus is None:
            raise ValueError("OraclePolicy needs ctx.future_demand_gpus (demand at now + k * step_s)")
        times = self._grid(ctx.now_s)
        n = float(ctx.serving_gpus)
        fut = np.full(times.shape, n)
        known = np.asarray(ctx.future_demand_gpus, dtype=float)[: times.size]
        fut[: known.size] = np.where(np.isnan(known), n, known + self.margin_gpus)
        return self._plan(ctx, times, fut, ctx.demand_gpus), None

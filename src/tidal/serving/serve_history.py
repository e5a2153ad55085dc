"""Forecast history for a serving side that measures its own demand (the Ray Serve adapter), so that
its first day is not planned blind. Two sources, on the serving clock and the loan step's grid: a
request-rate trace of earlier days (``serving.trace``, read at the measured service rate or else
``service_rate_per_replica`` through the adapter's :class:`~tidal.serving.requests.RequestModel`; gaps
stay NaN), and what the adapter measured (:class:`MeasuredHistory`, persisted with the adapter),
which wins where it has a point. :func:`forecast_history` joins them for
:class:`tidal.control.loans.LiveLoans` to feed a forecast before its first live step.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Any

from tidal.serving.requests import RequestModel
from tidal.serving.traces import Trace

MAX_MEASURED = 4032  # demand observations kept: four weeks of 10-minute steps (the forecast's week memory)
MAX_HISTORY_DAYS = 28.0  # serving.history_days at most: a warm-up feeds the policy once per step (~1 ms)
DAY_S = 86400.0


class MeasuredHistory:
    """The adapter's own demand observations, newest :data:`MAX_MEASURED`: rows ``(t_s, rate_per_s,
    service_rate_per_replica or None when not measured, gpus)``. Not thread-safe (the loop owns it)."""

    def __init__(self, rows: Iterable[Sequence[Any]] = ()) -> None:
        self.rows: collections.deque[tuple[float, float, float | None, float]] = collections.deque(
            maxlen=MAX_MEASURED)
        for r in rows:
            self.add(*r)

    def add(self, t_s: float, rate_per_s: float, service_rate: float | None, gpus: float) -> None:
        """One observation; a time not after the newest replaces nothing and is ignored (a clock that went
        back, e.g. a resumed plane's first step on the same grid point)."""
        if self.rows and not t_s > self.rows[-1][0]:
            return
        mu = None if service_rate is None else float(service_rate)
        self.rows.append((float(t_s), float(rate_per_s), mu, float(gpus)))

    def service_rate(self) -> float | None:
        """The newest measured service rate per replica (None: never measured)."""
        for r in reversed(self.rows):
            if r[2] is not None:
                return r[2]
        return None

    def to_doc(self) -> list[list[float | None]]:
        return [[round(t, 3), round(x, 4), None if mu is None else round(mu, 4), round(g, 3)]
                for t, x, mu, g in self.rows]

    @classmethod
    def from_doc(cls, doc: Any) -> MeasuredHistory:
        """From :meth:`to_doc`'s list (the newest :data:`MAX_MEASURED` rows kept); ``ValueError`` naming the
        first bad row."""
        if not isinstance(doc, list):
            raise ValueError(f"measured: expected a list of rows, got {type(doc).__name__}")
        out = cls()
        for i, r in enumerate(doc[-MAX_MEASURED:]):
            ok = isinstance(r, list | tuple) and len(r) == 4 and all(
                v is None or (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
                for v in r) and None not in (r[0], r[1], r[3])
            if not ok or r[1] < 0 or r[3] < 0 or (r[2] is not None and not r[2] > 0):
                raise ValueError(f"measured[{i}]: expected [serving time, requests/s >= 0, service rate > 0 "
                                 f"or null, GPUs >= 0], got {r!r}")
            out.add(*r)
        return out

    def __len__(self) -> int:
        return len(self.rows)


def history_grid(until_s: float, seconds: float, step_s: float) -> list[float]:
    """The points of the ``step_s`` grid (multiples of it) in the ``seconds`` before ``until_s`` (excluded):
    where a forecast is warmed with recorded demand before the first live step."""
    first = math.ceil((until_s - seconds) / step_s - 1e-9) * step_s
    return [first + i * step_s for i in range(max(0, int(round((until_s - first) / step_s))))]


def forecast_history(until_s: float, step_s: float, *, days: float, trace: Trace | None,
                     model: RequestModel | None, measured: MeasuredHistory,
                     max_gpus: float) -> list[tuple[float, float]]:
    """``(serving time, GPUs)`` on the ``step_s`` grid over the ``days`` before ``until_s``: the measured
    point where there is one, else the trace's row through ``model`` (capped at ``max_gpus``); points
    neither covers are left out (missing to the forecast)."""
    days = min(days, MAX_HISTORY_DAYS)
    grid = history_grid(until_s, days * DAY_S, step_s)
    first, n = (grid[0] if grid else until_s), len(grid)
    seen: dict[int, float] = {}
    for t, _, _, g in measured.rows:
        k = round((t - first) / step_s)
        if 0 <= k < n:
            seen[k] = g
    rows: dict[int, float] = {}
    if trace is not None and model is not None and len(trace.times_s):
        t0, tstep, last = float(trace.times_s[0]), trace.step_s, len(trace.times_s) - 1
        gpus = trace.request_demand_gpus(model)
        for k, t in enumerate(grid):
            i = math.floor((t - t0) / tstep + 1e-9)
            if 0 <= i <= last:
                g = float(gpus[i])
                rows[k] = g if math.isnan(g) else min(g, max_gpus)
    out = []
    for k, t in enumerate(grid):
        if k in seen:
            out.append((t, seen[k]))
        elif k in rows:
            out.append((t, rows[k]))
    return out


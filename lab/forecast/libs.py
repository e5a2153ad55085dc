"""Forecasting libraries as competitors in ``python -m lab forecast`` (benchmark only; lazily imported).

Each library forecasts the same series on the same causal protocol as the other methods: a model
fitted at the start of each day on the data up to then (``refit_steps``), applied at every step to the
history up to that step; telemetry gaps are held at the last value for the library (it takes no NaN).

* ``ets`` — statsforecast ``AutoETS`` with an additive daily season (``ZZA``, 144 slots at 10 min):
  the model's own prediction intervals (``level``), and its point forecast for the loan bound.
* ``lightgbm`` — LightGBM quantile regression (``objective="quantile"``) of the change from the demand
  now to the target, on lags, rolling statistics, time of day, day of week and the same slot one day and
  one week before (NaN until seen). One model per quantile; for the loan bound, one more for the peak of
  the lead window at ``peak_quantile``.

``MSTL`` (daily + weekly seasons) was tried: its ``forward`` redoes the STL decomposition at every
call (0.37 s per step here, about 12 minutes per trace), too slow for a step-by-step protocol.

Missing library: :func:`library_forecasts` returns ``{name: "not installed (pip install ...)"}`` and the
benchmark prints that line instead of the rows. Install with ``pip install -r lab/requirements.txt``.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

INSTALL = "pip install -r lab/requirements.txt"


def _held(demand: np.ndarray) -> np.ndarray:
    """Gaps (NaN) held at the last value (leading gaps at the first value)."""
    y = demand.copy()
    ok = ~np.isnan(y)
    if not ok.any():
        return np.zeros_like(y)
    y[: int(np.argmax(ok))] = y[int(np.argmax(ok))]
    for i in range(1, len(y)):
        if math.isnan(y[i]):
            y[i] = y[i - 1]
    return y


def ets_forecasts(demand: np.ndarray, *, lead: int, warmup: int, quantiles: tuple[float, ...], period: int,
                  refit_steps: int) -> dict[str, Any]:
    """AutoETS: per quantile, its native upper bound for the demand ``lead`` ahead; its point path for the
    lead window (``center``: steps x lead) and its native sigma per horizon (``scale``, from the 90 %
    interval)."""
    from statsforecast.models import AutoETS

    y = _held(demand)
    n = len(y)
    levels = {q: round(100 * (2 * q - 1), 4) for q in quantiles}
    names = {q: f"hi-{int(v) if v == int(v) else v}" for q, v in levels.items()}
    z90 = NormalDist().inv_cdf(0.95)
    upper = {q: np.full(n, np.nan) for q in quantiles}
    center = np.full((n, lead), np.nan)
    scale = np.full((n, lead), np.nan)
    model = None
    for t in range(max(warmup - lead, 10), n):
        if model is None or (t - warmup) % refit_steps == 0:
            try:  # with too little data the seasonal model cannot be fitted; then none, until the next refit
                model = AutoETS(season_length=period, model="ZZA").fit(y[: t + 1])
            except Exception:  # statsforecast raises a bare Exception ("no model able to be fitted")
                model = None
            if model is None:
                model = AutoETS(model="ZZN").fit(y[: t + 1])
        r = model.forward(
            y[: t + 1], h=lead, level=[90, *(int(v) if v == int(v) else v for v in levels.values())]
        )
        center[t] = np.maximum(r["mean"], 0.0)
        scale[t] = np.maximum(r["hi-90"] - r["mean"], 0.0) / z90
        for q in quantiles:
            upper[q][t] = r[names[q]][lead - 1]
    return {"upper": upper, "center": center, "scale": scale}


def _lgb_features(y: np.ndarray, times_s: np.ndarray, period: int) -> np.ndarray:
    n = len(y)
    week = 7 * period

    def lag(k: int) -> np.ndarray:
        out = np.full(n, np.nan)
        out[k:] = y[:-k] if k else y
        return out

    def roll(w: int, fn: Any) -> np.ndarray:
        out = np.full(n, np.nan)
        for t in range(w - 1, n):
            out[t] = fn(y[t - w + 1: t + 1])
        return out

    tod = 2 * np.pi * (times_s % 86400.0) / 86400.0
    dow = (times_s // 86400.0) % 7
    cols = [
        y,
        y - lag(1),
        y - lag(2),
        y - lag(3),
        roll(6, np.mean) - y,
        roll(36, np.mean) - y,
        roll(6, np.std),
        np.sin(tod),
        np.cos(tod),
        dow,
        lag(period - 2) - y,
        lag(week - 2) - y,
    ]
    return np.column_stack(cols)


def lightgbm_forecasts(demand: np.ndarray, times_s: np.ndarray, *, lead: int, warmup: int,
                       quantiles: tuple[float, ...], period: int, refit_steps: int,
                       peak_quantile: float = 0.9) -> dict[str, Any]:
    """LightGBM quantile regression: per quantile, the upper bound for the demand ``lead`` ahead; and the
    ``peak_quantile`` bound on the lead window's peak (``center``: steps x 1, no scale)."""
    import lightgbm as lgb

    y = _held(demand)
    n = len(y)
    x = _lgb_features(y, times_s, period)
    point = np.full(n, np.nan)
    point[: n - lead] = demand[lead:] - y[: n - lead]
    peak = np.full(n, np.nan)
    for h in range(1, lead + 1):
        peak[: n - h] = np.fmax(peak[: n - h], demand[h:])
    peak -= y
    targets = {q: point for q in quantiles} | {"peak": peak}
    alphas = {q: q for q in quantiles} | {"peak": peak_quantile}
    preds = {k: np.full(n, np.nan) for k in targets}
    params = dict(objective="quantile", learning_rate=0.05, num_leaves=15, min_data_in_leaf=20, verbose=-1,
                  num_threads=1, seed=0)
    for start in range(warmup, n, refit_steps):
        known = np.arange(0, start - lead + 1)  # rows whose targets are known at ``start``
        stop = min(n, start + refit_steps)
        for k, tgt in targets.items():
            ok = known[~np.isnan(tgt[known])]
            if ok.size < 50:
                continue
            m = lgb.train({**params, "alpha": alphas[k]}, lgb.Dataset(x[ok], tgt[ok]), num_boost_round=200)
            preds[k][start:stop] = m.predict(x[start:stop])
    upper = {q: y + preds[q] for q in quantiles}
    return {"upper": upper, "center": (y + preds["peak"])[:, None], "scale": np.zeros((n, 1))}


def library_forecasts(
    times_s: np.ndarray,
    demand: np.ndarray,
    *,
    lead: int,
    warmup: int,
    quantiles: tuple[float, ...],
    step_s: float,
    period_s: float = 86400.0,
) -> dict[str, Any]:
    """``{name: forecasts}`` for each library, or ``{name: "not installed (...)"}`` where it is missing."""
    period = round(period_s / step_s)
    refit = period
    out: dict[str, Any] = {}
    for name, module, run in (
        ("ets (statsforecast AutoETS)", "statsforecast",
         lambda: ets_forecasts(demand, lead=lead, warmup=warmup, quantiles=quantiles, period=period,
                               refit_steps=refit)),
        ("lightgbm (quantile)", "lightgbm",
         lambda: lightgbm_forecasts(demand, times_s, lead=lead, warmup=warmup, quantiles=quantiles,
                                    period=period, refit_steps=refit)),
    ):
        try:
            __import__(module)
        except ImportError:
            out[name] = f"not installed ({INSTALL})"
            continue
        out[name] = run()
    return out

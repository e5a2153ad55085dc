"""The simple forecasters ``python -m lab forecast`` scores Tidal's forecast against (Holt-Winters with
constants picked on the warm-up days, split-conformal bounds over time) and the pinball loss. The
library forecasters (statsforecast, LightGBM) are in :mod:`lab.forecast.libs`."""

from __future__ import annotations

import math

import numpy as np


def _pinball(y: np.ndarray, q: np.ndarray, tau: float) -> float:
    d = y - q
    return float(np.mean(np.maximum(tau * d, (tau - 1.0) * d)))


def _conformal_upper(point: np.ndarray, demand: np.ndarray, lead: int, tau: float) -> np.ndarray:
    """point[t] + the tau-quantile of all errors ``demand[s + lead] - point[s]`` known at t
    (s + lead <= t)."""
    n = len(demand)
    err = np.full(n, np.nan)
    err[: n - lead] = demand[lead:] - point[: n - lead]
    out = np.full(n, np.nan)
    for t in range(n):
        known = err[: max(0, t - lead + 1)]
        known = known[~np.isnan(known)]
        if known.size >= 10 and not math.isnan(point[t]):
            out[t] = point[t] + np.quantile(known, tau)
    return out


def _holt_winters(demand: np.ndarray, period: int, lead: int, alpha: float, beta: float,
                  gamma: float) -> np.ndarray:
    """Additive Holt-Winters; returns the lead-step point forecast made at each t (NaN before a period)."""
    n = len(demand)
    out = np.full(n, np.nan)
    first = demand[:period]
    if np.isnan(first).all():
        return out
    level = float(np.nanmean(first))
    trend = 0.0
    season = np.nan_to_num(first - level)
    for t in range(period, n):
        y = demand[t]
        s = t % period
        if not math.isnan(y):
            prev = level
            level = alpha * (y - season[s]) + (1 - alpha) * (level + trend)
            trend = beta * (level - prev) + (1 - beta) * trend
            season[s] = gamma * (y - level) + (1 - gamma) * season[s]
        out[t] = max(0.0, level + lead * trend + season[(t + lead) % period])
    return out


def _fit_holt_winters(demand: np.ndarray, period: int, lead: int, warmup: int) -> tuple[float, float, float]:
    """Smoothing constants with the least squared lead-step error on the warm-up only."""
    best, best_err = (0.3, 0.01, 0.1), math.inf
    head = demand[:warmup]
    for a in (0.1, 0.3, 0.5, 0.7):
        for b in (0.0, 0.01, 0.05):
            for g in (0.05, 0.2, 0.4):
                f = _holt_winters(head, period, lead, a, b, g)
                e = head[lead:] - f[:-lead]
                e = e[~np.isnan(e)]
                if e.size and float(np.mean(e**2)) < best_err:
                    best, best_err = (a, b, g), float(np.mean(e**2))
    return best

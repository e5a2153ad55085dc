"""The forecast's error distributions, kept as histograms in its state: per-context quantiles of
the standardized errors (the scale's conditional factor) and the tail memory of the worst misses
per lead window (the loan plan's tail reserve). Pure functions of a config and a state."""

from __future__ import annotations

import math

import numpy as np

from tidal.policy.forecast_config import ForecastConfig
from tidal.policy.forecast_state import ForecastState

CTX_BINS = np.linspace(-8.0, 24.0, 321)
"""Bin edges of the standardized-error histograms (errors beyond fall into the end bins)."""


TAIL_BINS = np.linspace(-2.0, 4.0, 601)
"""Bin edges of the tail histograms, in units of ``mean`` (misses beyond fall into the end bins)."""
_TAIL_MID = 0.5 * (TAIL_BINS[1:] + TAIL_BINS[:-1])
_TAIL_LOW = TAIL_BINS[:-1]


def tail_reserve_gpus(config: ForecastConfig, state: ForecastState, lead_steps: int, mean_excess: float,
                      kappa: float = 0.0, period_steps: float = math.inf, prior_miss: float = 0.0,
                      prior_steps: float = 0.0) -> float:
    """The smallest reserve R >= 0 (GPUs) above the center with, by the tail memory,
    ``E[x] + kappa * sqrt(E[x^2] / period_steps) <= mean_excess * mean``, ``x = (m - R)+`` and m the
    worst miss over a lead window of ``lead_steps``. The memory also holds ``prior_steps`` windows
    (never decaying) whose worst miss was ``prior_miss`` x ``mean``. 0 before any miss is scored."""
    if state.tail_hist is None or not mean_excess > 0 or not state.mean_gpus > 0:
        return 0.0
    k = min(max(int(lead_steps), 1), config.tail_horizon_steps)
    w = state.tail_hist[k - 1]
    if prior_steps > 0 and prior_miss > 0:
        w = w.copy()
        at = int(np.searchsorted(TAIL_BINS, prior_miss, side="right")) - 1
        w[min(max(at, 0), w.size - 1)] += prior_steps
    total = float(w.sum())
    if not total > 0:
        return 0.0
    c = _TAIL_MID
    e = _TAIL_LOW  # evaluate at the lower edge e_j of each bin j: only bins i >= j exceed it
    sw = np.cumsum(w[::-1])[::-1]
    swc = np.cumsum((w * c)[::-1])[::-1]
    ex = (swc - e * sw) / total
    f = ex
    if kappa > 0 and period_steps < math.inf:
        swc2 = np.cumsum((w * c * c)[::-1])[::-1]
        ex2 = np.maximum((swc2 - 2 * e * swc + e * e * sw) / total, 0.0)
        f = ex + kappa * np.sqrt(ex2 / period_steps)
    ok = np.flatnonzero(f <= mean_excess)  # f decreases with j
    if ok.size == 0:
        q = float(TAIL_BINS[-1])
    elif ok[0] == 0:
        q = float(e[0])
    else:  # linear between the edges around the crossing
        j = int(ok[0])
        a, b = f[j - 1], f[j]
        q = float(e[j - 1] + (e[j] - e[j - 1]) * (a - mean_excess) / max(a - b, 1e-300))
    return max(q, 0.0) * state.mean_gpus


def context_of(config: ForecastConfig, state: ForecastState, center: np.ndarray,
                future_slots: np.ndarray) -> np.ndarray:
    """Context id of each path point: (time-of-day bucket of the target, level bucket, volatility bucket)."""
    tod = (future_slots * max(config.context.tod_buckets, 1)) // config.slots
    mean = state.mean_gpus if state.mean_gpus > 0 else 1.0
    lvl = np.searchsorted(np.asarray(config.context.level_edges, float), center / mean, side="right")
    vol = int(np.searchsorted(np.asarray(config.context.vol_edges, float), state.burst, side="right"))
    nl, nv = len(config.context.level_edges) + 1, len(config.context.vol_edges) + 1
    return (tod * nl + lvl) * nv + vol


def hist_quantile(hist: np.ndarray, q: float) -> float:
    """The q-quantile of a histogram over ``CTX_BINS`` (linear inside the bin); NaN if empty."""
    cum = np.cumsum(hist)
    if not cum[-1] > 0:
        return math.nan
    i = int(np.searchsorted(cum, q * cum[-1]))
    i = min(i, hist.size - 1)
    below = cum[i - 1] if i > 0 else 0.0
    frac = (q * cum[-1] - below) / hist[i] if hist[i] > 0 else 0.5
    return float(CTX_BINS[i] + frac * (CTX_BINS[i + 1] - CTX_BINS[i]))


def context_factor(config: ForecastConfig, state: ForecastState) -> np.ndarray:
    """Per context: ``Q_c(quantile) / Q(quantile)`` of the standardized errors, each context's
    histogram shrunk towards the pooled one by ``context.prior_n`` pseudo-observations; 1 until
    the pooled quantile is positive."""
    hist = state.ctx_hist
    out = np.ones(config.contexts)
    if hist is None:
        return out
    pooled = hist.sum(axis=0)
    total = float(pooled.sum())
    q_all = hist_quantile(pooled, config.context.quantile)
    if not total > 0 or not q_all > 0:
        return out
    prior = config.context.prior_n * pooled / total
    for c in range(config.contexts):
        q_c = hist_quantile(hist[c] + prior, config.context.quantile)
        if q_c == q_c:
            out[c] = q_c / q_all
    return np.clip(out, 1.0 / config.context.max_factor, config.context.max_factor)

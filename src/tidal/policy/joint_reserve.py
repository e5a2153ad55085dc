"""The *joint* tail reserve: sized on what the calibrated margin in force did not cover. Pure.

The default tail reserve (:func:`~tidal.policy.forecast_errors.tail_reserve_gpus`) is sized so that the
misses of the history would cost at most its budget *even if z were 0*, while ``z`` is calibrated to
spend its share *even if the reserve were 0*; the plan keeps the larger of the two, so together they
spend less than either was sized for. Here the reserve is sized on the pairs the history actually
had: for each lead window ending at ``u`` the policy records the worst miss above the center, ``M``,
and the worst miss above the bound ``center + z * scale`` that its plans then kept, ``D`` (both over
the plans made ``h = 1..K`` steps before ``u``), and the reserve is the smallest ``R`` with::

    max rule       (mode "max"):  E[min(D, (M - R)+)] <= fraction * budget * mean
                                  (= E[(M - max(c, R))+] with c = M - D: the margin that covered c)
    additive rule  (mode "add"):  E[(D - R)+]         <= fraction * budget * mean

over the exponentially weighted history (the forecast's ``tail_half_life_s``), in units of the mean
demand, plus the same never-decaying prior as the default reserve (``prior_steps`` windows with
``M = D = prior_miss x mean``). The max rule's bound on the shortfall at ``u`` holds when every plan
of the lead time before ``u`` keeps ``max(z * scale, R)`` above its center: the loans' shortfall at
``u`` is at most ``max_h (m_h - max(a_h, R))+ <= min(D, (M - R)+)``. The additive rule's plans keep
``z * scale + R``.

The memory is a function of ``R`` on a fixed grid (:data:`GRID`, in units of the mean), updated in
O(grid) per observed step: no pair is stored. Windows go in from the first one scored, in units of the
running mean of then (the default reserve holds its first day's misses until the mean has seen a whole
day; this one does not: a start at a quiet hour makes the first day's misses weigh more, one at the peak
less). The last ``K`` plans' centers and margins are kept to score them (``paths``: one row per plan,
``[made_at_s, center(1..K), margin(1..K)]``).
"""

from __future__ import annotations

import math

import numpy as np

GRID = np.linspace(0.0, 4.0, 401)
"""Candidate reserves, in units of the mean demand (misses beyond 4 means are not told apart)."""

MODES = ("", "max", "add")
"""``TidalConfig.tail_joint``: "" off (the default reserve), "max" or "add" (module docstring)."""


def empty_paths(k: int) -> np.ndarray:
    """No plan recorded yet: ``k`` rows of ``[made_at_s, center(1..k), margin(1..k)]``, all NaN."""
    return np.full((k, 1 + 2 * k), np.nan)


def push_path(paths: np.ndarray, now_s: float, center: np.ndarray, margin: np.ndarray) -> np.ndarray:
    """``paths`` with the plan made at ``now_s`` first (its center and margin at horizons 1..k; a
    shorter path is padded with NaN), the oldest dropped."""
    k = paths.shape[0]
    row = np.full(1 + 2 * k, np.nan)
    row[0] = now_s
    c = np.asarray(center, float)[:k]
    m = np.asarray(margin, float)[:k]
    row[1:1 + c.size] = c
    row[1 + k:1 + k + m.size] = m
    return np.vstack([row[None, :], paths[:-1]])


def window_pair(paths: np.ndarray, now_s: float, y: float, step_s: float) -> tuple[float, float] | None:
    """``(M, D)`` at ``now_s`` with demand ``y``: the worst miss above the centers, and above the bounds
    ``center + margin``, of the recorded plans made 1..k steps before (None if none targets now)."""
    k = paths.shape[0]
    made = paths[:, 0]
    with np.errstate(invalid="ignore"):
        h = np.rint((now_s - made) / step_s)
    ok = np.isfinite(h) & (h >= 1) & (h <= k) & (np.abs(now_s - made - h * step_s) < 1e-6 * step_s)
    if not ok.any():
        return None
    rows = np.flatnonzero(ok)
    hs = h[ok].astype(int)
    center = paths[rows, hs]
    margin = paths[rows, k + hs]
    good = np.isfinite(center) & np.isfinite(margin)
    if not good.any():
        return None
    miss = y - center[good]
    return float(miss.max()), float((miss - np.maximum(margin[good], 0.0)).max())


def excess_row(pair: tuple[float, float], mean: float, mode: str) -> np.ndarray:
    """One window's excess at every candidate reserve (units of the mean): ``min(D, (M - R)+)`` (max
    rule) or ``(D - R)+`` (additive rule)."""
    m, d = pair[0] / mean, pair[1] / mean
    if mode == "add":
        return np.maximum(d - GRID, 0.0)
    return np.minimum(max(d, 0.0), np.maximum(m - GRID, 0.0))


def reserve_gpus(excess: np.ndarray | None, weight: float, mean: float, mean_excess: float,
                 mode: str, prior_miss: float = 0.0, prior_steps: float = 0.0) -> float:
    """The smallest reserve (GPUs) whose expected excess, by the memory ``excess / weight`` and the prior,
    is at most ``mean_excess`` (a fraction of the mean demand); 0 with neither memory nor prior."""
    if not mean > 0 or not mean_excess > 0:
        return 0.0
    f = np.zeros(GRID.size) if excess is None else np.asarray(excess, float)
    total = float(weight)
    if prior_steps > 0 and prior_miss > 0:
        f = f + prior_steps * excess_row((prior_miss, prior_miss), 1.0, mode)
        total += prior_steps
    if not total > 0:
        return 0.0
    f = f / total  # non-increasing in R
    ok = np.flatnonzero(f <= mean_excess)
    if ok.size == 0:
        q = float(GRID[-1])
    elif ok[0] == 0:
        q = 0.0
    else:
        j = int(ok[0])
        a, b = f[j - 1], f[j]
        q = float(GRID[j - 1] + (GRID[j] - GRID[j - 1]) * (a - mean_excess) / max(a - b, 1e-300))
    return q * mean if math.isfinite(q) else 0.0


__all__ = ["GRID", "MODES", "empty_paths", "excess_row", "push_path", "reserve_gpus", "window_pair"]

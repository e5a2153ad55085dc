"""Quantile forecast of the lead window's peak, learned online by pinball-loss SGD. Pure.

The loan plan needs one number per decision: how high demand may go within the lead window (a GPU lent
now is back one lead time later at the earliest). The forecast's ``center + z * scale`` answers it per
horizon point; this module learns the answer for the *window* directly, as a conditional quantile:

    r(t)   = (max_{h=1..k} y(t + h) - max_{h=1..k} center_h(t)) / mean          (the window's peak miss)
    q(t)   = w . x(t),      x(t) = [1, scale_k / mean, center_max / mean, dy / mean, |dy| / mean, burst - 1]
    w     -= lr * g / sqrt(G),  g = d pinball_tau(r, q) / dw,  G += g * g          (Adagrad, per coordinate)

``dy = y(t) - y(t - 1)`` (0 when either is missing), ``scale_k`` the forecast's own error scale at the
window's end (before this module), ``burst`` its volatility factor. Every path's features wait ``k``
steps in the state (``lq_pending``) until the window's demand is known; only then is ``w`` updated
(past data only). The forecast then multiplies its scale path by ``rho = q * mean / scale_k``, so that
``center + z * scale`` over the window is about ``center_max + z * q``: ``z = 1`` is the learned
tau-quantile of the window's peak, and the loan policy's online calibration of ``z`` (to a shortfall
budget) works on this scale unchanged.

Why these features (chosen on ServeGen m-large only, reported on m-mid: docs/loaning.md, "Lead-window
quantile"): the last step's change and its size say whether demand has just jumped (and tends to jump
again or fall back), which the error scale (a 2-day mean) and ``burst`` (a smoothed ratio) see late.
"""

from __future__ import annotations

import math

import numpy as np

FEATURES = 6
"""Length of the feature vector ``x(t)`` (see the module docstring)."""


def initial_model(init_scale: float) -> np.ndarray:
    """``lq_model`` before any update: row 0 the weights (``q = init_scale * scale_k / mean``), row 1
    Adagrad's sums of squared gradients, row 2 ``[last demand seen (NaN = missing), updates so far,
    0...]``."""
    m = np.zeros((3, FEATURES))
    m[0, 1] = init_scale
    m[2, 0] = math.nan
    return m


def initial_pending(window_steps: int) -> np.ndarray:
    """``lq_pending`` before any path: per path of the last ``window_steps`` (row 0 the latest), its
    features, then ``[center_max, highest demand seen since it was made (-inf = none yet), mean]`` (GPUs,
    as of the path). A row of NaN = no path."""
    return np.full((window_steps, FEATURES + 3), math.nan)


def features(
    scale_k: float, center_max: float, mean: float, y: float, last_y: float, burst: float
) -> np.ndarray:
    """``x(t)``; zeros but the intercept while ``mean`` is unknown."""
    x = np.zeros(FEATURES)
    x[0] = 1.0
    if not mean > 0:
        return x
    dy = y - last_y if (y == y and last_y == last_y) else 0.0
    x[1] = scale_k / mean
    x[2] = center_max / mean
    x[3] = dy / mean
    x[4] = abs(dy) / mean
    x[5] = burst - 1.0
    return x


def predict(model: np.ndarray, x: np.ndarray) -> float:
    """The learned tau-quantile of the window's peak miss, in units of ``mean``."""
    return float(model[0] @ x)


def observe(model: np.ndarray, pending: np.ndarray, y: float, tau: float,
            lr: float) -> tuple[np.ndarray, np.ndarray]:
    """New (model, pending) after demand ``y`` (NaN = missing) arrived: every waiting path's running
    peak takes ``y``; the oldest path's window is then complete and its pinball gradient updates the
    weights (skipped if no demand of its window was seen). The arrays given are not changed; the new
    path is pushed with :func:`push`, and the demand remembered for the next ``dy`` with :func:`seen`."""
    model, pending = model.copy(), pending.copy()
    if y == y:
        pending[:, FEATURES + 1] = np.fmax(pending[:, FEATURES + 1], y)  # NaN rows stay NaN
    last = pending[-1]
    if last[0] == last[0] and np.isfinite(last[FEATURES + 1]) and last[FEATURES + 2] > 0:
        x = last[:FEATURES]
        r = (last[FEATURES + 1] - last[FEATURES]) / last[FEATURES + 2]
        g = (-tau if r > float(model[0] @ x) else 1.0 - tau) * x
        model[1] += g * g
        model[0] -= lr * g / np.sqrt(np.maximum(model[1], 1e-12))
        model[2, 1] += 1
    return model, pending


def push(pending: np.ndarray, x: np.ndarray, center_max: float, mean: float) -> np.ndarray:
    """``pending`` with the new path (features ``x``, its window's highest center, the mean of now) in
    front; the oldest row, scored by :func:`observe`, drops out. No path (``mean`` unknown): a NaN row."""
    out = np.empty(pending.shape)
    out[1:] = pending[:-1]
    out[0] = math.nan
    if mean > 0 and np.isfinite(x).all() and center_max == center_max:
        out[0, :FEATURES] = x
        out[0, FEATURES:] = (center_max, -math.inf, mean)
    return out


def seen(model: np.ndarray, y: float) -> np.ndarray:
    """``model`` remembering ``y`` (NaN = missing) as the last demand, for the next path's ``dy``."""
    out = model.copy()
    out[2, 0] = y
    return out


__all__ = ["FEATURES", "features", "initial_model", "initial_pending", "observe", "predict", "push", "seen"]

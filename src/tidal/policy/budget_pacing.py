"""The budget as an online promise: the margin moved by the realized shortfall of the recent week. Pure.

The pace ``r = S / (B D)`` compares the shortfall ``S`` realized over a fading window (``half_life_s``, a
week by default) with its share of the budget ``B`` of the demand ``D`` over the same window. It acts
asymmetrically (docs/loaning.md, "The online promise"):

* **ahead** (``r > 1``): tighter at once, as far as the overrun: the tail reserve times
  ``t = min(cap, 1 + gain (r - 1))`` and the calibrator's aim over ``t``;
* **behind** (``r < 1``): a reserve below the usual one only within the budget left, ``u = 1 - r``: a
  factor ``f`` below 1 counts as ``1 - (1 - f) u``, so nothing is loosened once the window's budget is
  spent, and what a miss spent comes back only as the window forgets it, never at once.
"""

from __future__ import annotations

from tidal.policy.forecast import decay


def pace_update(window: tuple[float, float], shortfall_gpus: float, demand_gpus: float, dt_s: float,
                half_life_s: float) -> tuple[float, float]:
    """The window ``(S, D)`` in GPU-seconds after one observed step."""
    keep = decay(dt_s, half_life_s)
    return window[0] * keep + shortfall_gpus * dt_s, window[1] * keep + demand_gpus * dt_s


def promise(window: tuple[float, float], budget: float, gain: float, cap: float) -> tuple[float, float]:
    """``(t, u)``: the tightening ``t >= 1`` and the share of the window's budget left ``u`` in [0, 1];
    ``(1, 1)`` when off (``gain`` 0) or before any demand."""
    s, d = window
    if gain <= 0 or d <= 0:
        return 1.0, 1.0
    r = s / (budget * d)
    return min(cap, 1.0 + gain * max(r - 1.0, 0.0)), max(0.0, 1.0 - r)


def loosened(factor: float, left: float) -> float:
    """A reserve factor below 1 loosened only by the budget ``left``: ``1 - (1 - factor) * left``."""
    return factor if factor >= 1.0 else 1.0 - (1.0 - factor) * left


__all__ = ["loosened", "pace_update", "promise"]

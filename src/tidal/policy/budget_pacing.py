"""Budget pacing: the calibrator's aim moved by the realized shortfall of the recent day. Pure.

The pace ``r = S / (B D)`` compares the shortfall ``S`` realized over a fading window (``half_life_s``, a
day by default) with its share of the budget ``B`` of the demand ``D`` over the same window. The aim is
``aim * clip(1 + gain * (1 - r), low, high)``: tighter while the day's shortfall runs ahead of its share
(``r > 1``), looser while it runs behind; ``gain`` 0 is off (docs/loaning.md, "Budget pacing").
"""

from __future__ import annotations

from tidal.policy.forecast import decay


def pace_update(window: tuple[float, float], shortfall_gpus: float, demand_gpus: float, dt_s: float,
                half_life_s: float) -> tuple[float, float]:
    """The window ``(S, D)`` in GPU-seconds after one observed step."""
    keep = decay(dt_s, half_life_s)
    return window[0] * keep + shortfall_gpus * dt_s, window[1] * keep + demand_gpus * dt_s


def paced_aim(aim: float, budget: float, window: tuple[float, float], gain: float, low: float = 0.25,
              high: float = 1.25) -> float:
    """The calibrator's aim (a fraction of the budget) at the pace of ``window``; ``aim`` when off or
    before any demand."""
    s, d = window
    if gain <= 0 or d <= 0:
        return aim
    return aim * min(high, max(low, 1.0 + gain * (1.0 - s / (budget * d))))


__all__ = ["pace_update", "paced_aim"]

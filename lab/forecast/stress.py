"""Synthetic stress traces for the loan policy, from one seed (``python -m lab generalize``).

Each generator returns a load series (no unit; ``>= 0``) on a ``step_s`` grid starting at midnight;
like a recorded trace, the pool is later sized for the series' own peak. The base is a serving day:
a daily cycle (a morning ramp, an afternoon peak, a quiet night), weekends at 70 % of weekdays, and
multiplicative AR(1) noise (10-min correlation 0.7, ~6 % per step) plus a few small bursts (x1.3 for
20-40 min, about one a day) that teach the history what "usual" surprise looks like. The stresses:

* ``burst`` — on day 9, at a quiet evening hour, load jumps x3 within one step and stays there for
  an hour: larger than any burst the history holds (it becomes the trace's peak).
* ``level-shift`` — from day 7 on, load is x1.8 for good (a new tenant moves in).
* ``holiday-week`` — 21 days; days 7-13 peak at 40 % of the usual peak, with no weekday/weekend
  difference and a flatter day, then the usual traffic returns at once on day 14.
* ``multi-model`` — a pool of four models whose daily peaks fall at 3, 9, 15 and 21 h, each with its
  own level, noise and bursts; the pool's load is their sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

DAY_S = 86400.0


def _daily(hours: np.ndarray, peak_h: float = 15.0, depth: float = 0.65) -> np.ndarray:
    """A smooth daily cycle in [1 - depth, 1]: highest at ``peak_h``, lowest 12 h away."""
    return 1.0 - depth * 0.5 * (1.0 - np.cos(2.0 * math.pi * (hours - peak_h + 12.0) / 24.0))


def _noise(rng: np.random.Generator, n: int, sd: float = 0.06, rho: float = 0.7) -> np.ndarray:
    """Multiplicative AR(1) noise, mean ~1."""
    e = np.empty(n)
    x = 0.0
    innov = rng.normal(0.0, sd * math.sqrt(1 - rho * rho), n)
    for i in range(n):
        x = rho * x + innov[i]
        e[i] = x
    return np.exp(e - sd * sd / 2)


def _small_bursts(rng: np.random.Generator, n: int, step_s: float, per_day: float = 1.0,
                  height: tuple[float, float] = (1.15, 1.35)) -> np.ndarray:
    """About ``per_day`` bursts a day, each x``height`` for 20-40 min."""
    f = np.ones(n)
    day = round(DAY_S / step_s)
    for start in np.flatnonzero(rng.random(n) < per_day / day):
        length = max(1, round(rng.uniform(1200, 2400) / step_s))
        f[start:start + length] *= rng.uniform(*height)
    return f


def _base(rng: np.random.Generator, days: int, step_s: float, *, peak_h: float = 15.0,
          weekend: float = 0.7) -> tuple[np.ndarray, np.ndarray]:
    """(times_s, load) of the base serving day repeated for ``days`` days."""
    n = round(days * DAY_S / step_s)
    t = step_s * np.arange(n)
    hours = (t % DAY_S) / 3600.0
    dow = (t // DAY_S).astype(int) % 7
    week = np.where(dow >= 5, weekend, 1.0)
    return t, _daily(hours, peak_h) * week * _noise(rng, n) * _small_bursts(rng, n, step_s)


def burst(rng: np.random.Generator, days: int = 14, step_s: float = 600.0) -> tuple[np.ndarray, np.ndarray]:
    t, load = _base(rng, days, step_s)
    start = round((min(9, days - 1) * DAY_S + 20.5 * 3600.0) / step_s)
    load = load.copy()
    load[start:start + round(3600.0 / step_s)] *= 3.0
    return t, load


def level_shift(
    rng: np.random.Generator, days: int = 14, step_s: float = 600.0
) -> tuple[np.ndarray, np.ndarray]:
    t, load = _base(rng, days, step_s)
    return t, np.where(t >= min(7, days - 1) * DAY_S, 1.8, 1.0) * load


def holiday_week(
    rng: np.random.Generator, days: int = 21, step_s: float = 600.0
) -> tuple[np.ndarray, np.ndarray]:
    t, load = _base(rng, days, step_s)
    hol = (t >= 7 * DAY_S) & (t < 14 * DAY_S)
    hours = (t % DAY_S) / 3600.0
    flat = 0.4 * _daily(hours, depth=0.3) / _daily(hours)  # a flatter day, no weekend dip
    dow = (t // DAY_S).astype(int) % 7
    week = np.where(dow >= 5, 0.7, 1.0)
    return t, np.where(hol, load * flat / week, load)


def multi_model(
    rng: np.random.Generator, days: int = 14, step_s: float = 600.0
) -> tuple[np.ndarray, np.ndarray]:
    n = round(days * DAY_S / step_s)
    t = step_s * np.arange(n)
    hours = (t % DAY_S) / 3600.0
    total = np.zeros(n)
    for peak_h in (3.0, 9.0, 15.0, 21.0):
        level = rng.uniform(0.5, 1.5)
        total += level * _daily(hours, peak_h, depth=0.8) * _noise(rng, n, sd=0.1) * _small_bursts(
            rng, n, step_s, per_day=0.5, height=(1.3, 2.0))
    return t, total


GENERATORS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    "burst": burst, "level-shift": level_shift, "holiday-week": holiday_week, "multi-model": multi_model,
}


def stress_traces(seed: int = 0, step_s: float = 600.0, names: tuple[str, ...] = tuple(GENERATORS),
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{name: (times_s, load)}`` for each stress, each from its own stream of ``seed``."""
    if DAY_S / step_s != round(DAY_S / step_s):
        raise ValueError(f"step_s {step_s:g} must divide a day")
    unknown = [n for n in names if n not in GENERATORS]
    if unknown:
        raise ValueError(f"unknown stress trace(s) {unknown}; known: {sorted(GENERATORS)}")
    out = {}
    for i, name in enumerate(GENERATORS):
        if name in names:
            out[name] = GENERATORS[name](np.random.default_rng([seed, i]), step_s=step_s)
    return out


__all__ = ["GENERATORS", "stress_traces"]

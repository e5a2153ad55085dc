"""The loan policies a simulation compares, built from a name and one risk knob (``PolicySpec.knob``):
a shortfall budget for ``tidal``, a margin in GPUs for the baselines (docs/simulator.md, "Policies")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.policy.baselines import NightWindowPolicy, OraclePolicy, ReactivePolicy
from tidal.policy.loan import HORIZON_S, TidalPolicy
from tidal.sim.config import SimConfig

POLICIES = ("none", "night-window", "reactive", "tidal", "oracle")
DEFAULT_BUDGET = 0.005
DEFAULT_MARGIN_FRACTION = 0.1  # of the serving pool, for reactive and night-window


@dataclass(frozen=True)
class PolicySpec:
    """A policy name and its knob (``None``: the default, see :func:`default_knob`)."""

    name: str
    knob: float | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose from {', '.join(POLICIES)}")
        if self.name == "tidal" and self.knob is not None and not 0 < self.knob < 1:
            raise ValueError(f"tidal's knob is a shortfall budget in (0, 1), got {self.knob}")
        if self.name in ("reactive", "night-window", "oracle") and self.knob is not None and self.knob < 0:
            raise ValueError(f"{self.name}'s knob is a margin in GPUs (>= 0), got {self.knob}")


def default_knob(name: str, serving_gpus: int) -> float | None:
    if name == "tidal":
        return DEFAULT_BUDGET
    if name in ("reactive", "night-window"):
        return round(DEFAULT_MARGIN_FRACTION * serving_gpus, 2)
    if name == "oracle":
        return 0.0
    return None


def knob_of(spec: PolicySpec, serving_gpus: int) -> float | None:
    return spec.knob if spec.knob is not None else default_knob(spec.name, serving_gpus)


def knob_label(spec: PolicySpec, serving_gpus: int) -> str:
    k = knob_of(spec, serving_gpus)
    if k is None:
        return ""
    return f"B={k:g}" if spec.name == "tidal" else f"margin={k:g}"


def night_window(
    demand: np.ndarray, step_s: float, hours: float, period_s: float = 86400.0
) -> tuple[float, float]:
    """(start_s, end_s) in the day from the trace start of the ``hours`` with the lowest mean demand."""
    period = round(period_s / step_s)
    width = max(1, round(hours * 3600 / step_s))
    n = max(period, len(demand) // period * period)
    d = np.resize(demand, n)
    with np.errstate(all="ignore"):
        prof = np.nanmean(d.reshape(-1, period), axis=0)
    prof = np.nan_to_num(prof, nan=float(np.nanmax(prof)) if np.isfinite(prof).any() else 0.0)
    sums = [float(prof[(np.arange(width) + s) % period].sum()) for s in range(period)]
    s = int(np.argmin(sums))
    return s * step_s, ((s + width) % period) * step_s


def build(spec: PolicySpec, config: SimConfig, step_s: float, demand: np.ndarray, t0_s: float = 0.0,
          night_hours: float = 8.0) -> Any:
    """The loan policy object for ``spec`` (``None`` for ``none``); see the module docstring."""
    timing = config.timing
    knob = knob_of(spec, config.serving_gpus)
    if spec.name == "none" or knob is None:  # (every policy but none has one: default_knob)
        return None
    if spec.name == "tidal":
        return TidalPolicy.build(float(knob), step_s, timing, horizon_s=None)
    horizon = timing.horizon_s(step_s)
    if spec.name == "reactive":
        return ReactivePolicy(margin_gpus=float(knob), step_s=step_s, horizon_s=horizon, timing=timing)
    if spec.name == "oracle":
        return OraclePolicy(margin_gpus=float(knob), step_s=step_s, horizon_s=horizon, timing=timing)
    start, end = night_window(demand, step_s, night_hours)
    return NightWindowPolicy(start_s=math.fmod(start + t0_s, 86400.0), end_s=math.fmod(end + t0_s, 86400.0),
                             margin_gpus=float(knob), step_s=step_s, horizon_s=horizon, timing=timing)


def horizon_steps(policy: Any, step_s: float) -> int:
    return max(1, math.ceil(getattr(policy, "horizon_s", HORIZON_S) / step_s - 1e-9))

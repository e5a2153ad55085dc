"""Coverage calibration: adaptive conformal inference on the margin ``z`` of a
:class:`~tidal.policy.forecast.Forecast`, for one horizon. Pure: state in, state out."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from tidal.policy.forecast import Forecast


@dataclass(frozen=True)
class CoverageCalibrator:
    """Keeps ``upper(h; z)`` at horizon ``horizon_steps`` above the demand a ``quantile`` of the time.

    Adaptive conformal inference (Gibbs & Candès, 2021) on the margin: after each scored target
    ``z += gain * (miss - (1 - quantile))``, where ``miss`` is 1 if the demand exceeded the upper
    bound made ``horizon_steps`` earlier. Over any T scored targets the miss rate is within
    ``(z_max - z_0 + gain) / (gain * T)`` of ``1 - quantile`` with no assumption on the demand;
    ``z`` never goes below ``min_z`` (the central forecast). It starts (``initial_z=None``) where a
    Gaussian error with this mean absolute error would put the quantile:
    ``sqrt(pi / 2) * Phi^-1(quantile)``.

    Call order: ``cal = CoverageCalibrator(...)``, ``s = cal.initial_state()``; per observation,
    after ``observe``: ``s = cal.update(s, t_s, demand_gpus)`` then
    ``upper, s = cal.emit(s, forecast)``.
    """

    quantile: float = 0.95
    horizon_steps: int = 2
    gain: float = 0.1
    initial_z: float | None = None
    min_z: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError(f"CoverageCalibrator.quantile must be in (0, 1), got {self.quantile}")
        if self.horizon_steps < 1:
            raise ValueError(f"CoverageCalibrator.horizon_steps must be >= 1, got {self.horizon_steps}")

    def initial_state(self) -> CoverageState:
        z = self.initial_z
        if z is None:
            z = math.sqrt(math.pi / 2) * statistics.NormalDist().inv_cdf(self.quantile)
        return CoverageState(z=max(self.min_z, z), pending=(), misses=0, scored=0)

    def update(self, state: CoverageState, t_s: float, demand_gpus: float) -> CoverageState:
        """Score the bound that targeted ``t_s`` (if any) against the observed demand."""
        due = [p for p in state.pending if p[0] <= t_s + 1e-9]
        rest = tuple(p for p in state.pending if p[0] > t_s + 1e-9)
        z, misses, scored = state.z, state.misses, state.scored
        for target_s, upper in due:
            if abs(target_s - t_s) > 1e-6 or math.isnan(demand_gpus):
                continue
            miss = 1.0 if demand_gpus > upper else 0.0
            z = max(self.min_z, z + self.gain * (miss - (1.0 - self.quantile)))
            misses += int(miss)
            scored += 1
        return CoverageState(z=z, pending=rest, misses=misses, scored=scored)

    def emit(self, state: CoverageState, fc: Forecast) -> tuple[float, CoverageState]:
        """The calibrated upper bound at the horizon, remembered for scoring when its target arrives."""
        i = self.horizon_steps - 1
        upper = float(fc.center_gpus[i] + state.z * fc.scale_gpus[i])
        pending = state.pending + ((float(fc.times_s[i]), upper),)
        return upper, replace(state, pending=pending)


@dataclass(frozen=True)
class CoverageState:
    z: float
    pending: tuple[tuple[float, float], ...]
    misses: int
    scored: int

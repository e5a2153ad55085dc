"""The forecast's knobs (:class:`ForecastConfig`), one group per concern, checked when made; a setting
is named by its path (``errors.noise_exponent``, :func:`with_settings`). Re-exported by
:mod:`tidal.policy.forecast`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn


def _fail(where: str, what: str) -> NoReturn:
    raise ValueError(f"ForecastConfig.{where}{what}")


@dataclass(frozen=True)
class LevelConfig:
    """The live level and its slope: the short-memory part of the center (``ForecastConfig.level``)."""

    half_life_s: float = 600.0
    """Memory of the live level."""
    anomaly_half_life_s: float = 6 * 3600.0
    """How fast the live level's deviation from the profile fades over the horizon."""
    trend_half_life_s: float = 3600.0
    """Memory of the live slope of the level."""
    trend_damping_half_life_s: float = 1200.0
    """How fast the slope's effect fades over the horizon."""


@dataclass(frozen=True)
class SeasonConfig:
    """Seasonality: the daily profile (``ForecastConfig.season``)."""

    profile_half_life_s: float = 4 * 86400.0
    """Memory of the profile across cycles; also of ``mean``, the reference for noise scaling."""
    profile_smooth_s: float = 3600.0
    """Width of the box kernel the profile is read through."""


@dataclass(frozen=True)
class ErrorScaleConfig:
    """The error scale: how far demand strays from the center, per horizon (``ForecastConfig.errors``)."""

    half_life_s: float = 2 * 86400.0
    """Memory of the per-horizon error scale."""
    burst_half_life_s: float = 1800.0
    """Memory of recent surprise (the scale widens while the last errors exceed the usual one), also its
    fade over the horizon."""
    profile_smooth_s: float = 4 * 3600.0
    """Width of the box kernel the time-of-day error profile is read through."""
    profile_shrink_days: float = 2.0
    """The error profile counts as this many days of a flat profile."""
    side: str = "both"
    """Which errors the scale measures: ``"both"`` (absolute) or ``"upper"`` (demand above the center)."""
    clip_errors: float = math.inf
    """Each scored error counts at most this many times the usual error at its horizon."""
    noise_exponent: float = 0.0
    """The error scale grows with demand to this power (0: additive; 0.5: as for counts of requests)."""
    prior_scale_fraction: float = 0.25
    """Error scale, as a fraction of the level, before any error has been measured."""
    min_scale_fraction: float = 0.01
    """Floor of the error scale, as a fraction of ``mean``."""

    def __post_init__(self) -> None:
        if self.side not in ("both", "upper"):
            _fail("errors.", f"side must be 'both' or 'upper', got {self.side!r}")
        if not self.clip_errors > 0:
            _fail("errors.", f"clip_errors must be > 0, got {self.clip_errors}")
        if self.noise_exponent < 0:
            _fail("errors.", f"noise_exponent must be >= 0, got {self.noise_exponent}")


@dataclass(frozen=True)
class ContextConfig:
    """Conditional error quantiles (``ForecastConfig.context``): the scale is multiplied per context by
    ``Q_c(quantile) / Q(quantile)`` (:func:`~tidal.policy.forecast_errors.context_factor`)."""

    tod_buckets: int = 0
    """By the target's time of day (0 = off): this many equal buckets."""
    level_edges: tuple[float, ...] = (0.85, 1.15)
    """By level: bucket edges on ``center / mean`` (``()`` = off; docs/loaning.md)."""
    vol_edges: tuple[float, ...] = ()
    """By volatility regime: bucket edges on the burst factor when the path is made."""
    quantile: float = 0.99
    """The tail level at which contexts are compared."""
    horizon_steps: int = 3
    """Standardized errors of horizons 1..this are pooled into the context histograms."""
    half_life_s: float = 7 * 86400.0
    """Memory of the context histograms."""
    prior_n: float = 30.0
    """Each context's histogram is shrunk towards the pooled one by this many pseudo-observations."""
    max_factor: float = 3.0
    """The context factor is clipped to ``[1 / this, this]``."""

    def __post_init__(self) -> None:
        if self.tod_buckets < 0:
            _fail("context.", f"tod_buckets must be >= 0, got {self.tod_buckets}")
        for name in ("level_edges", "vol_edges"):
            edges = getattr(self, name)
            if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
                _fail("context.", f"{name} must increase, got {edges}")
        if not 0 < self.quantile < 1:
            _fail("context.", f"quantile must be in (0, 1), got {self.quantile}")
        if self.horizon_steps < 1:
            _fail("context.", f"horizon_steps must be >= 1, got {self.horizon_steps}")
        if self.prior_n < 0 or not self.max_factor >= 1:
            _fail("context.", "prior_n must be >= 0 and max_factor >= 1, got "
                  f"{self.prior_n} and {self.max_factor}")

    @property
    def count(self) -> int:
        """Number of contexts (1 = the feature is off)."""
        return max(self.tod_buckets, 1) * (len(self.level_edges) + 1) * (len(self.vol_edges) + 1)


@dataclass(frozen=True)
class ForecastConfig:
    """Forecast knobs: the grid, the tail memory, and one group per concern. Seconds."""

    step_s: float = 600.0
    """Resolution: one observation and one forecast point per step."""
    horizon_s: float = 6 * 3600.0
    """How far ahead the path goes (rounded up to whole steps)."""
    period_s: float = 86400.0
    """The profile's cycle (a day); a multiple of ``step_s``."""
    tail_horizon_steps: int = 6
    """Tail memory: lead windows of 1..this many steps are kept."""
    tail_half_life_s: float = 28 * 86400.0
    """Memory of the tail histograms: long, the misses they keep come once a week or rarer."""
    level: LevelConfig = field(default_factory=LevelConfig)
    season: SeasonConfig = field(default_factory=SeasonConfig)
    errors: ErrorScaleConfig = field(default_factory=ErrorScaleConfig)
    context: ContextConfig = field(default_factory=ContextConfig)

    def __post_init__(self) -> None:
        for name in ("step_s", "horizon_s", "period_s"):
            if not getattr(self, name) > 0:
                _fail(name, f" must be > 0, got {getattr(self, name)}")
        slots = self.period_s / self.step_s
        if abs(slots - round(slots)) > 1e-9:
            _fail("period_s", f" ({self.period_s:g}) must be a multiple of step_s ({self.step_s:g})")
        if self.tail_horizon_steps < 1:
            _fail("tail_horizon_steps", f" must be >= 1, got {self.tail_horizon_steps}")
        for name, group in _GROUPS.items():
            if not isinstance(getattr(self, name), group):
                _fail(name, f" must be a {group.__name__}, got {getattr(self, name)!r}")

    @property
    def horizon_steps(self) -> int:
        return max(1, math.ceil(self.horizon_s / self.step_s - 1e-9))

    @property
    def slots(self) -> int:
        return round(self.period_s / self.step_s)

    @property
    def contexts(self) -> int:
        """Number of conditional-quantile contexts (1 = the feature is off)."""
        return self.context.count


_GROUPS: dict[str, type] = {"level": LevelConfig, "season": SeasonConfig, "errors": ErrorScaleConfig,
                            "context": ContextConfig}


def setting_names() -> list[str]:
    """Every setting :func:`with_settings` takes: ``step_s``, ..., ``errors.noise_exponent``, ..."""
    top = [f.name for f in dataclasses.fields(ForecastConfig) if f.name not in _GROUPS]
    return top + [f"{g}.{f.name}" for g, cls in _GROUPS.items() for f in dataclasses.fields(cls)]


def with_settings(config: ForecastConfig, settings: Mapping[str, Any]) -> ForecastConfig:
    """``config`` with ``settings`` (``{"errors.noise_exponent": 0.5, "step_s": 300.0}``) applied; an
    unknown name or a refused value is a ``ValueError`` naming it."""
    known = set(setting_names())
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        if name not in known:
            raise ValueError(f"ForecastConfig has no setting {name!r} (have {', '.join(sorted(known))})")
        group, _, key = name.rpartition(".")
        if group:
            groups.setdefault(group, {})[key] = value
        else:
            top[key] = value
    for group, values in groups.items():
        top[group] = dataclasses.replace(getattr(config, group), **values)
    return dataclasses.replace(config, **top)

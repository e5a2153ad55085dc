"""The forecast's knobs (:class:`ForecastConfig`), checked when made; the forecast itself is
:mod:`tidal.policy.forecast` (which re-exports this class). Pure: no I/O, no clock."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ForecastConfig:
    """Forecast knobs. All times in seconds."""

    step_s: float = 600.0
    """Resolution: one observation and one forecast point per step."""
    horizon_s: float = 6 * 3600.0
    """How far ahead the path goes (rounded up to whole steps)."""
    period_s: float = 86400.0
    """The profile's cycle (a day); a multiple of ``step_s``."""
    level_half_life_s: float = 600.0
    """Memory of the live level: short, so a real change is followed within a step or two."""
    anomaly_half_life_s: float = 6 * 3600.0
    """How fast the live level's deviation from the profile fades over the horizon."""
    trend_half_life_s: float = 3600.0
    """Memory of the live slope of the level."""
    trend_damping_half_life_s: float = 1200.0
    """How fast the slope's effect fades over the horizon (a noisy slope must not run away)."""
    profile_half_life_s: float = 4 * 86400.0
    """Memory of the profile across cycles; also of ``mean``, the reference for noise scaling."""
    profile_smooth_s: float = 3600.0
    """Width of the box kernel the profile is read through."""
    error_half_life_s: float = 2 * 86400.0
    """Memory of the per-horizon error scale."""
    burst_half_life_s: float = 1800.0
    """Memory of recent surprise: while the last steps' errors exceed the usual error, the scale
    widens by their ratio (volatility clusters: a jump is often followed by more); the widening
    fades over the horizon with the same half-life."""
    error_profile_smooth_s: float = 4 * 3600.0
    """Width of the box kernel the time-of-day error profile is read through."""
    error_profile_shrink_days: float = 2.0
    """The error profile counts as this many days of a flat profile (shrinks early, noisy days)."""
    error_side: str = "both"
    """Which errors the scale measures: ``"both"`` (absolute error) or ``"upper"`` (only demand above
    the center: the loan plan cares about under-forecasts, and falls in demand never cost serving)."""
    error_clip: float = math.inf
    """Each scored error counts at most this many times the usual error at its horizon (and in the
    surprise profiles): one freak jump must not widen the scale for days (the calibrated margin ``z``
    answers for the tail)."""
    noise_exponent: float = 0.0
    """The error scale grows with demand to this power (see the module docstring). 0 (additive):
    on both ServeGen traces the misses that matter do not grow with the level (0.5 lent 1-3 % less
    at the same shortfall in the fluid model of ``python -m lab forecast``)."""
    context_tod_buckets: int = 0
    """Conditional error quantiles (0 = off): split the day into this many equal buckets by the
    target's time of day. With any ``context_*`` on, the scale is multiplied per context by
    ``Q_c(context_quantile) / Q(context_quantile)``: the quantile of the standardized errors
    ``(y - center) / scale`` seen in that context over the quantile of all of them, learned online
    from past errors only (see :func:`context_factor`)."""
    context_level_edges: tuple[float, ...] = (0.85, 1.15)
    """Conditional error quantiles by level: bucket edges on ``center / mean`` (``()`` = off). The
    default (low / usual / high level) lent more at the same or lower shortfall on both ServeGen
    traces, in the fluid model and the simulator (docs/loaning.md, "Conditional error quantiles")."""
    context_vol_edges: tuple[float, ...] = ()
    """Conditional error quantiles by volatility regime: bucket edges on the burst factor at the
    time the path is made (e.g. ``(1.3,)``: calm vs. recently surprised)."""
    context_quantile: float = 0.99
    """The tail level at which contexts are compared (0.95 and 0.98 lent less on both traces)."""
    context_horizon_steps: int = 3
    """Standardized errors of horizons 1..this are pooled into the context histograms."""
    context_half_life_s: float = 7 * 86400.0
    """Memory of the context histograms."""
    context_prior_n: float = 30.0
    """Each context's histogram is shrunk towards the pooled one by this many pseudo-observations."""
    context_max_factor: float = 3.0
    """The context factor is clipped to ``[1 / this, this]``."""
    tail_horizon_steps: int = 6
    """Tail memory (see :func:`~tidal.policy.forecast_errors.tail_reserve_gpus`): lead windows of 1..this
    many steps are kept."""
    tail_half_life_s: float = 28 * 86400.0
    """Memory of the tail histograms: long, because the misses they keep (load x3 within 10 min)
    come once a week or rarer, and the error scale ``e`` (2-day memory) forgets them."""
    shift_half_life_s: float = 0.0
    """Level shifts (0 = off): an exponentially weighted mean (this half-life) of the anomaly ``y - P`` is
    kept; when it exceeds ``shift_threshold`` one-step errors, the whole profile is re-based by it (a
    lasting shift is then forecast at every horizon, instead of fading back into the old profile over
    ``anomaly_half_life_s`` and being learnt by the profile over days), and the mean restarts at 0."""
    shift_threshold: float = 3.0
    """The anomaly's mean, in one-step mean absolute errors, that re-bases the profile."""
    week_s: float = 0.0
    """Weekly structure (0 = off; 7 days = 604800): learn, per ``step_s`` slot of the week, how demand there
    departs from the daily profile (an exponentially weighted mean of ``y - P``, ``week_half_life_s``), and
    add it to the profile, shrunk by ``n / (n + week_shrink)`` with n the weeks seen at that slot (read
    through the profile's kernel). Before a whole week is seen it changes nothing. A multiple of
    ``period_s``."""
    week_half_life_s: float = 28 * 86400.0
    """Memory of the weekly departures."""
    week_shrink: float = 1.0
    """The weekly departures count as this many weeks of none (one week seen: half of it is used)."""
    lead_quantile: float = 0.0
    """The lead-window quantile (0 = off): learn online the ``lead_quantile``-quantile of the peak miss over
    the next ``quantile_window_steps`` (``max y - max center`` over the window) by pinball-loss SGD on
    features of the path (:mod:`tidal.policy.forecast_quantile`), and rescale the error-scale path so that
    ``z = quantile_z`` over the window is that quantile. 0.8 was chosen on each ServeGen trace alone (the
    same on both; docs/loaning.md, "Lead-window quantile")."""
    quantile_window_steps: int = 2
    """The window of the lead-window quantile, in steps: the loan lead time (20 min at 10-min steps)."""
    quantile_lr: float = 0.05
    """Adagrad's step size for the lead-window quantile's weights."""
    quantile_init: float = 1.5
    """The lead-window quantile before any update: this many error scales (at the window's end)."""
    quantile_z: float = 2.5
    """Over the window, ``center + quantile_z * scale`` is the learned quantile (the error-scale path is
    rescaled to ``quantile / quantile_z``): sets the units of the loan policy's calibrated ``z``, whose
    start (``initial_z`` = 3), step size and shortfall cap (3 scales) are in those units. 2.5 is about the
    ``z`` the loan policy holds at 0.5 % with the plain scale."""
    quantile_rho_range: tuple[float, float] = (0.2, 5.0)
    """The rescaling of the error-scale path by the lead-window quantile stays within this range."""
    prior_scale_fraction: float = 0.25
    """Error scale, as a fraction of the level, before any error has been measured."""
    min_scale_fraction: float = 0.01
    """Floor of the error scale, as a fraction of ``mean``, so a flat history is never certain."""

    def __post_init__(self) -> None:
        for name in ("step_s", "horizon_s", "period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ForecastConfig.{name} must be > 0, got {getattr(self, name)}")
        slots = self.period_s / self.step_s
        if abs(slots - round(slots)) > 1e-9:
            raise ValueError(f"ForecastConfig.period_s ({self.period_s:g}) must be a multiple of step_s "
                             f"({self.step_s:g})")
        if self.error_side not in ("both", "upper"):
            raise ValueError(f"ForecastConfig.error_side must be 'both' or 'upper', got {self.error_side!r}")
        if not self.error_clip > 0:
            raise ValueError(f"ForecastConfig.error_clip must be > 0, got {self.error_clip}")
        if self.noise_exponent < 0:
            raise ValueError(f"ForecastConfig.noise_exponent must be >= 0, got {self.noise_exponent}")
        if self.context_tod_buckets < 0:
            raise ValueError(
                f"ForecastConfig.context_tod_buckets must be >= 0, got {self.context_tod_buckets}"
            )
        for name in ("context_level_edges", "context_vol_edges"):
            edges = getattr(self, name)
            if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
                raise ValueError(f"ForecastConfig.{name} must increase, got {edges}")
        if not 0 < self.context_quantile < 1:
            raise ValueError(
                f"ForecastConfig.context_quantile must be in (0, 1), got {self.context_quantile}"
            )
        if self.context_horizon_steps < 1:
            raise ValueError(
                f"ForecastConfig.context_horizon_steps must be >= 1, got {self.context_horizon_steps}"
            )
        if self.tail_horizon_steps < 1:
            raise ValueError(f"ForecastConfig.tail_horizon_steps must be >= 1, got {self.tail_horizon_steps}")
        if self.shift_half_life_s < 0 or not self.shift_threshold > 0:
            raise ValueError(
                f"ForecastConfig.shift_half_life_s must be >= 0 (0 = off) and shift_threshold > 0, got "
                f"{self.shift_half_life_s} and {self.shift_threshold}"
            )
        weeks = self.week_s / self.period_s
        if (
            self.week_s < 0
            or abs(weeks - round(weeks)) > 1e-9
            or not self.week_half_life_s > 0
            or self.week_shrink < 0
        ):
            raise ValueError(
                f"ForecastConfig.week_s ({self.week_s:g}) must be 0 (off) or a multiple of period_s "
                f"({self.period_s:g}), week_half_life_s > 0 and week_shrink >= 0"
            )
        if not 0 <= self.lead_quantile < 1:
            raise ValueError(
                f"ForecastConfig.lead_quantile must be in [0, 1) (0 = off), got {self.lead_quantile}"
            )
        if self.quantile_window_steps < 1 or (self.lead_quantile > 0
                                               and self.quantile_window_steps > self.horizon_steps):
            raise ValueError(f"ForecastConfig.quantile_window_steps must be in [1, horizon steps "
                             f"({self.horizon_steps})], got {self.quantile_window_steps}")
        lo, hi = self.quantile_rho_range
        if not (self.quantile_lr > 0 and self.quantile_init > 0 and self.quantile_z > 0 and 0 < lo <= hi):
            raise ValueError(
                "ForecastConfig.quantile_lr, quantile_init, quantile_z must be > 0 and quantile_rho_range "
                f"(lo, hi) with 0 < lo <= hi, got {self.quantile_lr}, {self.quantile_init} and "
                f"{self.quantile_rho_range}"
            )
        if self.context_prior_n < 0 or not self.context_max_factor >= 1:
            raise ValueError("ForecastConfig.context_prior_n must be >= 0 and context_max_factor >= 1, got "
                             f"{self.context_prior_n} and {self.context_max_factor}")

    @property
    def horizon_steps(self) -> int:
        return max(1, math.ceil(self.horizon_s / self.step_s - 1e-9))

    @property
    def slots(self) -> int:
        return round(self.period_s / self.step_s)

    @property
    def week_slots(self) -> int:
        """Slots of the week (0 = weekly structure off)."""
        return round(self.week_s / self.step_s)

    @property
    def contexts(self) -> int:
        """Number of conditional-quantile contexts (1 = the feature is off)."""
        return (max(self.context_tod_buckets, 1) * (len(self.context_level_edges) + 1)
                * (len(self.context_vol_edges) + 1))

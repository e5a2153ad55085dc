"""Serving demand forecast (GPUs) over a horizon, from the demand's own history. Pure.

``center(h)`` is the time-of-day profile corrected by the live level and a damped trend (fading over
the horizon); ``scale(h)`` is the forecaster's own recent error at horizon h, times its time-of-day,
burst and context factors; ``upper(h; z) = center(h) + z * scale(h)``, ``z`` calibrated by the loan
policy. The state also keeps a weeks-long tail memory of the worst misses per lead window (the model
and its knobs: docs/loaning.md, "The forecast").

Call order: ``state = initial_state(config)``; for each observation in time order ``state =
observe(config, state, t_s, demand_gpus)`` (NaN = missing; on the ``step_s`` grid of the first one,
skipped steps missing); ``forecast(config, state)`` is the path made at the last observation. Nothing
mutates its inputs; arrays in states and results are read-only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from tidal.policy.forecast_config import (  # noqa: F401 (the groups re-exported with the config)
    ContextConfig,
    ErrorScaleConfig,
    ForecastConfig,
    LevelConfig,
    SeasonConfig,
    setting_names,
    with_settings,
)
from tidal.policy.forecast_errors import CTX_BINS, TAIL_BINS, context_factor, context_of
from tidal.policy.forecast_state import ForecastState


def decay(dt_s: float, half_life_s: float) -> float:
    """The weight left after ``dt_s`` for a memory with half-life ``half_life_s`` (0 if half-life <= 0)."""
    if half_life_s <= 0:
        return 0.0
    return 2.0 ** (-dt_s / half_life_s)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class Forecast:
    """A forecast path made at ``t_s``: ``times_s[i] = t_s + (i + 1) * step_s``, the expected demand
    ``center_gpus`` and the error scale ``scale_gpus`` at each point."""

    t_s: float
    times_s: np.ndarray
    center_gpus: np.ndarray
    scale_gpus: np.ndarray

    def upper(self, z: float) -> np.ndarray:
        return self.center_gpus + z * self.scale_gpus


def initial_state(config: ForecastConfig) -> ForecastState:
    """The state before any observation."""
    h = config.horizon_steps
    return ForecastState(
        t_s=math.nan, n_obs=0, level_gpus=math.nan, trend_gpus_per_s=0.0, mean_gpus=math.nan,
        profile_gpus=_frozen(np.zeros(config.slots)), profile_n=_frozen(np.zeros(config.slots)),
        err_sum=_frozen(np.zeros(h)), err_weight=_frozen(np.zeros(h)),
        past_center=_frozen(np.full((h, h), np.nan)),
        err_profile=_frozen(np.zeros(config.slots)), err_profile_n=_frozen(np.zeros(config.slots)),
        burst=1.0, scale_gpus=_frozen(np.full(h, np.nan)),
        past_base=_frozen(np.full((h, h), np.nan)),
        past_ctx=_frozen(np.zeros((h, h))),
        ctx_hist=_frozen(np.zeros((config.contexts, CTX_BINS.size - 1))) if config.contexts > 1 else None,
        tail_hist=_frozen(np.zeros((config.tail_horizon_steps, TAIL_BINS.size - 1))),
        tail_pending=_frozen(np.full((config.slots, config.tail_horizon_steps), -np.inf)),
    )


def slot_of(config: ForecastConfig, t_s: float | np.ndarray) -> np.ndarray:
    """Profile slot (0 .. slots-1) of time ``t_s``: its position in the period, in steps."""
    return np.round(np.mod(t_s, config.period_s) / config.step_s).astype(int) % config.slots


def _slot(config: ForecastConfig, t_s: float) -> int:
    """:func:`slot_of` for one finite time, in Python floats (the same arithmetic, less overhead)."""
    return round((t_s % config.period_s) / config.step_s) % config.slots


_last_consts: list[tuple] = [(None, None)]  # [(config, its constants)]: the last config asked for


def _consts(config: ForecastConfig) -> dict[str, np.ndarray]:
    """Per-config constant arrays (read-only); the last config's found by identity (safe with threads)."""
    last = _last_consts[0]
    if last[0] is config:
        return last[1]
    out = _make_consts(config)
    _last_consts[0] = (config, out)
    return out


@functools.lru_cache(maxsize=32)
def _make_consts(config: ForecastConfig) -> dict[str, np.ndarray]:
    hs = np.arange(1, config.horizon_steps + 1)
    t = hs * config.step_s
    lv, er = config.level, config.errors
    out = {
        "hs": hs,
        "fade": 2.0 ** (-t / lv.anomaly_half_life_s) if lv.anomaly_half_life_s > 0 else 0.0 * t,
        "damp_sum": np.cumsum(2.0 ** (-t / lv.trend_damping_half_life_s)
                              if lv.trend_damping_half_life_s > 0 else 0.0 * t),
        "burst_fade": 2.0 ** (-t / er.burst_half_life_s) if er.burst_half_life_s > 0 else 0.0 * t,
    }
    for name, width_s in (("kernel_profile", config.season.profile_smooth_s),
                          ("kernel_error", config.errors.profile_smooth_s)):
        half = max(0, int(round(width_s / config.step_s / 2)))
        out[name] = (np.arange(config.slots)[:, None] + np.arange(-half, half + 1)[None, :]) % config.slots
    for a in out.values():
        a.flags.writeable = False
    return out


def _box(values: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A per-slot profile read through a circular box kernel (``idx``: slots x kernel indices): (the mean
    of the seen slots inside the kernel, their mean observation count); NaN / 0 for a slot never seen."""
    if counts.min() > 0:  # every slot seen: all weights below are 1.0, the same values without masks
        k = float(idx.shape[1])
        return values[idx].sum(axis=1) / k, counts[idx].sum(axis=1) / k
    seen = (counts > 0).astype(float)[idx]
    den = seen.sum(axis=1)
    known = (counts > 0) & (den > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = np.where(known, (values[idx] * seen).sum(axis=1) / den, np.nan)
        days = np.where(known, (counts[idx] * seen).sum(axis=1) / den, 0.0)
    return value, days


def _noise_factor(config: ForecastConfig, center: np.ndarray, mean: float) -> np.ndarray:
    if config.errors.noise_exponent == 0 or not mean > 0:
        return np.ones_like(center)
    return (np.maximum(center, 0.05 * mean) / mean) ** config.errors.noise_exponent


def _error_by_horizon(state: ForecastState) -> np.ndarray:
    """Mean scored error per horizon; NaN where never scored."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(state.err_weight > 0, state.err_sum / state.err_weight, np.nan)


def _error_profile_factor(config: ForecastConfig, state: ForecastState) -> np.ndarray:
    """Per slot: how much larger than usual errors are at that time of day (1 = as usual)."""
    value, days = _box(state.err_profile, state.err_profile_n, _consts(config)["kernel_error"])
    seen = ~np.isnan(value)
    if not seen.any():
        return np.ones(config.slots)
    rel = np.where(seen, value / max(float(np.mean(value[seen])), 1e-12), 1.0)
    k = config.errors.profile_shrink_days
    return (days * rel + k) / (days + k) if k > 0 else rel


def _path(config: ForecastConfig,
          state: ForecastState) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Center, scale, base scale (before the context factor) and context paths from ``state``."""
    c = _consts(config)
    hs = c["hs"]
    step = config.step_s
    level = state.level_gpus
    prof, _ = _box(state.profile_gpus, state.profile_n, c["kernel_profile"])
    p_now = prof[_slot(config, state.t_s)]
    future_slots = slot_of(config, state.t_s + hs * step)
    p_future = prof[future_slots]
    fade = c["fade"]
    if math.isnan(p_now):
        base = np.full(hs.shape, level)
    else:
        base = np.where(np.isnan(p_future), level, p_future + (level - p_now) * fade)
    center = np.maximum(base + state.trend_gpus_per_s * step * c["damp_sum"], 0.0)

    e = _error_by_horizon(state)
    if np.all(np.isnan(e)):
        e = np.full(hs.shape, config.errors.prior_scale_fraction * max(level, 0.0))
    else:
        # Horizons not scored yet borrow from the nearest shorter scored one; errors never shrink with h.
        el = e.tolist()
        first = next(i for i, x in enumerate(el) if x == x)
        el[:first] = [el[first]] * first
        for i in range(first + 1, len(el)):
            if el[i] != el[i]:  # NaN
                el[i] = el[i - 1]
        e = np.maximum.accumulate(np.array(el))
    mean = state.mean_gpus
    floor = config.errors.min_scale_fraction * mean if mean > 0 else 0.0
    tod = _error_profile_factor(config, state)[future_slots]
    burst = 1.0 + max(state.burst - 1.0, 0.0) * c["burst_fade"]
    # x * 1.0 is x exactly: with additive noise (the default) the noise factor is left out
    additive = config.errors.noise_exponent == 0 or not mean > 0
    noisy = e if additive else e * _noise_factor(config, center, mean)
    base = np.maximum(noisy * tod * burst, floor)
    if config.contexts > 1:
        ctx = context_of(config, state, center, future_slots)
        scale = np.maximum(base * context_factor(config, state)[ctx], floor)
    else:
        ctx = np.zeros(hs.shape)
        scale = base
    return center, scale, base, ctx


def _advance(config: ForecastConfig, state: ForecastState, t_s: float, y: float) -> ForecastState:
    """One grid step to ``t_s`` with observation ``y`` (NaN = missing)."""
    step = config.step_s
    h = config.horizon_steps
    s = _slot(config, t_s)
    day_w = 1.0 - decay(config.period_s, config.season.profile_half_life_s)
    err_sum, err_weight = state.err_sum, state.err_weight
    eprof, eprof_n = state.err_profile, state.err_profile_n
    burst = state.burst
    ctx_hist = state.ctx_hist
    tail_hist, tail_pending = state.tail_hist, state.tail_pending
    if not math.isnan(y) and state.n_obs > 0:
        # Score the paths made 1..H steps ago at their points that target now.
        preds = np.diagonal(state.past_center).copy()
        ok = ~np.isnan(preds)
        if ok.any():
            diff = y - np.where(ok, preds, 0.0)
            if config.errors.side == "upper":
                diff = np.maximum(diff, 0.0)
            if config.errors.noise_exponent == 0 or not state.mean_gpus > 0:  # x / 1.0 is x exactly
                err = np.where(ok, np.abs(diff), 0.0)
            else:
                norm = _noise_factor(config, np.where(ok, preds, 0.0), state.mean_gpus)
                err = np.where(ok, np.abs(diff) / norm, 0.0)
            before = _error_by_horizon(state)
            if config.errors.clip_errors < math.inf:
                clip = config.errors.clip_errors
                err = np.where(before > 0, np.minimum(err, clip * np.nan_to_num(before)), err)
            rel = ok & (before > 0)
            keep = decay(step, config.errors.half_life_s)
            err_sum = np.where(ok, keep * err_sum + err, err_sum)
            err_weight = np.where(ok, keep * err_weight + 1.0, err_weight)
            if rel.any():
                # How this time of day's errors compare with the usual error at each horizon.
                eprof, eprof_n = eprof.copy(), eprof_n.copy()
                eprof_n[s] += 1
                ratio = err[rel] / before[rel]  # its mean as np.mean computes it (sum, then / count)
                eprof[s] += max(day_w, 1.0 / eprof_n[s]) * (
                    float(np.add.reduce(ratio) / ratio.size) - eprof[s]
                )
            if state.ctx_hist is not None and state.past_base is not None and state.past_ctx is not None:
                # Standardized errors of the first horizons, into their contexts.
                k = min(config.context.horizon_steps, h)
                base = np.diagonal(state.past_base)[:k]
                ctx = np.diagonal(state.past_ctx)[:k]
                good = ok[:k] & (base > 0)
                hist = state.ctx_hist * decay(step, config.context.half_life_s)
                if good.any():
                    r = (y - preds[:k][good]) / base[good]
                    b = _clip_int(np.searchsorted(CTX_BINS, r, side="right") - 1, CTX_BINS.size - 2)
                    np.add.at(hist, (ctx[good].astype(int), b), 1.0)
                ctx_hist = hist
            if tail_hist is not None and state.mean_gpus > 0:
                # Worst miss over lead windows of 1..K steps, in units of the mean; the first period's
                # misses wait in tail_pending (GPUs) until the mean is a reference.
                k = min(config.tail_horizon_steps, h)
                miss = np.full(config.tail_horizon_steps, -np.inf)
                miss[:k] = np.maximum.accumulate(np.where(ok[:k], y - np.where(ok, preds, 0.0)[:k], -np.inf))
                keep_t = decay(step, config.tail_half_life_s)
                if tail_pending is not None and state.n_obs < config.slots:
                    tail_pending = tail_pending.copy()
                    tail_pending[state.n_obs] = miss
                else:
                    hist = tail_hist * keep_t
                    rows = [(miss, 1.0)]
                    if tail_pending is not None:
                        ages = (state.n_obs - np.arange(config.slots)).clip(min=1)
                        rows += [(tail_pending[i], keep_t ** ages[i]) for i in range(config.slots)]
                        tail_pending = None
                    for m, w in rows:
                        good = np.isfinite(m)
                        if good.any():
                            at = np.searchsorted(TAIL_BINS, m[good] / state.mean_gpus, side="right")
                            b = _clip_int(at - 1, TAIL_BINS.size - 2)
                            hist[np.flatnonzero(good), b] += w
                    tail_hist = hist
            if rel[0]:
                # Recent surprise at one step ahead, relative to the usual one-step error.
                keep_b = decay(step, config.errors.burst_half_life_s)
                burst += (1.0 - keep_b) * (float(err[0] / before[0]) - burst)

    level, trend, mean = state.level_gpus, state.trend_gpus_per_s, state.mean_gpus
    prof, prof_n = state.profile_gpus, state.profile_n
    n_obs = state.n_obs
    if not math.isnan(y):
        if n_obs == 0:
            level, mean = y, y
        else:
            a = 1.0 - decay(step, config.level.half_life_s)
            new_level = level + a * (y - level)
            bt = 1.0 - decay(step, config.level.trend_half_life_s)
            trend = trend + bt * ((new_level - level) / step - trend)
            level = new_level
            mw = 1.0 - decay(step, config.season.profile_half_life_s)
            mean = mean + max(mw, 1.0 / (n_obs + 1)) * (y - mean)
        prof, prof_n = prof.copy(), prof_n.copy()
        prof_n[s] += 1
        prof[s] += max(day_w, 1.0 / prof_n[s]) * (y - prof[s])
        n_obs += 1

    new = replace(
        state, t_s=t_s, n_obs=n_obs, level_gpus=level, trend_gpus_per_s=trend, mean_gpus=mean,
        profile_gpus=_frozen(prof), profile_n=_frozen(prof_n), err_sum=_frozen(np.asarray(err_sum, float)),
        err_weight=_frozen(np.asarray(err_weight, float)), err_profile=_frozen(eprof),
        err_profile_n=_frozen(eprof_n), burst=burst,
        ctx_hist=None if ctx_hist is None else _frozen(np.asarray(ctx_hist, float)),
        tail_hist=None if tail_hist is None else _frozen(np.asarray(tail_hist, float)),
        tail_pending=None if tail_pending is None else _frozen(tail_pending),
    )
    if n_obs == 0:
        center = scale = base = np.full(h, np.nan)
        ctx = np.zeros(h)
    else:
        center, scale, base, ctx = _path(config, new)
    # ``new`` is seen by nobody yet and _path does not read these: set in place (one object per step)
    put = object.__setattr__
    put(new, "past_center", _frozen(_push_row(center, state.past_center)))
    put(new, "scale_gpus", _frozen(scale))
    put(new, "past_base", None if state.past_base is None else _frozen(_push_row(base, state.past_base)))
    put(new, "past_ctx", None if state.past_ctx is None else _frozen(_push_row(ctx, state.past_ctx)))
    return new


def _clip_int(a: np.ndarray, hi: int) -> np.ndarray:
    """``np.clip(a, 0, hi)`` for integers, without its per-call overhead."""
    return np.minimum(np.maximum(a, 0), hi)


def _push_row(row: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``np.vstack([row[None, :], rows[:-1]])`` as a new float array."""
    out = np.empty(rows.shape)
    out[0] = row
    out[1:] = rows[:-1]
    return out


def observe(config: ForecastConfig, state: ForecastState, t_s: float, demand_gpus: float) -> ForecastState:
    """The state after observing ``demand_gpus`` (NaN = missing) at ``t_s``; ``ValueError`` if ``t_s`` is
    not on the grid after the previous observation or ``demand_gpus`` is negative."""
    y = float(demand_gpus)
    if y < 0 or math.isinf(y):
        raise ValueError(f"demand_gpus must be finite and >= 0 (or NaN for missing), got {demand_gpus}")
    if math.isnan(state.t_s):
        return _advance(config, state, float(t_s), y)
    k = (t_s - state.t_s) / config.step_s
    if round(k) < 1 or abs(k - round(k)) > 1e-6:
        raise ValueError(f"t_s={t_s:g} must be a whole number (>= 1) of step_s={config.step_s:g} after the "
                         f"previous observation at {state.t_s:g}")
    for _ in range(round(k) - 1):
        state = _advance(config, state, state.t_s + config.step_s, math.nan)
    return _advance(config, state, float(t_s), y)


def forecast(config: ForecastConfig, state: ForecastState) -> Forecast:
    """The path made at the last observation. Raises ``ValueError`` before any demand was seen."""
    if state.n_obs == 0:
        raise ValueError("no demand observed yet: call observe() with a number first")
    hs = _consts(config)["hs"]
    return Forecast(t_s=state.t_s, times_s=_frozen(state.t_s + hs * config.step_s),
                    center_gpus=_frozen(state.past_center[0].copy()), scale_gpus=state.scale_gpus)

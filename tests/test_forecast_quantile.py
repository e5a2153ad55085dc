"""The lead-window quantile (tidal.policy.forecast_quantile): pinball-loss SGD learns known quantiles,
the forecast's bound over the window covers at the quantile, and the state persists through the codec."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from tidal.policy import codec
from tidal.policy import forecast as fc
from tidal.policy import forecast_quantile as lq


def _learn(xs: np.ndarray, rs: np.ndarray, tau: float, lr: float = 0.05) -> np.ndarray:
    """Feed (features, target) pairs through a one-step window; the predictions made before each update."""
    model, pending = lq.initial_model(0.0), lq.initial_pending(1)
    out = np.empty(len(rs))
    for i, (x, r) in enumerate(zip(xs, rs, strict=True)):
        out[i] = lq.predict(model, x)
        pending = lq.push(pending, x, 0.0, 1.0)     # center 0, mean 1: the target is the peak itself
        model, pending = lq.observe(model, pending, float(r), tau, lr)
    return out


def test_pinball_sgd_learns_a_heteroscedastic_quantile():
    rng = np.random.default_rng(0)
    n = 10_000
    s = rng.choice([0.5, 2.0], size=n)                      # two noise regimes, told by feature 1
    xs = np.zeros((n, lq.FEATURES))
    xs[:, 0], xs[:, 1] = 1.0, s
    rs = s * rng.normal(size=n)
    tau = 0.9
    q = _learn(xs, rs, tau, lr=0.5)
    late = slice(n // 2, None)
    for regime in (0.5, 2.0):
        sel = s[late] == regime
        under = float(np.mean(rs[late][sel] > q[late][sel]))
        assert abs(under - (1 - tau)) < 0.015, (regime, under)
        true_q = regime * NormalDist().inv_cdf(tau)
        assert abs(float(np.median(q[late][sel])) - true_q) < 0.1 * true_q


def test_window_peak_waits_for_the_whole_window_and_skips_missing_demand():
    model, pending = lq.initial_model(0.0), lq.initial_pending(2)
    x = np.zeros(lq.FEATURES)
    x[0] = 1.0
    pending = lq.push(pending, x, center_max=10.0, mean=5.0)   # made at t; window t+1, t+2
    model, pending = lq.observe(model, pending, 30.0, 0.9, 0.1)  # t+1: not complete yet
    assert model[2, 1] == 0 and pending[0, lq.FEATURES + 1] == 30.0
    pending = lq.push(pending, x, 10.0, 5.0)
    model, pending = lq.observe(model, pending, math.nan, 0.9, 0.1)  # t+2 missing: peak 30 from t+1
    assert model[2, 1] == 1 and model[0, 0] > 0  # (30 - 10) / 5 = 4 > 0: the quantile moved up


def _noisy(days: int, seed: int, sd: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(days * 144)
    return 60 + 20 * np.sin(2 * np.pi * t / 144) + sd * rng.normal(size=t.size)


def test_forecast_bound_over_the_window_covers_at_the_lead_quantile():
    tau = 0.9
    cfg = fc.ForecastConfig(lead=fc.LeadQuantileConfig(quantile=tau, window_steps=2))
    y = _noisy(8, 1, 5.0)
    state = fc.initial_state(cfg)
    under = []
    for i, v in enumerate(y[:-2]):
        state = fc.observe(cfg, state, 600.0 * i, float(v))
        if i >= 3 * 144:
            f = fc.forecast(cfg, state)
            bound = float(np.max(f.upper(cfg.lead.z_scales)[:2]))
            under.append(max(y[i + 1], y[i + 2]) > bound)
    assert abs(float(np.mean(under)) - (1 - tau)) < 0.035
    assert state.lq_model[2, 1] > 1000  # updated at every step


def test_lead_quantile_state_round_trips_through_the_codec_and_off_changes_nothing():
    cfg = fc.ForecastConfig(lead=fc.LeadQuantileConfig(quantile=0.9))
    y = _noisy(1, 2, 3.0)
    on, off = fc.initial_state(cfg), fc.initial_state(fc.ForecastConfig())
    for i, v in enumerate(y):
        on = fc.observe(cfg, on, 600.0 * i, float(v))
        off = fc.observe(fc.ForecastConfig(), off, 600.0 * i, float(v))
    back = codec.decode(codec.encode(on))
    np.testing.assert_array_equal(back.lq_model, on.lq_model)
    np.testing.assert_array_equal(back.lq_pending, on.lq_pending)
    nxt = fc.observe(cfg, back, 600.0 * len(y), 70.0)
    np.testing.assert_array_equal(nxt.scale_gpus, fc.observe(cfg, on, 600.0 * len(y), 70.0).scale_gpus)
    assert off.lq_model is None and off.lq_pending is None
    np.testing.assert_array_equal(
        fc.forecast(cfg, on).center_gpus, fc.forecast(fc.ForecastConfig(), off).center_gpus
    )


@pytest.mark.parametrize(("kw", "match"), [
    ({"lead.quantile": 1.0}, r"lead\.quantile"),
    ({"lead.quantile": 0.9, "lead.window_steps": 0}, r"lead\.window_steps"),
    ({"lead.quantile": 0.9, "lead.window_steps": 10_000}, r"lead\.window_steps"),
    ({"lead.z_scales": 0.0}, "z_scales"),
    ({"lead.rho_range": (2.0, 1.0)}, "rho_range"),
])
def test_bad_lead_quantile_settings_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        fc.with_settings(fc.ForecastConfig(), kw)


# --- weekly structure and level shifts (tidal.policy.forecast) ------------------------------------------

HOURLY = dict(step_s=3600.0, horizon_s=6 * 3600.0)  # (the profile's kernel: 3600 s, the default)


def _six_hours_ahead_error(cfg: fc.ForecastConfig, y: np.ndarray, from_step: int) -> np.ndarray:
    state, err = fc.initial_state(cfg), []
    for i in range(len(y) - 6):
        state = fc.observe(cfg, state, cfg.step_s * i, float(y[i]))
        if i >= from_step:
            err.append(abs(fc.forecast(cfg, state).center_gpus[5] - y[i + 6]))
    return np.array(err)


def test_weekly_departures_are_learnt_and_change_nothing_before_a_week():
    rng = np.random.default_rng(4)
    t = np.arange(3 * 168)  # three weeks, hourly
    weekend = (t // 24) % 7 >= 5
    y = np.where(weekend, 40.0, 100.0) + 15 * np.sin(2 * np.pi * t / 24) + 3 * rng.normal(size=t.size)
    daily = fc.ForecastConfig(**HOURLY)
    weekly = fc.ForecastConfig(**HOURLY, season=fc.SeasonConfig(week_s=7 * 86400.0))
    first_week = _six_hours_ahead_error(weekly, y[:170], 0)
    np.testing.assert_array_equal(first_week[:160], _six_hours_ahead_error(daily, y[:170], 0)[:160])
    off, on = _six_hours_ahead_error(daily, y, 2 * 168), _six_hours_ahead_error(weekly, y, 2 * 168)
    assert on.mean() < 0.6 * off.mean()  # the third week's weekend is expected, not a surprise


def test_a_level_shift_is_rebased_within_a_few_steps():
    rng = np.random.default_rng(5)
    start = 3 * 24
    y = np.where(np.arange(5 * 24) >= start, 80.0, 50.0) + 2 * rng.normal(size=5 * 24)
    cfg = fc.ForecastConfig(**HOURLY, season=fc.SeasonConfig(shift_half_life_s=2 * 3600.0))
    for c, within in ((cfg, True), (fc.ForecastConfig(**HOURLY), False)):
        state = fc.initial_state(c)
        for i in range(start + 4):
            state = fc.observe(c, state, 3600.0 * i, float(y[i]))
        far = fc.forecast(c, state).center_gpus[5]  # 6 h ahead, 4 h after the shift
        assert bool(abs(far - 80.0) < 5.0) is within, far
    assert state.shift_count == 0


def test_a_state_stored_before_the_options_existed_decodes_and_switching_them_on_later_starts_them():
    cfg_off = fc.ForecastConfig()
    y = _noisy(1, 6, 3.0)
    state = fc.initial_state(cfg_off)
    for i, v in enumerate(y):
        state = fc.observe(cfg_off, state, 600.0 * i, float(v))
    doc = codec.encode(state)
    for name in ("lq_model", "lq_pending", "week_dev", "week_n", "shift_gpus", "shift_count"):
        del doc[name]  # as an older version stored it
    old = codec.decode(doc)
    assert old.lq_model is None and old.shift_count == 0
    with pytest.raises(ValueError, match="missing or unknown"):  # a field without a default is still required
        codec.decode({k: v for k, v in doc.items() if k != "level_gpus"})
    on = fc.ForecastConfig(lead=fc.LeadQuantileConfig(quantile=0.8),
                           season=fc.SeasonConfig(week_s=7 * 86400.0))
    nxt = fc.observe(on, old, 600.0 * len(y), 60.0)
    assert nxt.lq_model is not None and nxt.week_dev.size == 7 * 144 and np.isfinite(nxt.scale_gpus).all()
    back_off = fc.observe(cfg_off, nxt, 600.0 * (len(y) + 1), 61.0)
    assert back_off.lq_model is None and back_off.week_dev is None


def test_gaps_zeros_and_spikes_keep_every_option_finite():
    rng = np.random.default_rng(7)
    y = _noisy(3, 7, 8.0).clip(min=0)
    y[rng.random(y.size) < 0.05] = math.nan
    y[100:130] = 0.0
    y[300:303] = 5000.0
    cfg = fc.ForecastConfig(lead=fc.LeadQuantileConfig(quantile=0.8),
                            season=fc.SeasonConfig(week_s=7 * 86400.0, shift_half_life_s=3600.0))
    state = fc.initial_state(cfg)
    for i, v in enumerate(y):
        state = fc.observe(cfg, state, 600.0 * i, float(v))
        if state.n_obs:
            f = fc.forecast(cfg, state)
            assert (
                np.isfinite(f.center_gpus).all()
                and (f.scale_gpus > 0).all()
                and np.isfinite(f.scale_gpus).all()
            )
    assert np.isfinite(state.lq_model).all()

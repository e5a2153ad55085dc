"""Serving traces and the demand forecast: loading, exact small-series forecasts, the daily profile,
the error scale, context quantiles and the tail memory."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tidal.policy import forecast as fc
from tidal.policy import forecast_errors as fe
from tidal.serving.traces import load_trace, parse_time

H = 3600.0


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- traces ----------------------------------------------------------------------------------------


def test_load_trace_seconds_and_demand_scaling(tmp_path):
    p = write(tmp_path, "seconds,requests_per_second\n0,10\n600,20\n1200,40\n1800,30\n")
    tr = load_trace(p)
    assert tr.step_s == 600 and tr.load_column == "requests_per_second" and tr.name == "t"
    np.testing.assert_array_equal(tr.demand_gpus(8), [2, 4, 8, 6])  # 8 GPUs serve the peak (40)
    assert tr.duration_s == 2400


def test_load_trace_iso_times_and_named_columns(tmp_path):
    p = write(tmp_path, "region,ts,qps\neu,2024-05-01T00:00:00Z,5\neu,2024-05-01T00:10:00Z,7\n"
                        "eu,2024-05-01T00:20:00+00:00,6\n")
    tr = load_trace(p, time_column="ts", load_column="qps")
    assert tr.step_s == 600
    assert tr.times_s[0] == parse_time("2024-05-01T00:00:00") == 1714521600.0


def test_load_trace_marks_outages_as_gaps_not_zero_demand(tmp_path):
    p = write(tmp_path, "seconds,load\n" + "".join(f"{600 * i},{v}\n" for i, v in
                                                   enumerate([50, 52, 0, 0, 0.2, 51, 49])))
    tr = load_trace(p)
    assert tr.gap.tolist() == [False, False, True, True, True, False, False]
    d = tr.demand_gpus(52)
    assert np.isnan(d[2:5]).all() and d[1] == 52
    assert not load_trace(p, gap_below_fraction=0).gap.any()


@pytest.mark.parametrize(("text", "match"), [
    ("seconds,load\n0,1\n600,x\n1200,3\n", r"t.csv:3: load 'x'"),
    ("seconds,load\n0,1\n600,2\n1200,3\n2100,3\n", r"t.csv:5: rows must be evenly spaced every 600 s"),
    ("seconds,load\n0,1\n600,-2\n1200,3\n", r"t.csv:3: load '-2' .* must be finite and >= 0"),
    ("seconds,load\n600,1\n0,2\n1200,3\n", r"t.csv:3: time does not increase"),
    ("seconds,load\n0,1\nnoon,2\n1200,3\n", r"t.csv:3: time 'noon'"),
    ("seconds,load\n0,1\n", "at least two rows"),
])
def test_load_trace_errors_name_file_line_and_column(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_trace(write(tmp_path, text))


def test_load_trace_unknown_column(tmp_path):
    with pytest.raises(ValueError, match="no column 'qps' for the load"):
        load_trace(write(tmp_path, "seconds,load\n0,1\n600,2\n"), load_column="qps")


# --- forecast: exact small series -------------------------------------------------------------------

NO_TREND = fc.ForecastConfig(step_s=600, horizon_s=3600, level=fc.LevelConfig(trend_damping_half_life_s=0))


def run(config: fc.ForecastConfig, values, t0: float = 0.0) -> fc.ForecastState:
    s = fc.initial_state(config)
    for i, y in enumerate(values):
        s = fc.observe(config, s, t0 + config.step_s * i, y)
    return s


def test_constant_demand_is_forecast_exactly_with_the_floor_scale():
    s = run(NO_TREND, [10.0])
    f = fc.forecast(NO_TREND, s)
    np.testing.assert_array_equal(f.center_gpus, 10.0)
    np.testing.assert_allclose(f.scale_gpus, 2.5)  # no error seen yet: prior 25 % of the level
    np.testing.assert_array_equal(f.times_s, 600.0 * np.arange(1, 7))
    f = fc.forecast(NO_TREND, run(NO_TREND, [10.0] * 8))
    np.testing.assert_allclose(f.center_gpus, 10.0)
    np.testing.assert_allclose(f.scale_gpus, 0.1)  # errors are 0: floor of 1 % of the mean
    np.testing.assert_allclose(f.upper(3.0), 10.3)


def test_level_moves_half_way_per_step_and_errors_set_the_scale():
    s = run(NO_TREND, [10.0, 20.0])
    f = fc.forecast(NO_TREND, s)
    assert s.level_gpus == 15.0  # level half-life = one step: half way to the new value
    np.testing.assert_allclose(f.center_gpus, 15.0)  # no slot of the profile is known ahead yet
    # The 1-step error was |20 - 10| = 10 (noise factor 1 at the mean); longer horizons borrow it.
    np.testing.assert_allclose(f.scale_gpus, 10.0)


def test_trend_extends_a_steady_rise():
    cfg = fc.ForecastConfig(step_s=600, horizon_s=3600, season=fc.SeasonConfig(profile_smooth_s=0))
    f = fc.forecast(cfg, run(cfg, [10.0 + 2 * i for i in range(12)]))
    assert np.all(np.diff(f.center_gpus) > 0)  # still rising ...
    assert f.center_gpus[-1] - f.center_gpus[0] < 2 * 5  # ... but damped, less than the raw slope


def test_missing_and_skipped_observations():
    s = run(NO_TREND, [10.0, 10.0, math.nan])
    assert s.level_gpus == 10.0 and s.n_obs == 2 and s.t_s == 1200.0
    s2 = fc.observe(NO_TREND, run(NO_TREND, [10.0, 10.0]), 2400.0, 30.0)  # skips 1800: a missing step
    assert s2.n_obs == 3 and s2.t_s == 2400.0
    with pytest.raises(ValueError, match="whole number"):
        fc.observe(NO_TREND, s, 1500.0, 1.0)
    with pytest.raises(ValueError, match="whole number"):
        fc.observe(NO_TREND, s, 1200.0, 1.0)
    with pytest.raises(ValueError, match="demand_gpus must be finite"):
        fc.observe(NO_TREND, s, 1800.0, -1.0)
    with pytest.raises(ValueError, match="no demand observed"):
        fc.forecast(NO_TREND, run(NO_TREND, [math.nan]))
    with pytest.raises(ValueError, match="multiple of step_s"):
        fc.ForecastConfig(step_s=700)


def test_observe_is_pure():
    s = run(NO_TREND, [10.0, 12.0])
    before = (s.level_gpus, s.profile_gpus.copy(), s.past_center.copy())
    a = fc.observe(NO_TREND, s, 1200.0, 30.0)
    b = fc.observe(NO_TREND, s, 1200.0, 30.0)
    assert s.level_gpus == before[0]
    np.testing.assert_array_equal(s.profile_gpus, before[1])
    np.testing.assert_array_equal(s.past_center, before[2])
    np.testing.assert_array_equal(fc.forecast(NO_TREND, a).center_gpus, fc.forecast(NO_TREND, b).center_gpus)
    assert not a.profile_gpus.flags.writeable


def test_profile_forecasts_the_morning_rise_from_the_night():
    """Hourly square-wave days: 20 GPUs 0-8 h, 80 GPUs 8-24 h. At 5:00 on day 3 the level says 20,
    the profile says 80 from 8:00: the path must rise there (before it happens)."""
    cfg = fc.ForecastConfig(step_s=H, horizon_s=6 * H, season=fc.SeasonConfig(profile_smooth_s=0),
                            level=fc.LevelConfig(trend_damping_half_life_s=0))
    values = [20.0 if (h % 24) < 8 else 80.0 for h in range(2 * 24 + 6)]
    f = fc.forecast(cfg, run(cfg, values))
    assert f.t_s == 2 * 86400 + 5 * H
    rise = np.flatnonzero(f.times_s % 86400 == 8 * H)[0]
    np.testing.assert_allclose(f.center_gpus[:rise], 20.0, atol=0.5)
    np.testing.assert_allclose(f.center_gpus[rise:], 80.0, atol=3.0)
    assert f.scale_gpus[rise] > f.scale_gpus[0]  # past rises were missed at long horizons: wider there


def test_scale_never_shrinks_with_horizon_on_noise():
    rng = np.random.default_rng(0)
    cfg = fc.ForecastConfig(step_s=600, horizon_s=3 * H, errors=fc.ErrorScaleConfig(
        burst_half_life_s=0, profile_shrink_days=1e9, noise_exponent=0))
    s = run(cfg, 50 + 5 * rng.standard_normal(300))
    assert np.all(np.diff(fc.forecast(cfg, s).scale_gpus) >= -1e-6)


def test_context_quantile_of_a_histogram_and_the_factor_per_context():
    bins = fe.CTX_BINS
    hist = np.zeros(bins.size - 1)
    hist[np.searchsorted(bins, 1.0, side="right") - 1] = 10.0  # ten errors in the bin [1.0, 1.1)
    assert fe.hist_quantile(hist, 0.5) == pytest.approx(1.05)
    assert math.isnan(fe.hist_quantile(np.zeros_like(hist), 0.5))
    cfg = fc.ForecastConfig(context=fc.ContextConfig(level_edges=(1.0,), quantile=0.5, prior_n=0))
    wide = np.zeros_like(hist)
    wide[np.searchsorted(bins, 3.0, side="right") - 1] = 10.0  # the other context's errors: 3.0 .. 3.1
    s = replace(fc.initial_state(cfg), ctx_hist=np.stack([hist, wide]))
    # Pooled median: the top of the first bin (1.1, half the mass at or below it); each context's
    # median (1.05, 3.05) against it.
    np.testing.assert_allclose(fe.context_factor(cfg, s), [1.05 / 1.1, 3.05 / 1.1], rtol=1e-6)
    shrunk = fc.with_settings(cfg, {"context.prior_n": 1e6, "context.quantile": 0.25})  # all prior: pooled
    np.testing.assert_allclose(fe.context_factor(shrunk, s), 1.0, atol=1e-4)


def test_tail_reserve_from_a_hand_built_histogram():
    """98 misses of 0 and 2 of one mean (10 GPUs) over a 2-step lead window: E[(m - R)+] = 0.02 (1.005 - R)
    in units of the mean (bins are 0.01 wide; a miss counts at its bin's center)."""
    cfg = fc.ForecastConfig(tail_horizon_steps=3)
    bins = fe.TAIL_BINS
    row = np.zeros(bins.size - 1)
    row[np.searchsorted(bins, 0.0, side="right") - 1] = 98.0
    row[np.searchsorted(bins, 1.0, side="right") - 1] = 2.0
    hist = np.zeros((3, row.size))
    hist[1] = hist[2] = row  # lead windows of 2 and 3 steps
    s = replace(fc.initial_state(cfg), mean_gpus=10.0, tail_hist=hist)
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.01) == pytest.approx(5.05)  # 0.02 (1.005 - R) = 0.01
    assert fe.tail_reserve_gpus(cfg, s, 2, 1e-9) == pytest.approx(10.1, abs=1e-3)  # ~ the largest miss
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.03) == 0.0  # more than E[m+]: no reserve
    assert fe.tail_reserve_gpus(cfg, s, 1, 1e-9) == 0.0  # nothing scored for 1-step windows
    assert fe.tail_reserve_gpus(cfg, s, 9, 0.01) == pytest.approx(5.05)  # clipped to tail_horizon_steps
    # Lumpy misses (2 in 100 samples) over a short period need more: + kappa sd of the period's mean.
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.01, kappa=1.0, period_steps=100) > 6.0


def test_tail_reserve_prior_weighs_while_the_history_is_short_or_quiet():
    """The prior: ``prior_steps`` lead windows missed by ``prior_miss`` x mean, never decaying."""
    cfg = fc.ForecastConfig(tail_horizon_steps=3)
    bins = fe.TAIL_BINS
    quiet = np.zeros((3, bins.size - 1))
    quiet[:, np.searchsorted(bins, 0.0, side="right") - 1] = 98.0  # 98 windows, no miss at all
    s = replace(fc.initial_state(cfg), mean_gpus=10.0, tail_hist=quiet)
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.01) == 0.0  # nothing seen, nothing kept
    # + 2 windows missed by one mean (bin 1.00 .. 1.01, center 1.005): 0.02 (1.005 - R) = 0.01
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.01, prior_miss=1.0, prior_steps=2.0) == pytest.approx(5.05)
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.01, prior_miss=1.0, prior_steps=0.0) == 0.0  # off
    assert fe.tail_reserve_gpus(cfg, s, 2, 0.01, prior_miss=0.0, prior_steps=2.0) == 0.0  # off
    # The same prior after 100 times the history: it weighs 1/100 as much, no reserve needed.
    long = replace(s, tail_hist=quiet * 100)
    assert fe.tail_reserve_gpus(cfg, long, 2, 0.01, prior_miss=1.0, prior_steps=2.0) == 0.0
    # A history whose own misses already need a reserve above the prior's miss: the prior changes nothing
    # but the total the expected excess is over (its windows count there).
    big = quiet.copy()
    big[:, np.searchsorted(bins, 2.0, side="right") - 1] = 2.0
    b = replace(s, tail_hist=big)
    assert fe.tail_reserve_gpus(cfg, b, 2, 1e-4, prior_miss=1.0, prior_steps=2.0) == pytest.approx(
        fe.tail_reserve_gpus(cfg, b, 2, 1e-4), rel=1e-3)
    # A prior beyond the histogram's range counts in its last bin; an empty history keeps the prior alone.
    empty = replace(s, tail_hist=np.zeros_like(quiet))
    assert fe.tail_reserve_gpus(cfg, empty, 2, 1e-9, prior_miss=99.0, prior_steps=1.0) == pytest.approx(
        bins[-1] * 10.0, rel=1e-3)


def test_tail_memory_keeps_the_worst_miss_of_each_lead_window():
    cfg = fc.ForecastConfig(step_s=600, horizon_s=2 * H, period_s=H, tail_horizon_steps=3)  # 6-step period
    early = run(cfg, [10.0] * 6)  # the first period: misses wait (in GPUs) until the mean is a reference
    assert early.tail_hist.sum() == 0 and np.isfinite(early.tail_pending).sum() == 3 * 5
    s = run(cfg, [10.0] * 30)
    assert s.tail_pending is None
    assert s.tail_hist.sum() == pytest.approx(3 * 29, rel=1e-2)  # 29 scored steps x 3 window lengths, decayed
    before = s.tail_hist.copy()
    jump = fc.observe(cfg, s, s.t_s + 600, 30.0)  # 20 GPUs above every center that targeted it
    np.testing.assert_array_equal(s.tail_hist, before)  # pure
    added = jump.tail_hist - before * fc.decay(600, cfg.tail_half_life_s)
    at = np.searchsorted(fe.TAIL_BINS, 20.0 / s.mean_gpus, side="right") - 1
    np.testing.assert_allclose(added[:, at], 1.0)
    assert added.sum() == pytest.approx(3.0)
    assert fe.tail_reserve_gpus(cfg, jump, 2, 1e-9) == pytest.approx((fe.TAIL_BINS[at + 1]) * jump.mean_gpus,
                                                                     rel=1e-3)


def test_context_quantiles_widen_the_scale_where_errors_are_large():
    """Level alternates every 7 h (not aligned with the day) between 20 GPUs, noise sd 0.5, and 60
    GPUs, noise sd 6. One shared error scale cannot tell them apart; a level context can."""
    rng = np.random.default_rng(1)
    t = np.arange(6 * 144)
    high = (t // 42) % 2 == 1
    y = np.where(high, 60 + 6 * rng.standard_normal(t.size), 20 + 0.5 * rng.standard_normal(t.size))
    off = fc.ForecastConfig(step_s=600, horizon_s=2 * H, context=fc.ContextConfig(level_edges=()))
    on = replace(off, context=fc.ContextConfig(level_edges=(1.0,), quantile=0.9))
    assert off.contexts == 1 and on.contexts == 2
    s_off, s_on = run(off, y), run(on, y)
    assert s_off.ctx_hist is None
    factor = fe.context_factor(on, s_on)
    assert factor[1] > 1.5 * factor[0]  # [below the mean, above it]
    assert s_on.ctx_hist.sum() > 0 and not s_on.ctx_hist.flags.writeable
    hist = s_on.ctx_hist.copy()
    later = fc.observe(on, s_on, s_on.t_s + 600, 5000.0)  # a miss far above the center: pure, and counted
    np.testing.assert_array_equal(s_on.ctx_hist, hist)
    assert later.ctx_hist[:, -1].sum() > hist[:, -1].sum()  # beyond the histogram: the end bin
    # The scale is the context-free one times the factor of each point's context.
    f = fc.forecast(on, s_on)
    ctx = s_on.past_ctx[0].astype(int)
    np.testing.assert_allclose(
        f.scale_gpus, np.maximum(s_on.past_base[0] * factor[ctx], 0.01 * s_on.mean_gpus)
    )
    # The contexts only multiply: the center and the scale before the factor are those with them off.
    np.testing.assert_allclose(f.center_gpus, fc.forecast(off, s_off).center_gpus)
    np.testing.assert_allclose(s_on.past_base[0], fc.forecast(off, s_off).scale_gpus)


@pytest.mark.parametrize(("kw", "match"), [
    ({"level_edges": (1.2, 0.9)}, r"ForecastConfig\.context\.level_edges must increase"),
    ({"quantile": 1.0}, r"ForecastConfig\.context\.quantile must be in \(0, 1\)"),
    ({"tod_buckets": -1}, r"ForecastConfig\.context\.tod_buckets must be >= 0"),
    ({"max_factor": 0.5}, "max_factor >= 1"),
])
def test_context_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        fc.ForecastConfig(context=fc.ContextConfig(**kw))


def test_settings_by_name_and_a_wrong_group_are_refused_clearly():
    cfg = fc.with_settings(fc.ForecastConfig(), {"errors.noise_exponent": 0.5, "step_s": 300.0})
    assert cfg.errors.noise_exponent == 0.5 and cfg.step_s == 300.0 and cfg.errors.side == "both"
    names = fc.setting_names()
    assert {"step_s", "season.profile_half_life_s", "errors.noise_exponent", "context.quantile"} <= set(names)
    with pytest.raises(ValueError, match="no setting 'noise_exponent'"):
        fc.with_settings(fc.ForecastConfig(), {"noise_exponent": 0.5})
    with pytest.raises(ValueError, match=r"ForecastConfig\.season must be a SeasonConfig"):
        fc.ForecastConfig(season={"profile_half_life_s": 3600.0})


@pytest.mark.parametrize("name", ["lead.quantile", "lead.window_steps", "season.week_s",
                                  "season.week_half_life_s", "season.week_shrink_weeks",
                                  "season.shift_half_life_s", "season.shift_threshold_errors"])
def test_a_removed_setting_is_refused_by_name(name):
    assert name not in fc.setting_names()
    with pytest.raises(ValueError, match=rf"ForecastConfig has no setting '{re.escape(name)}'"):
        fc.with_settings(fc.ForecastConfig(), {name: 1.0})


@pytest.mark.parametrize("settings", [{}, {"context.tod_buckets": 4, "context.vol_edges": (1.3,),
                                           "errors.noise_exponent": 0.5}])
def test_gaps_zeros_and_spikes_keep_the_forecast_finite(settings):
    rng = np.random.default_rng(7)
    t = np.arange(3 * 144)
    y = (60 + 20 * np.sin(2 * np.pi * t / 144) + 8.0 * rng.normal(size=t.size)).clip(min=0)
    y[rng.random(y.size) < 0.05] = math.nan
    y[100:130] = 0.0
    y[300:303] = 5000.0
    cfg = fc.with_settings(fc.ForecastConfig(), settings)
    state = fc.initial_state(cfg)
    for i, v in enumerate(y):
        state = fc.observe(cfg, state, 600.0 * i, float(v))
        if state.n_obs:
            f = fc.forecast(cfg, state)
            assert np.isfinite(f.center_gpus).all() and np.isfinite(f.scale_gpus).all()
            assert (f.scale_gpus > 0).all()

"""The forecast studies of ``python -m lab forecast`` (lab.forecast.study): coverage calibration under a
regime change, the evaluation program on a small trace, the library competitors saying "not installed"
when missing, and (if present) real traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from lab.forecast.coverage import CoverageCalibrator
from tidal.policy import forecast as fc
from tidal.serving.traces import load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
H = 3600.0


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- coverage calibration -------------------------------------------------------------------------


def regime_change_series(days: int, seed: int) -> np.ndarray:
    """10-min demand: daily cycle x lognormal noise; from day 4 the level doubles and the noise
    triples; a few bursts. The forecaster is told nothing."""
    rng = np.random.default_rng(seed)
    t = np.arange(days * 144)
    after = t >= 4 * 144
    sigma = np.where(after, 0.3, 0.1)
    d = (40 + 15 * np.sin(2 * np.pi * t / 144)) * np.where(after, 2.0, 1.0) * np.exp(rng.normal(0, sigma))
    return d * np.where(rng.random(t.size) < 0.004, 1.8, 1.0)


@pytest.mark.parametrize("quantile", [0.9, 0.95])
def test_adaptive_conformal_tracks_the_target_through_a_regime_change(quantile):
    demand = regime_change_series(days=8, seed=3)
    cfg = fc.ForecastConfig(step_s=600, horizon_s=H)
    cal = CoverageCalibrator(quantile=quantile, horizon_steps=2)
    s, cs = fc.initial_state(cfg), cal.initial_state()
    misses_by_day = np.zeros(8)
    for i, d in enumerate(demand):
        s = fc.observe(cfg, s, 600.0 * i, d)
        before = cs.misses
        cs = cal.update(cs, 600.0 * i, d)
        misses_by_day[i // 144] += cs.misses - before
        _, cs = cal.emit(cs, fc.forecast(cfg, s))
    rate_by_day = misses_by_day / 144
    target = 1 - quantile
    assert abs(cs.misses / cs.scored - target) < 0.25 * target  # over the whole series
    assert rate_by_day[4] > 1.5 * target  # the change hurts on the day it happens ...
    assert abs(rate_by_day[5:].mean() - target) < 0.2 * target  # ... and is calibrated away after


# --- the evaluation program ---------------------------------------------------------------------


def test_bench_forecast_runs_on_a_small_trace(tmp_path, capsys):
    from lab.forecast.study import run as bench_run

    demand = regime_change_series(days=3, seed=1)
    p = write(
        tmp_path,
        "seconds,requests_per_second\n" + "".join(f"{600 * i},{v:.4f}\n" for i, v in enumerate(demand)),
        name="synthetic.csv",
    )
    result = bench_run([p], serving_gpus=64, budgets=(0.01,), quantiles=(0.9,), warmup_days=1.0, as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert out["traces"]["synthetic"]["forecast"]["methods"].keys() == {
        "tidal",
        "last-value",
        "seasonal-naive",
        "holt-winters",
    }
    rows = result["traces"]["synthetic"]["harvest"]["budgets"]["0.01"]
    assert set(rows) == {"tidal", "tidal (no tail reserve)", "reactive (hindsight)",
                         "night-window (hindsight)", "oracle"}
    assert rows["oracle"]["shortfall_strict"] == 0.0 and rows["oracle"]["harvest_over_oracle"] == 1.0
    for r in rows.values():
        assert r["shortfall_issue"] <= r["shortfall_strict"] + 1e-12
        assert 0.0 <= r["harvest"] <= 1.0
    assert rows["reactive (hindsight)"]["meets_budget"]


# --- forecasting libraries ----------------------------------------------------------------------


def test_missing_forecasting_libraries_are_reported_not_raised(monkeypatch):
    from lab.forecast.libs import library_forecasts

    monkeypatch.setitem(sys.modules, "statsforecast", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "lightgbm", None)
    y = regime_change_series(days=3, seed=3)
    out = library_forecasts(600.0 * np.arange(y.size), y, lead=2, warmup=288, quantiles=(0.9,), step_s=600.0)
    assert out and all(isinstance(v, str) and v.startswith("not installed") for v in out.values())


def test_the_benchmark_says_not_installed_in_one_line_per_missing_library(monkeypatch, tmp_path, capsys):
    from lab.forecast.study import run as bench_run

    monkeypatch.setitem(sys.modules, "statsforecast", None)
    monkeypatch.setitem(sys.modules, "lightgbm", None)
    y = regime_change_series(days=2, seed=8)
    p = tmp_path / "syn.csv"
    p.write_text("seconds,requests_per_second\n" + "".join(f"{600 * i},{v:.3f}\n" for i, v in enumerate(y)))
    result = bench_run(
        [p], serving_gpus=32, budgets=(0.01,), quantiles=(0.9,), warmup_days=1.0, libraries=True
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "not installed" in ln]
    assert len(lines) == 2 and all("lab/requirements.txt" in ln for ln in lines), lines
    assert set(result["traces"]["syn"]["libraries_missing"]) == {
        "ets (statsforecast AutoETS)",
        "lightgbm (quantile)",
    }


# --- real traces -------------------------------------------------------------------------------------


@pytest.mark.skipif(not (TRACES / "servegen-language-m-large.csv").exists(), reason=f"no traces in {TRACES}")
def test_real_trace_forecast_is_calibrated_and_beats_seasonal_naive():
    from lab.forecast.study import evaluate_forecasts

    tr = load_trace(TRACES / "servegen-language-m-large.csv")
    demand = tr.demand_gpus(128)[: 5 * 144]
    r = evaluate_forecasts(
        tr.times_s[: 5 * 144], demand, step_s=600.0, lead=2, warmup=2 * 144, quantiles=(0.95,)
    )
    m = r["methods"]
    assert 0.02 <= m["tidal"]["0.95"]["under_rate"] <= 0.09
    assert m["tidal"]["0.95"]["pinball_over_mean"] < m["seasonal-naive"]["0.95"]["pinball_over_mean"]

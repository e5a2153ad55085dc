"""``python -m lab forecast``: the serving forecast and the loan policy on real traces, next to baselines.

    python -m lab.forecast.study                                   # ../shared/traces/servegen-*.csv
    python -m lab.forecast.study TRACE.csv ... --serving-gpus 128 --lead-s 1200 --json

Two evaluations, both causal (every decision at time t uses data up to t only), scored after
``--warmup-days`` and never on telemetry gaps (see :mod:`tidal.serving.traces`):

**1. Forecast quality**, ``lead`` ahead (default 20 min at the trace's 10-min resolution), at each
``--quantile`` q. Each method gives an upper bound for the demand ``lead`` ahead:

* ``tidal`` — :mod:`tidal.policy.forecast` (profile + live level/trend, per-horizon error scale),
  its margin calibrated by adaptive conformal inference (:class:`~lab.forecast.coverage.CoverageCalibrator`);
* ``last-value`` — demand now; ``seasonal-naive`` — demand one period (a day) before the target;
  ``holt-winters`` — additive level/trend/daily season, smoothing constants picked by grid search
  on the warm-up days only. Each baseline's bound is its point forecast plus the empirical
  q-quantile of all its past errors (split conformal over time; no hindsight).

Reported: the under-forecast rate (target ``1 - q``) and the pinball loss at q, divided by the
mean demand (lower is better; it rewards tight bounds that are still calibrated).

**2. Harvest in a fluid model** (an early estimate, not the simulator), for each
``--budget`` B. A pool of N serving GPUs is sized for the trace's peak; at each step t every
policy returns ``lent(t)`` (:class:`~tidal.policy.loan.LoanPlan.lendable_gpus`, all assumed lent).

* *shortfall (issue)*: ``max(0, demand(t + lead) - (N - lent(t)))``, the simple formula (the column
  ``shortfall issue``: the loan made at t alone is away at t + lead);
* *shortfall (strict)*: GPUs lent at t cannot be back before t + lead, and new loans leave at
  once, so at time u serving has ``N - max(lent(t) for u - lead <= t < u)``. Always >= the simple one.
  This is what Tidal plans and calibrates for.
* ratios are shortfall GPU-hours / demanded GPU-hours; *harvest* = lent GPU-hours / idle
  GPU-hours (idle = N - demand); ``x oracle`` divides by the oracle's harvest.

Policies: ``tidal`` (budget B, calibrated online, no hindsight); ``reactive`` and
``night-window`` with their margin tuned *with hindsight* (bisection on the scored period) to the
largest harvest whose strict shortfall is within B (the night window is the trace's lowest-demand
``--night-hours`` of the day, also chosen with hindsight); ``oracle`` (knows the future; margin 0).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from lab.forecast.baselines import _conformal_upper, _fit_holt_winters, _holt_winters, _pinball
from lab.forecast.coverage import CoverageCalibrator
from lab.forecast.fluid import (  # the fluid model and the baselines tuned with hindsight
    _night_lent,
    _reactive_lent,
    _tune_margin,
    _tune_offset,
    fluid_score,
    lent_from_upper,
    night_window,
    run_policy,
)
from tidal.policy import forecast as fc
from tidal.policy.baselines import NightWindowPolicy, OraclePolicy, ReactivePolicy
from tidal.policy.loan import (
    LoanTiming,
    TidalConfig,
    TidalPolicy,
)
from tidal.serving.traces import Trace, load_trace

DEFAULT_TRACES_DIR = Path(__file__).resolve().parents[3] / "shared" / "traces"
DEFAULT_TRACES = ("servegen-language-m-large.csv", "servegen-language-m-mid.csv")


def default_traces() -> list[Path]:
    """The ServeGen traces next to the repository (``../shared/traces``), those that exist."""
    return [DEFAULT_TRACES_DIR / n for n in DEFAULT_TRACES if (DEFAULT_TRACES_DIR / n).exists()]


def resample(trace: Trace, step_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times_s, load, gap) at ``step_s`` (:meth:`~tidal.serving.traces.Trace.resample`)."""
    t = trace.resample(step_s)
    return t.times_s, t.load, t.gap


def grid_steps(lead_s: float, step_s: float, warmup_days: float) -> tuple[int, int]:
    """(lead, warm-up) in steps; the lead must be a whole number (>= 1) of steps."""
    lead = round(lead_s / step_s)
    if lead < 1 or abs(lead * step_s - lead_s) > 1e-6:
        raise ValueError(f"--lead-s {lead_s:g} must be a whole multiple (>= 1) of --step-s {step_s:g}")
    return lead, round(warmup_days * 86400.0 / step_s)


def load_demand(
    path: Path, serving_gpus: int, step_s: float, min_steps: int
) -> tuple[Trace, np.ndarray, np.ndarray]:
    """(trace, times_s, demand in GPUs) at ``step_s``, a pool of ``serving_gpus`` sized for the trace's
    peak, gaps NaN; the trace must be longer than ``min_steps`` (the warm-up and the lead)."""
    trace = load_trace(path)
    times, load, gap = resample(trace, step_s)
    demand = serving_gpus * load / float(load[~gap].max())
    demand[gap] = np.nan
    if len(demand) <= min_steps:
        raise ValueError(f"trace {trace.name!r} ({len(demand)} steps) is not longer than the warm-up")
    return trace, times, demand


# ----------------------------------------------------------------------------------------------
# 1. Forecast quality


def _tidal_uppers(times_s: np.ndarray, demand: np.ndarray, cfg: fc.ForecastConfig, lead: int,
                  quantiles: tuple[float, ...]) -> dict[float, np.ndarray]:
    """Tidal's bound for the demand ``lead`` ahead at each quantile: its forecast with the margin calibrated
    by adaptive conformal inference."""
    n = len(demand)
    cals = {tau: CoverageCalibrator(quantile=tau, horizon_steps=lead) for tau in quantiles}
    cal_states = {tau: c.initial_state() for tau, c in cals.items()}
    out = {tau: np.full(n, np.nan) for tau in quantiles}
    state = fc.initial_state(cfg)
    for t in range(n):
        state = fc.observe(cfg, state, times_s[t], demand[t])
        for tau, cal in cals.items():
            cal_states[tau] = cal.update(cal_states[tau], times_s[t], demand[t])
        if state.n_obs:
            f = fc.forecast(cfg, state)
            for tau, cal in cals.items():
                out[tau][t], cal_states[tau] = cal.emit(cal_states[tau], f)
    return out


def evaluate_forecasts(times_s: np.ndarray, demand: np.ndarray, *, step_s: float, lead: int, warmup: int,
                       quantiles: tuple[float, ...], period_s: float = 86400.0,
                       libraries: dict[str, Any] | None = None) -> dict[str, Any]:
    """Under-forecast rate and pinball loss (/ mean demand) per method and quantile (see module doc).
    ``libraries``: the forecasts of :func:`lab.forecast.libs.library_forecasts` (their native
    bounds, and each point forecast with the same split-conformal bound as the baselines here)."""
    n = len(demand)
    period = round(period_s / step_s)
    cfg = fc.ForecastConfig(step_s=step_s, period_s=period_s, horizon_s=max(lead * step_s, 3600.0))
    uppers: dict[str, dict[float, np.ndarray]] = {
        "tidal": _tidal_uppers(times_s, demand, cfg, lead, quantiles)
    }

    points = {"last-value": np.array(demand, dtype=float), "seasonal-naive": np.full(n, np.nan)}
    points["seasonal-naive"][max(0, period - lead):] = demand[: n - max(0, period - lead)]
    alpha, beta, gamma = _fit_holt_winters(demand, period, lead, warmup)
    points["holt-winters"] = _holt_winters(demand, period, lead, alpha, beta, gamma)
    for name, lib in (libraries or {}).items():
        if isinstance(lib, dict):
            uppers[f"{name}, native"] = {tau: lib["upper"][tau] for tau in quantiles}
            if lib["scale"].any():  # a point forecast to put a conformal bound on
                points[f"{name}, conformal"] = lib["center"][:, lead - 1]
    for name, p in points.items():
        uppers[name] = {tau: _conformal_upper(p, demand, lead, tau) for tau in quantiles}

    target = np.full(n, np.nan)
    target[: n - lead] = demand[lead:]
    scored = np.arange(n) >= warmup - lead
    scored &= ~np.isnan(target)
    for u in uppers.values():
        for a in u.values():
            scored &= ~np.isnan(a)
    y = target[scored]
    out: dict[str, Any] = {
        "scored_points": int(scored.sum()),
        "holt_winters_params": {"alpha": alpha, "beta": beta, "gamma": gamma},
        "methods": {},
    }
    for name, by_tau in uppers.items():
        out["methods"][name] = {
            str(tau): {"under_rate": float(np.mean(y > a[scored])),
                       "pinball_over_mean": _pinball(y, a[scored], tau) / float(np.mean(y))}
            for tau, a in by_tau.items()}
    return out


# ----------------------------------------------------------------------------------------------
# 2. Harvest in the fluid model


def evaluate_harvest(
    times_s: np.ndarray,
    demand: np.ndarray,
    *,
    n: int,
    step_s: float,
    lead: int,
    warmup: int,
    budgets: tuple[float, ...],
    restart_cost_s: float,
    night_hours: float,
    log: Callable[[str], None],
    libraries: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tidal vs reactive / night-window (hindsight-tuned) vs oracle, per budget (see module doc); with
    ``libraries`` (:func:`lab.forecast.libs.library_forecasts`), each library's bound on the lead
    window with its margin tuned with hindsight: ``center + z * scale`` (z >= 0) where it has a scale,
    else ``center + m`` (m in GPUs, may be negative)."""
    timing = LoanTiming(notice_s=0.0, final_checkpoint_s=0.0, release_s=0.0, warmup_s=lead * step_s,
                        restart_cost_s=restart_cost_s)
    horizon_s = max(6 * 3600.0, timing.lead_time_s + timing.min_loan_window_s + step_s)
    common = dict(step_s=step_s, horizon_s=horizon_s, timing=timing)
    t0 = times_s[0]
    oracle_lent, _ = run_policy(OraclePolicy(**common), times_s, demand, n, future=True)
    oracle = fluid_score(oracle_lent, demand, n, lead, warmup)
    start_s, end_s = night_window(demand, step_s, night_hours)
    night0 = NightWindowPolicy(start_s=(start_s + t0) % 86400.0, end_s=(end_s + t0) % 86400.0, **common)
    out: dict[str, Any] = {"oracle": oracle, "night_window_s": [start_s, end_s], "budgets": {}}
    for b in budgets:
        rows: dict[str, Any] = {}
        base = TidalConfig(shortfall_budget=b, forecast=fc.ForecastConfig(step_s=step_s, horizon_s=horizon_s),
                           timing=timing)
        variants = [("tidal", base), ("tidal (no tail reserve)", replace(base, tail_budget_fraction=0.0))]
        for name, cfg in variants:
            log(f"  budget {b:g}: {name}")
            lent, state = run_policy(TidalPolicy(cfg), times_s, demand, n)
            rows[name] = {**fluid_score(lent, demand, n, lead, warmup), "margin": f"z={state.z:.2f} at end",
                          "self_reported_shortfall": state.shortfall_ratio}

        log(f"  budget {b:g}: reactive (hindsight)")
        m = _tune_margin(lambda mg: _reactive_lent(demand, n, mg), demand, n, lead, warmup, b)
        lent, _ = run_policy(ReactivePolicy(margin_gpus=m, **common), times_s, demand, n)
        if restart_cost_s == 0 and not np.array_equal(lent, _reactive_lent(demand, n, m)):
            raise AssertionError("vectorized reactive model disagrees with ReactivePolicy")
        rows["reactive (hindsight)"] = {
            **fluid_score(lent, demand, n, lead, warmup),
            "margin": f"{m:.2f} GPUs",
        }

        log(f"  budget {b:g}: night-window (hindsight)")
        m = _tune_margin(lambda mg: _night_lent(night0, times_s, n, mg, lead), demand, n, lead, warmup, b)
        night = replace(night0, margin_gpus=m)
        lent, _ = run_policy(night, times_s, demand, n)
        if restart_cost_s == 0 and not np.array_equal(lent, _night_lent(night, times_s, n, m, lead)):
            raise AssertionError("vectorized night-window model disagrees with NightWindowPolicy")
        rows["night-window (hindsight)"] = {
            **fluid_score(lent, demand, n, lead, warmup),
            "margin": f"{m:.2f} GPUs",
        }
        for name, lib in (libraries or {}).items():
            if not isinstance(lib, dict):
                continue
            log(f"  budget {b:g}: {name} (hindsight)")
            center, scale = lib["center"], lib["scale"]
            if scale.any():
                z = _tune_offset(
                    lambda x, c=center, s_=scale: lent_from_upper(demand, c + x * s_, n),
                    demand,
                    n,
                    lead,
                    warmup,
                    b,
                    0.0,
                    50.0,
                )
                lent, margin = lent_from_upper(demand, center + z * scale, n), f"z={z:.2f}"
            else:
                m = _tune_offset(
                    lambda x, c=center: lent_from_upper(demand, c + x, n),
                    demand,
                    n,
                    lead,
                    warmup,
                    b,
                    -float(n),
                    float(n),
                )
                lent, margin = lent_from_upper(demand, center + m, n), f"{m:+.2f} GPUs"
            lent[:warmup] = 0  # NaN bounds lend nothing; before the warm-up nothing is scored
            rows[f"{name} (hindsight)"] = {**fluid_score(lent, demand, n, lead, warmup), "margin": margin}
        rows["oracle"] = {**oracle, "margin": "0"}
        for r in rows.values():
            r["harvest_over_oracle"] = r["harvest"] / oracle["harvest"] if oracle["harvest"] > 0 else math.nan
            r["meets_budget"] = r["shortfall_strict"] <= b + 1e-12
        out["budgets"][str(b)] = rows
    return out


# ----------------------------------------------------------------------------------------------


def run(traces: list[Path], *, serving_gpus: int = 128, step_s: float = 600.0, lead_s: float = 1200.0,
        budgets: tuple[float, ...] = (0.001, 0.005), quantiles: tuple[float, ...] = (0.95, 0.99),
        warmup_days: float = 2.0, restart_cost_s: float = 0.0, night_hours: float = 8.0,
        as_json: bool = False, console: Any = None, libraries: bool = False) -> dict[str, Any]:
    """Evaluate forecasts and loan policies on each trace; print Rich tables; return the result.

    With ``as_json`` the tables go to stderr and the result is printed as JSON on stdout. With
    ``libraries``, forecasting libraries compete too (:mod:`lab.forecast.libs`; a missing one is
    reported as "not installed").
    """
    from rich.console import Console

    def wide(stderr: bool) -> Console:
        c = Console(stderr=stderr)
        return c if c.is_terminal else Console(stderr=stderr, width=150)  # files and pipes: no wrapping

    err = wide(True)
    out_console = console or (err if as_json else wide(False))
    if not traces:
        raise ValueError(f"no trace given and none found in {DEFAULT_TRACES_DIR}")
    lead, warmup = grid_steps(lead_s, step_s, warmup_days)
    result: dict[str, Any] = {
        "config": {
            "serving_gpus": serving_gpus,
            "step_s": step_s,
            "lead_s": lead_s,
            "budgets": list(budgets),
            "quantiles": list(quantiles),
            "warmup_days": warmup_days,
            "restart_cost_s": restart_cost_s,
            "night_hours": night_hours,
            "tidal": {
                k: getattr(TidalConfig(), k)
                for k in (
                    "aim_fraction",
                    "calibration_rate_per_h",
                    "shortfall_cap_scales",
                    "initial_z",
                    "min_z",
                )
            },
            "forecast": {  # (the report's keys: the settings' names before they were grouped)
                k: attrgetter(path)(fc.ForecastConfig())
                for k, path in (
                    ("noise_exponent", "errors.noise_exponent"),
                    ("context_tod_buckets", "context.tod_buckets"),
                    ("context_level_edges", "context.level_edges"),
                    ("context_vol_edges", "context.vol_edges"),
                    ("context_quantile", "context.quantile"),
                )
            },
            "libraries": libraries,
        },
        "traces": {},
    }
    started = time.perf_counter()
    for path in traces:
        trace, times, demand = load_demand(path, serving_gpus, step_s, warmup + lead)
        gaps = int(np.isnan(demand).sum())
        err.print(f"[dim]{trace.name}: {len(demand)} steps, {gaps} gap steps[/]", highlight=False)
        libs: dict[str, Any] = {}
        if libraries:
            from lab.forecast.libs import library_forecasts

            err.print("[dim]  forecasting libraries (refit daily, applied every step)[/]", highlight=False)
            libs = library_forecasts(
                times, demand, lead=lead, warmup=warmup, quantiles=quantiles, step_s=step_s
            )
        entry = {
            "steps": len(demand),
            "gap_steps": gaps,
            "mean_demand_over_pool": float(np.nanmean(demand) / serving_gpus),
            "libraries_missing": {k: v for k, v in libs.items() if isinstance(v, str)},
            "forecast": evaluate_forecasts(
                times, demand, step_s=step_s, lead=lead, warmup=warmup, quantiles=quantiles, libraries=libs
            ),
            "harvest": evaluate_harvest(
                times,
                demand,
                n=serving_gpus,
                step_s=step_s,
                lead=lead,
                warmup=warmup,
                budgets=budgets,
                restart_cost_s=restart_cost_s,
                night_hours=night_hours,
                log=lambda s: err.print(f"[dim]{s}[/]", highlight=False),
                libraries=libs,
            ),
        }
        result["traces"][trace.name] = entry
    result["elapsed_s"] = time.perf_counter() - started
    render(result, out_console)
    if as_json:
        print(json.dumps(result, indent=2))
    return result


def render(result: dict[str, Any], console: Any) -> None:
    """Print ``result`` as two Rich tables on ``console``."""
    from rich.table import Table

    c = result["config"]
    quantiles = c["quantiles"]
    t1 = Table(title=f"forecast {c['lead_s'] / 60:g} min ahead at {c['step_s'] / 60:g}-min resolution "
                     f"(scored after {c['warmup_days']:g} warm-up days)")
    t1.add_column("trace")
    t1.add_column("method")
    for q in quantiles:
        t1.add_column(f"under-rate @{q:g} (target {1 - q:.2f})", justify="right")
        t1.add_column(f"pinball @{q:g} / mean", justify="right")
    for name, tr in result["traces"].items():
        for method, by_q in tr["forecast"]["methods"].items():
            cells = []
            for q in quantiles:
                m = by_q[str(q)]
                cells += [f"{m['under_rate']:.4f}", f"{m['pinball_over_mean']:.4f}"]
            t1.add_row(name, method, *cells)
        t1.add_section()
    console.print(t1)

    t2 = Table(title=f"fluid model: {c['serving_gpus']} serving GPUs, lead {c['lead_s'] / 60:g} min, "
                     f"restart cost {c['restart_cost_s']:g} s")
    for col in ("trace", "budget", "policy", "margin"):
        t2.add_column(col)
    for col in ("shortfall strict", "shortfall issue", "harvest", "× oracle", ""):
        t2.add_column(col, justify="right")
    for name, tr in result["traces"].items():
        for b, rows in tr["harvest"]["budgets"].items():
            for pol, r in rows.items():
                verdict = "" if pol == "oracle" else ("[green]≤ B[/]" if r["meets_budget"] else "[red]> B[/]")
                t2.add_row(
                    name,
                    b,
                    pol,
                    r["margin"],
                    f"{r['shortfall_strict']:.4f}",
                    f"{r['shortfall_issue']:.4f}",
                    f"{r['harvest']:.3f}",
                    f"{r['harvest_over_oracle']:.3f}",
                    verdict,
                )
            t2.add_section()
    console.print(t2)
    missing = {
        lib: why for tr in result["traces"].values() for lib, why in tr.get("libraries_missing", {}).items()
    }
    for lib, why in missing.items():
        console.print(f"• {lib}: {why}", highlight=False, markup=False)
    for name, tr in result["traces"].items():
        for b, rows in tr["harvest"]["budgets"].items():
            r = rows["tidal"]
            if not r["meets_budget"]:
                w = r["worst_day"]
                console.print(
                    f"• {name} at {b}: tidal's shortfall exceeds the budget; day {w['day']} alone holds "
                    f"{w['share_of_shortfall']:.0%} of it "
                    f"({w['share_of_shortfall'] * r['shortfall_strict'] / float(b):.2f}"
                    " x the budget of the whole scored period)",
                    highlight=False,
                )
    console.print(
        "tidal's margin z (in units of its forecast error scale) is calibrated online and moves; the "
        "baselines' margins were tuned with hindsight. harvest = lent / idle GPU-hours; shortfall = "
        f"unmet / demanded GPU-hours. elapsed {result['elapsed_s']:.1f} s",
        highlight=False,
    )


def main() -> None:
    """``python -m lab.forecast.study [TRACE.csv ...] [options]``."""
    import typer

    def cli(
        traces: list[Path] = typer.Argument(
            None, help="Trace CSVs (default: ../shared/traces/servegen-*.csv)."
        ),
        serving_gpus: int = typer.Option(
            128, "--serving-gpus", min=1, help="Serving pool size N (sized for the trace's peak)."
        ),
        step_s: float = typer.Option(
            600.0, "--step-s", help="Resolution in seconds (a multiple of the trace's)."
        ),
        lead_s: float = typer.Option(
            1200.0,
            "--lead-s",
            help="Lead time in seconds (notice + final checkpoint "
            "+ release + serving warm-up); a multiple of --step-s.",
        ),
        budget: list[float] = typer.Option(
            [0.001, 0.005], "--budget", help="Shortfall budget(s) (fraction of demanded GPU-hours)."
        ),
        quantile: list[float] = typer.Option(
            [0.95, 0.99], "--quantile", help="Forecast quantile(s) to score."
        ),
        warmup_days: float = typer.Option(2.0, "--warmup-days", help="Days before scoring starts."),
        restart_cost_s: float = typer.Option(
            0.0,
            "--restart-cost-s",
            help="Spot-job restart cost; sets the minimum loan window (0 = the plain fluid model).",
        ),
        night_hours: float = typer.Option(8.0, "--night-hours", help="Length of the night-window baseline."),
        json_out: bool = typer.Option(False, "--json", help="JSON on stdout (tables on stderr)."),
        libraries: bool = typer.Option(
            True,
            "--libraries/--no-libraries",
            help="Forecasting libraries as competitors (statsforecast, LightGBM: lab/requirements.txt).",
        ),
    ) -> None:
        """Serving forecast and loan policies on real traces: Tidal vs baselines."""
        run(
            list(traces) if traces else default_traces(),
            serving_gpus=serving_gpus,
            step_s=step_s,
            lead_s=lead_s,
            budgets=tuple(budget),
            quantiles=tuple(quantile),
            warmup_days=warmup_days,
            restart_cost_s=restart_cost_s,
            night_hours=night_hours,
            as_json=json_out,
            libraries=libraries,
        )

    typer.run(cli)


if __name__ == "__main__":
    main()

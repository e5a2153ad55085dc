"""``tidal sim`` and ``tidal plan`` (registered as top-level commands by :mod:`tidal.cli`).

    tidal sim --traffic T.csv --spot-backlog --serving-gpus 128 --training-gpus 64 --days 14 --json
    tidal sim --traffic T.csv --jobs J.csv --serving-gpus 128 --training-gpus 256 --policy tidal,oracle
    tidal sim --traffic T.csv --spot-backlog --serving-gpus 128 --days 14 --sweep --sweep-png sweep.png
    tidal plan T.csv --serving-gpus 128 --risk 0.005 --png plan.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.markup import escape

from tidal.policy.ckpt_interval import LLAMA3_FAILURES_PER_GPU_HOUR
from tidal.sim.config import SIM_NOTICE_S

M = TypeVar("M", bound=str)  # one of a command's named modes


def _split(text: str, allowed: tuple[M, ...], what: str) -> list[M]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise typer.BadParameter(
            f"{', '.join(bad) or '(empty)'}: expected one or more of {', '.join(allowed)}", param_hint=what
        )
    return [a for s in items for a in allowed if a == s]


def _consoles(json_out: bool) -> tuple[Any, Any]:
    from rich.console import Console

    err = Console(stderr=True)
    if not err.is_terminal:
        err = Console(stderr=True, width=200)
    out = err if json_out else (Console() if Console().is_terminal else Console(width=200))
    return out, err


def sim_command(
    traffic: Path = typer.Option(..., "--traffic", exists=True, dir_okay=False,
        help="Serving trace CSV (a time column in seconds or ISO-8601, a load column), or per client "
             "(seconds, client, requests_per_second; gzip or not)."),
    jobs: Path | None = typer.Option(None, "--jobs", exists=True, dir_okay=False,
        help="Job trace: native CSV (submit_s,tenant,kind,priority,min_gpus,max_gpus,work_gpu_s) or the "
             "ElasticFlow/Philly CSV."),
    spot_backlog: bool = typer.Option(False, "--spot-backlog",
        help="Keep the spot queue saturated with synthetic elastic jobs (see tidal.sim.jobs.SpotBacklog)."),
    serving_gpus: int = typer.Option(..., "--serving-gpus", min=1,
        help="Serving pool; it serves the trace's peak."),
    training_gpus: int = typer.Option(0, "--training-gpus", min=0, help="Dedicated training pool."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1),
    days: float | None = typer.Option(None, "--days", min=0.01,
        help="Simulated days (default: the trace's length; a shorter trace repeats)."),
    warmup_days: float = typer.Option(0.0, "--warmup-days", min=0.0, help="Metrics count from this day on."),
    policy: str = typer.Option("none,night-window,reactive,tidal,oracle", "--policy",
        help="Loan policies to compare, comma-separated."),
    shortfall_budget: float = typer.Option(0.005, "--shortfall-budget",
        help="tidal: at most this fraction of demanded serving GPU-hours unmet."),
    margin_gpus: float | None = typer.Option(None, "--margin-gpus", min=0.0,
        help="reactive and night-window: fixed margin in GPUs (default 10% of the serving pool)."),
    night_hours: float = typer.Option(8.0, "--night-hours",
        help="night-window: length of the daily window (placed on the trace's lowest-demand hours)."),
    ckpt: str = typer.Option("concurrent", "--ckpt",
        help="Checkpoint mode(s): sync, concurrent (comma-separated)."),
    resize: str = typer.Option("reshard", "--resize",
        help="Resize mode(s): reshard, restart-full (comma-separated)."),
    failure_rate: float = typer.Option(LLAMA3_FAILURES_PER_GPU_HOUR, "--failure-rate", min=0.0,
        help="Failures per GPU-hour (default Llama 3: 419 / (16,384 GPUs x 54 days))."),
    persist_s: float = typer.Option(300.0, "--persist-s",
        help="Seconds to write a checkpoint to durable storage (the sync stall)."),
    stage_s: float = typer.Option(5.0, "--stage-s",
        help="Seconds to copy state to host memory (concurrent stall)."),
    restart_s: float = typer.Option(300.0, "--restart-s",
        help="Seconds to restore and warm up after a (re)start."),
    notice_s: float = typer.Option(SIM_NOTICE_S, "--notice-s",
        help="Reclaim notice grace, seconds (the simulated fleet's, not the platform's default grace)."),
    final_ckpt_s: float = typer.Option(120.0, "--final-ckpt-s",
        help="Seconds the loan plan allows for the final checkpoint after the grace."),
    release_s: float = typer.Option(60.0, "--release-s", help="Seconds to hand GPUs back to serving."),
    warmup_s: float = typer.Option(900.0, "--serving-warmup-s",
        help="Serving warm-up on returned GPUs, seconds."),
    scaling_exponent: float = typer.Option(1.0, "--scaling-exponent",
        help="A job on g GPUs does g**x GPU-seconds of work per second (1 = linear)."),
    sched_period_s: float = typer.Option(120.0, "--sched-period-s",
        help="Scheduler cadence between grid steps."),
    step_s: float | None = typer.Option(None, "--step-s", help="Serving grid (default: the trace's step)."),
    seed: int = typer.Option(0, "--seed"),
    philly_kind: str = typer.Option("dedicated", "--philly-kind", help="Kind of ElasticFlow/Philly jobs."),
    sweep: bool = typer.Option(False, "--sweep", help="Sweep each policy's knob; plot harvest vs shortfall."),
    sweep_png: Path = typer.Option(Path("sim-sweep.png"), "--sweep-png",
        help="Where --sweep writes its plot."),
    hindsight: bool = typer.Option(False, "--hindsight",
        help="Also tune reactive and night-window margins with hindsight to the shortfall budget "
             "(bisection over runs) and compare."),
    plot: Path | None = typer.Option(None, "--plot",
        help="Write a timeline PNG (demand, forecast, lent, training)."),
    plot_start_day: float | None = typer.Option(None, "--plot-start-day",
        help="First day plotted (default: --warmup-days, where scoring starts)."),
    plot_days: float = typer.Option(2.0, "--plot-days"),
    json_out: bool = typer.Option(False, "--json", help="One JSON object on stdout (tables go to stderr)."),
) -> None:
    """Trace-driven simulation of loan policies on a shared GPU pool (the policies are tidal.policy's)."""
    from tidal.sim import report
    from tidal.sim.config import CKPT_MODES, RESIZE_MODES, make_config
    from tidal.sim.jobs import SpotBacklog, load_jobs
    from tidal.sim.policies import POLICIES, PolicySpec
    from tidal.sim.runner import Scenario, best_within, compare, headline
    from tidal.sim.runner import sweep as run_sweep
    from tidal.sim.traffic import traffic_gpus

    out, err = _consoles(json_out)

    def log(s: str) -> None:
        err.print(f"[dim]{escape(s)}[/]", highlight=False)

    names = _split(policy, POLICIES, "--policy")
    ckpts = _split(ckpt, CKPT_MODES, "--ckpt")
    resizes = _split(resize, RESIZE_MODES, "--resize")
    if not jobs and not spot_backlog:
        log("no --jobs and no --spot-backlog: nothing will train (serving metrics only)")
    try:
        demand, clients, step, trace_name = traffic_gpus(traffic, serving_gpus, step_s)
        job_list = load_jobs(jobs, philly_kind=philly_kind) if jobs else []
        if training_gpus == 0 and any(j.kind == "dedicated" for j in job_list):
            log("the job trace has dedicated jobs but --training-gpus is 0: they have no quota and never run")
        n_days = days if days is not None else len(demand) * step / 86400.0
        cfg = make_config(serving_gpus=serving_gpus, training_gpus=training_gpus, gpus_per_node=gpus_per_node,
                          days=n_days, warmup_days=warmup_days, ckpt_mode=ckpts[0], resize=resizes[0],
                          persist_s=persist_s, stage_s=stage_s, restart_s=restart_s, notice_s=notice_s,
                          final_checkpoint_s=final_ckpt_s, release_s=release_s, warmup_s=warmup_s,
                          failure_rate_per_gpu_hour=failure_rate, scaling_exponent=scaling_exponent,
                          sched_period_s=sched_period_s, seed=seed, step_s=step,
                          record_timeline=plot is not None)
        knobs = {"tidal": shortfall_budget, "reactive": margin_gpus, "night-window": margin_gpus}
        specs = [PolicySpec(n, knobs.get(n)) for n in names]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    scenario = Scenario(demand=demand, step_s=step, config=cfg, jobs=tuple(job_list), night_hours=night_hours,
                        backlog=SpotBacklog() if spot_backlog else None, name=trace_name, clients=clients)
    title = (f"{trace_name}: {serving_gpus} serving + {training_gpus} training GPUs, {n_days:g} days "
             f"(scored from day {warmup_days:g}), ckpt {','.join(ckpts)}, resize {','.join(resizes)}")
    if sweep:
        points = run_sweep(scenario, names, log=log)
        report.plot_sweep(points, sweep_png, budgets=[shortfall_budget], title=title)
        log(f"wrote {sweep_png}")
        by: dict[str, list[dict]] = {}
        for p in points:
            by.setdefault(p["policy"], []).append(p)
        rows = {f"{p['policy']} {p['knob_label']}".strip(): p for p in points}
        report.render_table(rows, out, title=f"sweep — {title}")
        for name in ("reactive", "night-window"):
            b = best_within(points, name, shortfall_budget)
            if b is not None:
                out.print(f"{name}: best sweep point within {shortfall_budget:g}: {b['knob_label']}, harvest "
                          f"{b['harvest_ratio']:.3f}, shortfall {b['shortfall_ratio']:.4f}", highlight=False)
        if json_out:
            print(json.dumps(report.clean(by), indent=2))
        return
    modes = [(c, r) for c in ckpts for r in resizes]
    results = compare(scenario, specs, modes, log=log)
    metrics = {k: v.metrics for k, v in results.items()}
    report.render_table(metrics, out, title=title)
    if hindsight:
        rows = headline(scenario, shortfall_budget, log=log)
        report.render_table(
            rows, out, title=f"at budget {shortfall_budget:g}: tidal vs baselines tuned with hindsight"
        )
        metrics.update({f"{k} @ {shortfall_budget:g}": v for k, v in rows.items() if k not in ("tidal",
                                                                                               "oracle")})
    if plot is not None:
        first = warmup_days if plot_start_day is None else plot_start_day
        report.plot_timeline({k: v.timeline for k, v in results.items()}, plot, serving_gpus=serving_gpus,
                             start_day=first, days=plot_days, title=title)
        log(f"wrote {plot} (days {first:g} to {first + plot_days:g}; scored from day {warmup_days:g})")
    if json_out:
        print(report.to_json(metrics))


def plan_command(
    traffic: Path = typer.Argument(..., exists=True, dir_okay=False,
                                   help="Serving trace CSV, in total or per client."),
    serving_gpus: int = typer.Option(..., "--serving-gpus", min=1,
        help="Serving pool; it serves the trace's peak."),
    risk: float = typer.Option(0.005, "--risk",
        help="Acceptable shortfall: fraction of the time (fixed schedule) or of demanded GPU-hours (tidal)."),
    notice_s: float = typer.Option(SIM_NOTICE_S, "--notice-s"),
    final_ckpt_s: float = typer.Option(120.0, "--final-ckpt-s"),
    release_s: float = typer.Option(60.0, "--release-s"),
    warmup_s: float = typer.Option(900.0, "--serving-warmup-s"),
    restart_s: float = typer.Option(300.0, "--restart-s"),
    step_s: float | None = typer.Option(None, "--step-s"),
    png: Path | None = typer.Option(None, "--png", help="Write the by-hour plot here."),
    json_out: bool = typer.Option(False, "--json"),
    service_rate_per_gpu: float | None = typer.Option(None, "--service-rate-per-gpu",
        help="Requests/s one GPU serves: the trace is then requests/s and demand the GPUs meeting "
             "--latency-target-s (Erlang C), not scaled."),
    service_rate_per_replica: float | None = typer.Option(None, "--service-rate-per-replica"),
    gpus_per_replica: int | None = typer.Option(None, "--gpus-per-replica"),
    latency_target_s: float | None = typer.Option(None, "--latency-target-s"),
    latency_quantile: float | None = typer.Option(None, "--latency-quantile", help="Default 0.99."),
    latency_of: str | None = typer.Option(None, "--latency-of", help="queue (default) or response."),
) -> None:
    """How much of the serving pool could train by hour of day, at a given risk; the lead time to plan for."""
    import numpy as np

    from tidal.policy.loan import LoanTiming
    from tidal.serving.cli import option_of
    from tidal.serving.requests import RequestModel
    from tidal.sim.plan import plan_report, plot_plan, render_plan
    from tidal.sim.report import clean
    from tidal.sim.traffic import request_demand_gpus, traffic_gpus

    out, err = _consoles(json_out)
    try:
        requests = RequestModel.from_settings(dict(
            service_rate_per_gpu=service_rate_per_gpu, service_rate_per_replica=service_rate_per_replica,
            gpus_per_replica=gpus_per_replica, latency_target_s=latency_target_s,
            latency_quantile=latency_quantile, latency_of=latency_of))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=option_of(str(e))) from None
    clients = None
    try:
        if requests is not None:
            demand, step, _ = request_demand_gpus(traffic, requests, step_s)
            over = np.nanmax(demand) > serving_gpus
            short = "; [red]the pool cannot meet the target at the peak[/]" if over else ""
            err.print(f"[dim]{requests.describe()}: demand {np.nanmin(demand):g}-{np.nanmax(demand):g} GPUs "
                      f"(pool {serving_gpus})[/]{short}", highlight=False)
        else:
            demand, clients, step, _ = traffic_gpus(traffic, serving_gpus, step_s)
        timing = LoanTiming(notice_s=notice_s, final_checkpoint_s=final_ckpt_s, release_s=release_s,
                            warmup_s=warmup_s, restart_cost_s=restart_s)
        rep = plan_report(demand, step, serving_gpus, risk=risk, timing=timing, clients=clients)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    render_plan(rep, out)
    if png is not None:
        plot_plan(rep, str(png))
        err.print(f"[dim]wrote {escape(str(png))}[/]", highlight=False)
    if json_out:
        print(json.dumps(clean(rep), indent=2))


app = typer.Typer(add_completion=False)
app.command("sim")(sim_command)
app.command("plan")(plan_command)

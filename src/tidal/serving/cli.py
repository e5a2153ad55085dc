"""``tidal serving watch``: the live loan plan from a replayed trace or a Prometheus query."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def _group() -> None:
    """Serving side: live demand, the loan plan, and load against a serving endpoint."""


def _clock_text(t_s: float | None, absolute: bool) -> str:
    if t_s is None:  # (a reclaim without notice)
        return "none"
    if absolute:
        return datetime.fromtimestamp(t_s, UTC).strftime("%Y-%m-%d %H:%M:%S")
    d, rem = divmod(int(t_s), 86400)
    return f"day {d} {rem // 3600:02d}:{rem % 3600 // 60:02d}"


def option_of(message: str) -> str:
    """The command-line option a settings error is about (the errors name the settings' fields)."""
    if "demand source" in message:
        return "--trace / --prometheus"
    field = re.search(r"serving\.(\w+)", message)
    if field:
        return f"--{field.group(1).replace('_', '-')}"
    for words, option in (("PrometheusQuery", "--prometheus"), ("ForecastConfig", "--step-s"),
                          ("TidalConfig", "--step-s")):
        if words in message:
            return option
    return "--trace"  # reading the trace file


@app.command("watch")
def watch_command(
    serving_gpus: Annotated[int, typer.Option("--serving-gpus", min=1, help="GPUs in the serving pool.")],
    trace: Annotated[Path | None, typer.Option("--trace", help="Replay this trace CSV (the pool serves its "
                                               "peak).", exists=True, dir_okay=False)] = None,
    speedup: Annotated[float, typer.Option("--speedup", min=1e-6, help="Replay: trace seconds per wall "
                                           "second (600: one 10-min step a second).")] = 1.0,
    prometheus: Annotated[str | None, typer.Option("--prometheus", help="Prometheus base URL, e.g. "
                                                   "http://prometheus:9090.")] = None,
    query: Annotated[str | None, typer.Option("--query", help="PromQL giving one number, e.g. "
                                              "'sum(vllm:num_requests_running)'.")] = None,
    gpus_per_unit: Annotated[float, typer.Option("--gpus-per-unit", min=1e-12, help="Prometheus: GPUs "
                                                 "serving needs per unit of the query's value.")] = 1.0,
    shortfall_budget: Annotated[float, typer.Option("--shortfall-budget", help="At most this fraction of "
                                                    "demanded serving GPU-hours unmet.")] = 0.005,
    step_s: Annotated[float, typer.Option("--step-s", min=1.0, help="Seconds between observations (the "
                                          "forecast's step).")] = 600.0,
    steps: Annotated[int | None, typer.Option("--steps", min=0, help="Stop after this many steps (default: "
                                              "run until interrupted).")] = None,
    service_rate_per_gpu: Annotated[float | None, typer.Option(
        "--service-rate-per-gpu", help="Requests/s one GPU serves: the trace or query is then a request rate "
        "and demand the GPUs meeting --latency-target-s (Erlang C).")] = None,
    service_rate_per_replica: Annotated[float | None, typer.Option(
        "--service-rate-per-replica", help="Requests/s one replica serves (instead of per GPU).")] = None,
    gpus_per_replica: Annotated[int | None, typer.Option("--gpus-per-replica", help="GPUs per serving "
                                                         "replica (default 1).")] = None,
    latency_target_s: Annotated[float | None, typer.Option("--latency-target-s", help="Seconds the latency "
                                                           "quantile must stay within.")] = None,
    latency_quantile: Annotated[float | None, typer.Option("--latency-quantile", help="Which quantile "
                                                           "(default 0.99).")] = None,
    latency_of: Annotated[str | None, typer.Option("--latency-of", help="queue (waiting for a replica, "
                                                   "default) or response (waiting + service).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per step on stdout.")] = False,
) -> None:
    """Print, every step, how many serving GPUs could be lent now and when they must be back.

    Advice only: `tidal up` with serving nodes lends them for real.
    """
    from rich.console import Console

    from tidal.serving.sources import TraceReplay
    from tidal.serving.watch import Step, WatchConfig, start_advisor, watch

    try:  # the settings are checked where tidal up's serving: block is checked
        cfg = WatchConfig(serving_gpus=serving_gpus, trace=None if trace is None else str(trace),
                          speedup=speedup, prometheus=prometheus, query=query, gpus_per_unit=gpus_per_unit,
                          shortfall_budget=shortfall_budget, step_s=step_s,
                          service_rate_per_gpu=service_rate_per_gpu,
                          service_rate_per_replica=service_rate_per_replica,
                          gpus_per_replica=gpus_per_replica, latency_target_s=latency_target_s,
                          latency_quantile=latency_quantile, latency_of=latency_of)
        adv, clock, speed = start_advisor(cfg)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint=option_of(str(e))) from None

    def sleep(s: float) -> None:
        time.sleep(max(0.0, s) / speed)

    # Unix times (Prometheus, ISO-8601 traces), else seconds from the trace's start
    absolute = not isinstance(adv.source, TraceReplay) or adv.source.start_s > 10 * 365 * 86400.0

    out = Console(soft_wrap=True)

    def report(s: Step) -> None:
        if json_out:
            print(json.dumps(s.as_dict()), flush=True)
            return
        p = s.plan
        backs = ", ".join(f"{r.gpus} by {_clock_text(r.deadline_s, absolute)} (notice "
                          f"{_clock_text(r.notice_s, absolute)})" for r in p.reclaims[:3])
        backs = backs or "none within the horizon"
        if len(p.reclaims) > 3:
            backs += f", {sum(r.gpus for r in p.reclaims[3:])} more later"
        demand = "unknown" if math.isnan(s.demand_gpus) else f"{s.demand_gpus:.1f}"
        out.print(f"{_clock_text(s.now_s, absolute)}  demand {demand} GPUs  lendable "
                  f"[bold]{p.lendable_gpus}[/] of {serving_gpus}  margin {p.margin_gpus:.1f}  back: {backs}"
                  + (f"  [red]reclaim now {p.reclaim_now_gpus}[/]" if p.reclaim_now_gpus else ""),
                  highlight=False)

    try:
        watch(adv.source, adv.policy, serving_gpus=serving_gpus, clock=clock, sleep=sleep, on_step=report,
              steps=steps)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command("load")
def load_command(
    url: Annotated[str, typer.Argument(help="The Serve application's HTTP endpoint, e.g. "
                                         "http://127.0.0.1:8000/.")],
    duration_s: Annotated[float, typer.Option("--duration-s", min=0.001, help="Seconds of load.")] = 60.0,
    rate: Annotated[float | None, typer.Option("--rate", min=0.0,
                                               help="A constant request rate (requests/s).")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Replay this trace's request rate (its load "
                                               "column, requests/s).", exists=True, dir_okay=False)] = None,
    speedup: Annotated[float, typer.Option("--speedup", min=1e-6, help="Trace seconds per second.")] = 1.0,
    scale: Annotated[float, typer.Option("--scale", min=0.0, help="Times the trace's rate.")] = 1.0,
    every_s: Annotated[float, typer.Option("--every-s", min=0.1, help="Report latency per interval of this "
                                           "many seconds.")] = 10.0,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=0.01, help="A request unanswered this long "
                                             "fails.")] = 30.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the Poisson arrivals.")] = 0,
    records: Annotated[Path | None, typer.Option(
        "--records", help="Write every request (t_s, latency_s, status, error) as JSON lines here.",
        dir_okay=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="The summary as JSON.")] = False,
) -> None:
    """Open-loop Poisson load at a constant or a trace's (scaled) request rate; p50/p99 latency per
    interval."""
    import asyncio

    from tidal.serving import loadgen

    if (rate is None) == (trace is None):
        raise typer.BadParameter("give exactly one of --rate or --trace", param_hint="--rate / --trace")
    hint = "URL"
    try:
        loadgen.check_url(url)
        if trace is not None:
            from tidal.serving.traces import load_trace

            hint = "--trace"
            fn = loadgen.trace_rate(load_trace(trace), speedup=speedup, scale=scale)
        else:
            hint = "--rate"
            fn = loadgen.constant(float(rate or 0.0))
        hint = f"{'--trace / --scale' if trace is not None else '--rate'} / --duration-s"
        if records is not None:
            with open(records, "w"):  # unwritable: said before the load, not after it
                pass
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and records is not None and getattr(e, "filename", None) == str(records):
            hint = "--records"
        raise typer.BadParameter(" ".join(str(e).split()), param_hint=hint) from None
    try:
        recs = asyncio.run(loadgen.generate(url, fn, duration_s, timeout_s=timeout_s, seed=seed))
    except ValueError as e:  # the rate x duration too large
        raise typer.BadParameter(" ".join(str(e).split()), param_hint=hint) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if records is not None:
        with open(records, "w") as f:
            f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in recs)
    parts = [loadgen.summary(recs, a, a + every_s) | {"from_s": a} for a in
             (i * every_s for i in range(math.ceil(duration_s / every_s)))]
    total = loadgen.summary(recs)
    if json_out:
        print(json.dumps({"intervals": parts, "total": total}))
    else:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{1000 * x:.1f}"
        print(f"{'from_s':>8} {'requests':>9} {'failed':>7} {'p50_ms':>8} {'p99_ms':>8}")
        for p in [*parts, total | {"from_s": "all"}]:
            print(f"{p['from_s']!s:>8} {p['requests']:>9} {p['failed']:>7} {ms(p['p50_s']):>8} "
                  f"{ms(p['p99_s']):>8}")
        for err in total["errors"]:
            print(f"error: {err}")
    if total["failed"]:
        raise typer.Exit(1)


@app.command("engine-bench")
def engine_bench_command(
    replicas: Annotated[int, typer.Option("--replicas", help="llama.cpp replicas behind the router.")] = 2,
    rate: Annotated[float, typer.Option("--rate", help="Requests/s (Poisson, open loop).")] = 4.0,
    duration_s: Annotated[float, typer.Option("--duration-s", help="Seconds of traffic per run.")] = 24.0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens each request asks for.")] = 32,
    slo_s: Annotated[float, typer.Option("--slo-s", help="p99 time-to-first-token target (s).")] = 0.5,
    model: Annotated[Path | None, typer.Option("--model", help="A GGUF model (default: a tiny random one "
                                               "written locally).", exists=True, dir_okay=False)] = None,
    pin: Annotated[bool, typer.Option("--pin/--no-pin", help="Replica i on CPU i mod N, the training rank "
                                      "on CPUs no serving replica has (a lent GPU is not a serving one); "
                                      "on where there are 2 CPUs or more.")] = True,
    train: Annotated[bool, typer.Option("--train/--no-train", help="A training rank on the lent replicas' "
                                        "CPUs while they are lent.")] = True,
    pairs: Annotated[int, typer.Option("--pairs", help="Both runs this many times in turns, each phase's "
                                       "requests pooled over them (a p99 of more requests).")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="The result as JSON.")] = False,
) -> None:
    """The same traffic against real engine replicas twice, with and without lending; TTFT per phase."""
    from tidal.serving.engine_bench import PHASES, BenchOptions, run
    from tidal.serving.engine_replicas import EngineError

    opts = BenchOptions(replicas=replicas, rate_per_s=rate, duration_s=duration_s, max_tokens=max_tokens,
                        slo_s=slo_s, model=None if model is None else str(model), pin=pin, train=train,
                        pairs=pairs)
    try:
        opts.check()
        out = run(opts)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except (EngineError, ImportError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if json_out:
        print(json.dumps(out, indent=1))
        return

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"
    print(f"{out['engine']['name']} {out['engine']['version']}: {replicas} replicas, {rate:g} requests/s")
    print(f"{'phase':<11} {'run':<9} {'requests':>8} {'failed':>6} {'ttft_p50_ms':>11} {'ttft_p99_ms':>11} "
          f"{'tokens/s':>8}")
    for p in PHASES:
        for name, key in (("lending", "with_lending"), ("without", "without_lending")):
            v = out[key]["phases"][p]
            print(f"{p:<11} {name:<9} {v['requests']:>8} {v['failed']:>6} {ms(v['ttft_p50_s']):>11} "
                  f"{ms(v['ttft_p99_s']):>11} {v['tokens_per_s'] or 0:>8}")
    w = out["with_lending"]
    print(f"replicas lent {w['lent']} (demand {w['demand']['replicas']}), ttft p99 ratio "
          f"{out['ttft_p99_ratio']}, failed by reclaim {out['requests_failed_by_reclaim']}, returns missed "
          f"{out['returns_missed']}, GPU-hours lent {out['loaned_gpu_hours']}")
    if "pairs" in out:
        print(f"{opts.pairs} pairs pooled; lent-phase ttft p99 ratio of each pair: "
              f"{[p['ttft_p99_ratio_by_phase'].get('lent') for p in out['pairs']]}")
    c = w["cpus"]
    print(f"CPUs: replicas {c['replicas'] or 'any'}, training rank {c['training'] or 'any'} "
          f"({c['trained_s']} s trained)")

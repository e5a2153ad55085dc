"""``tidal serving watch``: the live loan plan from a replayed trace or a Prometheus query."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def _group() -> None:
    """Serving side: live demand and the loan plan."""


def _clock_text(t_s: float, absolute: bool) -> str:
    if absolute:
        return datetime.fromtimestamp(t_s, UTC).strftime("%Y-%m-%d %H:%M:%S")
    d, rem = divmod(int(t_s), 86400)
    return f"day {d} {rem // 3600:02d}:{rem % 3600 // 60:02d}"


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
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per step on stdout.")] = False,
) -> None:
    """Print, every step, how many serving GPUs could be lent now and when they must be back.

    Advice only: Tidal's live control plane does not yet place spot jobs on serving GPUs.
    """
    from rich.console import Console

    from tidal.policy.forecast import ForecastConfig
    from tidal.policy.loan import TidalConfig, TidalPolicy
    from tidal.serving.sources import PrometheusQuery, TraceReplay
    from tidal.serving.traces import load_trace
    from tidal.serving.watch import Step, watch

    if (trace is None) == (prometheus is None):
        raise typer.BadParameter("give exactly one demand source: --trace FILE or --prometheus URL --query Q",
                                 param_hint="--trace / --prometheus")
    if prometheus is not None and not query:
        raise typer.BadParameter("--prometheus needs --query (PromQL giving one number)", param_hint="--query")
    if not 0 < shortfall_budget < 1:
        raise typer.BadParameter(f"must be in (0, 1), got {shortfall_budget}", param_hint="--shortfall-budget")
    try:
        cfg = TidalConfig(shortfall_budget=shortfall_budget, forecast=ForecastConfig(step_s=step_s))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--step-s") from None
    if trace is not None:
        try:
            tr = load_trace(trace)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--trace") from None
        t0, w0 = float(tr.times_s[0]), time.monotonic()
        source = TraceReplay(tr, serving_gpus, start_s=t0)

        def clock() -> float:
            return t0 + (time.monotonic() - w0) * speedup

        def sleep(s: float) -> None:
            time.sleep(max(0.0, s) / speedup)

        absolute = t0 > 10 * 365 * 86400.0  # Unix times (ISO-8601 traces), else seconds from the start
    else:
        try:
            source = PrometheusQuery(prometheus, query or "", gpus_per_unit)  # type: ignore[arg-type]
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--prometheus") from None
        clock, sleep, absolute = time.time, time.sleep, True

    out = Console(soft_wrap=True)

    def report(s: Step) -> None:
        if json_out:
            print(json.dumps(s.as_dict()), flush=True)
            return
        p = s.plan
        backs = ", ".join(f"{r.gpus} by {_clock_text(r.deadline_s, absolute)} (notice "
                          f"{_clock_text(r.notice_s, absolute)})" for r in p.reclaims[:3]) or "none within the horizon"
        if len(p.reclaims) > 3:
            backs += f", {sum(r.gpus for r in p.reclaims[3:])} more later"
        demand = "unknown" if math.isnan(s.demand_gpus) else f"{s.demand_gpus:.1f}"
        out.print(f"{_clock_text(s.now_s, absolute)}  demand {demand} GPUs  lendable [bold]{p.lendable_gpus}[/] of "
                  f"{serving_gpus}  margin {p.margin_gpus:.1f}  back: {backs}"
                  + (f"  [red]reclaim now {p.reclaim_now_gpus}[/]" if p.reclaim_now_gpus else ""), highlight=False)

    try:
        watch(source, TidalPolicy(cfg), serving_gpus=serving_gpus, clock=clock, sleep=sleep, on_step=report,
              steps=steps)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None

"""The ``tidal demo cycle`` command; with ``--engine llama.cpp`` a replica of a real engine on each
serving node follows the plane's loans under the day's traffic, and the same traffic then runs without
lending (docs/loaning.md, "A real engine on the serving side")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tidal.demo.cycle import DAY, PROFILE, CycleOptions, print_summary, run_cycle
from tidal.demo.plane import DemoError
from tidal.demo.serve_traffic import Traffic
from tidal.serving.adapters import parse_nodes
from tidal.serving.engine_bench import MIN_REQUESTS, compare, phase_stats, request_body
from tidal.serving.engine_replicas import EngineError, EngineReplicas, engine_version, llama_server

MAX_TOKENS = 32
ENGINE_PEAK_RATE_PER_S = 6.0  # requests/s at the profile's peak (four one-thread replicas)
STATES = ("serving", "lent", "reclaiming")


class EngineSide:
    """The engine replicas, one per serving node, following the plane's loans (:meth:`sync`, each poll)."""

    def __init__(self, model: Path, workdir: Path, nodes: list[str],
                 rate: Callable[[float], Callable[[float], float]], duration_s: float) -> None:
        """``rate(serving_s)``: requests/s at traffic second t when the traffic starts at serving time
        ``serving_s``; ``duration_s``: how long it runs."""
        self.nodes, self.rate, self.duration_s = nodes, rate, duration_s
        self.r = EngineReplicas(model, workdir, len(nodes)).start()
        self.timeline: list[tuple[float, str]] = []  # (traffic seconds, state from then on)
        self.traffic: Traffic | None = None

    def start_traffic(self, serving_s: float, duration_s: float) -> Traffic:
        t = Traffic(f"{self.r.url}/v1/completions", self.rate(serving_s), duration_s,
                    body=lambda i: request_body(i, MAX_TOKENS), stream=True)
        t.start()
        return t

    def sync(self, s: dict, jobs: list[dict], events: list[dict]) -> None:
        if s.get("serving_time_s") is None:
            return
        if self.traffic is None:
            self.traffic = self.start_traffic(s["serving_time_s"], self.duration_s)
        lent = {ln["node"] for ln in s.get("loans", ()) if ln.get("gpus")}
        for i, node in enumerate(self.nodes):
            rep = self.r.replicas[i]
            try:
                if node in lent and rep.routed and len(self.r.routed()) > 1:
                    self.r.lend(i)
                elif node not in lent and not rep.routed:
                    self.r.take_back(i)
            except EngineError:  # an event of the replicas; tried again at the next poll
                pass
        self.r.check()
        now = s.get("now_s") or time.time()
        noticed = any(r.get("notice_s") is None or r["notice_s"] <= now for r in s.get("reclaims") or ())
        state = ("reclaiming" if noticed and lent else "lent" if len(self.r.routed()) < len(self.nodes)
                 else "serving")
        if not self.timeline or self.timeline[-1][1] != state:
            self.timeline.append((self.traffic.at(time.time()), state))

    def spans(self, end_s: float) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {k: [] for k in STATES}
        for (t, state), nxt in zip(self.timeline, [*self.timeline[1:], (end_s, "")], strict=True):
            out[state].append((t, nxt[0]))
        return out


def run_with_engine(opts: CycleOptions, engine: str, console: Console, *, keep: bool = False
                    ) -> dict[str, Any]:
    """The day with the engine serving, then its traffic without lending; the cycle's summary with an
    ``engine`` part (the JSON fields of ``tidal serving engine-bench``)."""
    import tempfile

    from tidal.serving.tiny_gguf import write_tiny_gguf

    if engine != "llama.cpp":
        raise DemoError(f"--engine {engine!r}: expected llama.cpp (vLLM and SGLang need a GPU)")
    nodes = sorted(parse_nodes(opts.serving_nodes))
    with tempfile.TemporaryDirectory(prefix="tidal-engine-cycle-") as tmp:
        try:
            model = write_tiny_gguf(Path(tmp) / "tiny.gguf")
            side = EngineSide(model, Path(tmp) / "lending", nodes,
                              lambda at: profile_rate(at, opts.speedup, ENGINE_PEAK_RATE_PER_S), opts.wall_s)
        except (EngineError, ImportError) as e:
            raise DemoError(str(e)) from None
        console.print(f"[bold cyan]cycle[/bold cyan] {len(nodes)} llama.cpp replicas behind nginx at "
                      f"{side.r.url}, one per serving node, traffic following the day",
                      highlight=False)
        try:
            out = run_cycle(opts, console, keep=keep, on_poll=side.sync)
        finally:
            if side.traffic is not None:
                side.traffic.stop(30.0)
            side.r.stop()
        if side.traffic is None:
            raise DemoError("the plane reported no serving time: no traffic was sent")
        end_s = min(side.traffic.at(time.time()), side.traffic.duration_s)  # (it ran its duration)
        console.print("[dim]the same traffic again, every replica serving, no lending...[/dim]")
        with EngineReplicas(model, Path(tmp) / "baseline", len(nodes)) as base:
            again = Traffic(f"{base.url}/v1/completions", side.traffic.rate, max(end_s, 0.1),
                            body=lambda i: request_body(i, MAX_TOKENS), stream=True)
            again.start()
            time.sleep(end_s)  # every arrival sent (the run ends by itself), then its answers awaited
            again.stop(60.0)
            base_events = base.events
    spans = side.spans(end_s)
    with_ = {k: phase_stats(side.traffic.records, v) for k, v in spans.items()}
    without = {k: phase_stats(again.records, v) for k, v in spans.items()}
    live = out["live"]
    eng = {"engine": {"name": engine, "version": engine_version(llama_server())}, "replicas": len(nodes),
           **compare(with_, without, ("lent", "reclaiming")), "reclaim_notices": live["reclaim_notices"],
           "returns_missed": live["returns_missed"], "loaned_gpu_hours": live["loaned_gpu_hours"],
           "states": {k: {"with_lending": with_[k], "without": without[k]} for k in STATES},
           "events": side.r.events[-50:], "baseline_events": base_events[-20:],
           "traffic_errors": [x for x in (side.traffic.error, again.error) if x]}
    out["engine"] = eng
    out["ok"] = bool(out["ok"] and eng["requests_failed_by_reclaim"] == 0 and not eng["traffic_errors"])
    return out


def print_engine(console: Console, eng: dict[str, Any]) -> None:
    t = Table(title=f"{eng['engine']['name']} ({eng['engine']['version']}), {eng['replicas']} replicas: "
                    "TTFT by the plane's state, the same traffic with and without lending")
    for c in ("state", "run", "seconds", "requests", "failed", "ttft p50", "ttft p99", "tokens/s"):
        t.add_column(c, justify="left" if c in ("state", "run") else "right")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f} ms"
    for k, v in eng["states"].items():
        for run, st in v.items():
            t.add_row(k, run, f"{st['seconds']:.0f}", str(st["requests"]), str(st["failed"]),
                      ms(st["ttft_p50_s"]), ms(st["ttft_p99_s"]), str(st["tokens_per_s"] or 0))
    console.print(t)
    r = eng["ttft_p99_ratio"]
    console.print(f"TTFT p99 with / without lending (worst of lent and reclaiming, >= {MIN_REQUESTS} "
                  f"requests): {'-' if r is None else f'{r:.2f}'}; requests failed by "
                  f"reclaims {eng['requests_failed_by_reclaim']}", highlight=False)


def profile_rate(serving_s: float, speedup: float, peak_per_s: float) -> Callable[[float], float]:
    """Requests/s at traffic second t: the shipped profile (``peak_per_s`` at its peak) at serving time
    ``serving_s + t x speedup``, day after day."""
    from tidal.serving.traces import load_trace

    tr = load_trace(PROFILE)
    load, peak, step = tr.load, tr.peak_load, tr.step_s
    return lambda t: float(load[min(int((serving_s + t * speedup) % DAY // step), len(load) - 1)]) / peak * \
        peak_per_s


def cycle(
    speedup: Annotated[float, typer.Option(help="serving seconds per second")] = 240.0,
    hours: Annotated[float, typer.Option(help="hours of serving time to replay")] = 24.0,
    start_hour: Annotated[float, typer.Option(help="serving time of day to start at")] = 18.0,
    jobs: Annotated[int, typer.Option(help="elastic spot jobs")] = 2,
    max_ranks: Annotated[int, typer.Option(help="largest size of each job")] = 3,
    serving_nodes: Annotated[str, typer.Option(help="virtual serving nodes, NxG")] = "8x2",
    trace: Annotated[str | None,
                     typer.Option(help="a serving trace CSV instead of the shipped profile")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="keep the state dir")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="the summary as JSON on stdout")] = False,
    engine: Annotated[str | None, typer.Option(help="a real engine serving traffic on the serving nodes "
                                               "(llama.cpp: a replica per node; default 4x2 nodes)")] = None,
) -> None:
    """A day of live lending: spot jobs grow onto lent serving GPUs at night and give them back in time."""
    import json

    console = Console(stderr=json_out)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine is not None and serving_nodes == "8x2":
        serving_nodes = "4x2"  # one replica per node: four on two cores beside the training
    opts = CycleOptions(speedup=speedup, hours=hours, start_hour=start_hour, jobs=jobs, max_ranks=max_ranks,
                        serving_nodes=serving_nodes, trace=trace)
    try:
        if engine is not None:
            out = run_with_engine(opts, engine, console, keep=keep)
        else:
            out = run_cycle(opts, console, keep=keep)
    except DemoError as e:
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    if json_out:
        print(json.dumps(out, indent=1))
    else:
        print_summary(console, out)
        if "engine" in out:
            print_engine(console, out["engine"])
    raise typer.Exit(0 if out["ok"] else 1)

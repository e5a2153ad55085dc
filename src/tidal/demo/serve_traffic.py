"""The serving side of ``tidal demo ray --cycle --serve``: Ray Serve replicas of a toy model serving
open-loop traffic that follows the day's request-rate trace (docs/control.md, the Ray executor)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tidal.demo.cycle import DAY, PROFILE, CycleOptions
from tidal.serving import loadgen
from tidal.serving.watch import WatchConfig

APP = "tidal-demo"
DEPLOYMENT = "tidal.serving.ray_serve_app:sleep_model"
SERVICE_S = 1.0  # the toy model's service time per request (one at a time per replica: an LLM-like second)
LATENCY_TARGET_S = 2.5  # the SLO: p99 of the wait for a replica
GPUS_PER_REPLICA = 2  # four replicas per 8-GPU serving node (eight worker processes in all)
PEAK_RATE_PER_S = 5.2  # requests/s at the peak: 7-8 replicas by day, 6 at night (2 busy cores)
NIGHT_DEPTH = 3.0  # load' = 1 - 3 (1 - load): GPUs to lend from about 00:00 to 10:00 (see below)
NIGHT_FLOOR = 0.2  # ... and never under a fifth of the peak
RATE_WINDOW_S = 10.0  # the router's window (real seconds; half an hour of serving time at 180x)
RATE_SMOOTHING_S = RATE_WINDOW_S  # the adapter's EWMA of the window's rate and service time over its steps


def write_rate_trace(opts: CycleOptions, path: Path, peak_rate_per_s: float = PEAK_RATE_PER_S) -> Path:
    """The profile as requests/s over the history days and the live day, its night deepened (the shipped
    one dips to 0.64 of its peak: too little to lend for long enough; deepened, 6-8 of 16 GPUs from 02:00)."""
    raw = np.loadtxt(opts.trace or PROFILE, delimiter=",", skiprows=1, ndmin=2)
    t, load = raw[:, 0] - raw[0, 0], raw[:, 1] / raw[:, 1].max()
    load = np.maximum(NIGHT_FLOOR, 1.0 - NIGHT_DEPTH * (1.0 - load))
    days = int(math.ceil((opts.start_s + opts.hours * 3600.0) / DAY)) + 1
    rows = ["seconds,requests_per_second"]
    for d in range(days):
        rows += [f"{d * DAY + x:g},{peak_rate_per_s * y:.4f}" for x, y in zip(t, load, strict=True)]
    path.write_text("\n".join(rows) + "\n")
    return path


def serving_config(opts: CycleOptions, rate_trace: Path, port: int) -> WatchConfig:
    """The plane's ``serving:`` block for the Serve variant of the day (the replay variant's timing)."""
    return dataclasses.replace(
        opts.serving(), adapter="ray-serve", app=APP, deployment=DEPLOYMENT, trace=str(rate_trace),
        init_kwargs={"service_s": SERVICE_S}, gpus_per_replica=GPUS_PER_REPLICA, http_port=port,
        latency_target_s=LATENCY_TARGET_S, service_rate_per_replica=1.0 / SERVICE_S,
        rate_window_s=RATE_WINDOW_S, rate_smoothing_s=RATE_SMOOTHING_S)


def deploy(cfg: WatchConfig, timeout_s: float = 240.0) -> float:
    """Deploy the application (Ray connected already) and wait until every replica is healthy; seconds
    taken. ``DemoError`` when it is not up in time."""
    from tidal.demo.plane import DemoError
    from tidal.serving.ray_serve import RayServeAdapter, RayServeSettings

    t0 = time.monotonic()
    ad = RayServeAdapter(RayServeSettings.from_config(cfg))
    while time.monotonic() - t0 < timeout_s:
        try:
            ad.ensure()
            if all(ad.ready(n) for n in ad.nodes()):
                return time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 (Serve starting: asked again)
            ad.last_error = str(e)
        time.sleep(1.0)
    raise DemoError(f"the Serve application was not healthy after {timeout_s:g} s: {ad.last_error}")


def trace_rate(rate_trace: Path, start_serving_s: float, speedup: float) -> Any:
    """requests/s at second t: the trace's rate from serving time ``start_serving_s`` at ``speedup``."""
    from tidal.serving.traces import load_trace

    return loadgen.trace_rate(load_trace(rate_trace), speedup=speedup, start_s=start_serving_s)


class Traffic:
    """Open-loop load at ``rate(t)`` requests/s against ``url`` for at most ``duration_s`` (a thread;
    :meth:`stop`)."""

    def __init__(self, url: str, rate: Any, duration_s: float, **kw: Any) -> None:
        self.rate, self.kw = rate, kw  # kw: more of loadgen.generate's options (body, stream, max_rate)
        self.url, self.duration_s = url, duration_s
        self.records: list[loadgen.Record] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self.t0_unix = 0.0
        self._thread = threading.Thread(target=self._run, name="tidal-demo-traffic", daemon=True)

    def start(self) -> None:
        self.t0_unix = time.time()
        self._perf0 = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        try:
            self.records = asyncio.run(loadgen.generate(
                self.url, self.rate, self.duration_s, start=self._perf0, stop=self._stop.is_set,
                timeout_s=30.0, seed=7, **self.kw))
        except Exception as e:  # noqa: BLE001 (said in the summary)
            self.error = f"{type(e).__name__}: {e}"

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def at(self, unix_s: float) -> float:
        """Seconds since the traffic started, for a plane time (an event's ``time_s``)."""
        return unix_s - self.t0_unix

    def phases(self, reclaim_s: float | None, ready_s: float | None) -> dict[str, Any]:
        """Latency and failures before the first reclaim notice, from it until serving was ready again after
        the last return (``ready_s``; the end without one), and after (traffic seconds)."""
        cols = ("requests", "failed", "p50_s", "p99_s", "max_s", "errors")
        r = self.records
        cut = [0.0, math.inf, math.inf] if reclaim_s is None else [
            0.0, reclaim_s, ready_s if ready_s is not None and ready_s > reclaim_s else math.inf]
        out = {name: loadgen.summary(r, lo, hi) for name, lo, hi in (
            ("before", cut[0], cut[1]), ("during", cut[1], cut[2]), ("after", cut[2], math.inf))}
        out = {k: {c: v[c] for c in cols} for k, v in out.items()}
        whole = loadgen.summary(r)
        out["total"] = {c: whole[c] for c in (*cols, "late_max_s")}
        return out

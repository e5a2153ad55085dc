"""``serving: {adapter: llama.cpp}``: the plane lends the GPUs of a real engine's replicas (docs/loaning.md,
"A real engine under tidal up").

One llama-server replica per serving GPU behind the nginx router (:class:`EngineReplicas`), owned by one
worker thread: it carries out the plane's releases and restores in order (a
:class:`~tidal.serving.adapters.QueuedAdapter`: drain, stop; start, health, route), restarts a replica
that died, and every :data:`SAMPLE_S` reads each replica's ``/metrics`` and the router's request log into
a snapshot the loop reads (swapped whole: the loop never waits on an engine). Demand is the replicas a
p``latency_quantile`` wait-for-a-slot target needs at the request rate and service time of the last
``rate_window_s`` (:func:`~tidal.serving.engines.replicas_needed`); the warm-up a reclaim's lead time
assumes is the p95 of the replicas' recent start-to-healthy times (:meth:`EngineAdapter.warmup_s`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tidal.exec import procs
from tidal.files import private_dirs, write_atomic
from tidal.serving.adapters import ActionDone, ActionQueue, parse_nodes
from tidal.serving.engine_replicas import EngineError, EngineReplicas
from tidal.serving.engines import replicas_needed
from tidal.serving.requests import number_in
from tidal.serving.serve_history import history_grid
from tidal.serving.sources import TraceReplay

log = logging.getLogger(__name__)

ADAPTER = "llama.cpp"
SAMPLE_S = 0.5  # the worker reads the replicas' metrics this often (seconds)
RETRY_START_S = 5.0  # replicas that would not start are tried again this long after
ENGINE_FIELDS = ("model", "slots", "threads", "context", "drain_timeout_s")  # serving.engine


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The ``serving:`` block's fields for ``adapter: llama.cpp`` (``engine:`` holds the engine's own)."""

    model: str
    nodes: dict[str, int]
    latency_target_s: float
    latency_quantile: float = 0.99
    slots: int = 2
    threads: int = 1
    context: int = 4096
    drain_timeout_s: float = 10.0
    rate_window_s: float = 10.0
    min_replicas: float = 0.5  # demand never below this many replicas' worth (> 0: one always serves)
    speedup: float = 1.0
    start_s: float | None = None

    def __post_init__(self) -> None:
        n = sum(self.nodes.values())
        for name, ok, what in (
                ("engine.slots", number_in(self.slots, 1, 256, whole=True), "a whole number in [1, 256]"),
                ("engine.threads", number_in(self.threads, 1, 256, whole=True), "a whole number in [1, 256]"),
                ("engine.context", number_in(self.context, 64, 1 << 20, whole=True), "tokens >= 64"),
                ("engine.drain_timeout_s", number_in(self.drain_timeout_s, 0, 600), "seconds in [0, 600]"),
                ("latency_target_s", number_in(self.latency_target_s, 0) and self.latency_target_s > 0,
                 "seconds > 0 (the p99 wait for a slot, the TTFT target)"),
                ("latency_quantile", number_in(self.latency_quantile, 0, 1) and 0 < self.latency_quantile < 1,
                 "in (0, 1)"),
                ("rate_window_s", number_in(self.rate_window_s, 1, 3600), "seconds in [1, 3600]"),
                ("min_replicas", number_in(self.min_replicas, 0, n) and self.min_replicas > 0,
                 f"a number of replicas in (0, {n}]"),
                ("speedup", number_in(self.speedup, 0, 1e6) and self.speedup > 0, "a number > 0"),
                ("start_s", self.start_s is None or number_in(self.start_s), "seconds on the serving clock")):
            if not ok:
                raise ValueError(f"serving.{name} must be {what}, got {getattr(self, name.split('.')[-1])!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"serving.engine.model must name a GGUF file, got {self.model!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> EngineSettings:
        """From a :class:`~tidal.serving.watch.WatchConfig` (``ValueError`` naming the field)."""
        eng = cfg.engine if cfg.engine is not None else {}
        if not isinstance(eng, dict):
            raise ValueError(f"serving.engine must be a mapping ({', '.join(ENGINE_FIELDS)}), got {eng!r}")
        unknown = sorted(set(eng) - set(ENGINE_FIELDS))
        if unknown:
            raise ValueError(f"serving.engine: unknown field {unknown[0]!r} (expected one of "
                             f"{sorted(ENGINE_FIELDS)})")
        if "model" not in eng:
            raise ValueError("serving.engine.model is required with adapter llama.cpp (a GGUF file)")
        if cfg.nodes is None or cfg.latency_target_s is None:
            raise ValueError("serving.nodes and serving.latency_target_s are required with adapter llama.cpp")
        kw = {k: getattr(cfg, k) for k in ("latency_quantile", "rate_window_s", "min_replicas", "start_s")
              if getattr(cfg, k) is not None}
        return cls(nodes=parse_nodes(cfg.nodes), latency_target_s=cfg.latency_target_s, speedup=cfg.speedup,
                   **kw, **eng)


class EngineAdapter(ActionQueue):
    """Lends the GPUs of llama.cpp replicas, one a GPU, in ``workdir`` (module docstring). ``history``: a
    replay of earlier days (scaled to the pool) for :meth:`forecast_history`. Nothing starts before the
    first loan step; :meth:`close` stops the worker and every process it started."""

    def __init__(self, settings: EngineSettings, workdir: str | Path, *, history: TraceReplay | None = None,
                 history_days: float = 0.0) -> None:
        self.s, self.workdir = settings, Path(workdir)
        self.speedup = float(settings.speedup)
        self.origin_s: float | None = None  # control-plane time of serving time start_s
        self.history, self.history_days = history, history_days
        self._init_actions(settings.nodes)
        names = [n for n, g in self._nodes.items() for _ in range(g)]
        self.index = {n: [i for i, m in enumerate(names) if m == n] for n in self._nodes}  # replicas a node
        self.view: dict[str, Any] = {}  # the worker's newest snapshot (swapped whole)
        self._stop = threading.Event()
        self._warming = 0  # replicas the worker is starting now

    def nodes(self) -> dict[str, int]:
        return dict(self._nodes)

    def serving_time(self, now_s: float) -> float:
        """``now_s`` unless ``speedup``/``start_s`` run a demo's day from ``start_s`` at the first call. The
        replicas start at the first call (the plane's first loan step)."""
        self._ensure()
        if self.speedup == 1.0 and self.s.start_s is None:
            return now_s
        origin = self.origin_s = now_s if self.origin_s is None else self.origin_s
        return (self.s.start_s if self.s.start_s is not None else origin) + (now_s - origin) * self.speedup

    def _ensure(self) -> None:
        if (self._worker is None or not self._worker.is_alive()) and not self._stop.is_set():
            self._worker = threading.Thread(target=self._run, daemon=True, name="tidal-engine")
            self._worker.start()

    def demand_gpus(self, now_s: float) -> float:
        """The replicas (one GPU each) the target needs, from the newest snapshot; NaN when unknown or
        older than two windows."""
        self._ensure()
        v = self.view
        need = v.get("replicas_needed")
        if need is None or time.time() - v.get("sampled_s", 0.0) > 2 * self.s.rate_window_s:
            return math.nan
        return float(need)

    def warmup_s(self) -> float | None:
        """p95 of the replicas' recent start-to-healthy times (seconds; None before any start)."""
        return self.view.get("warmup_s")

    def ready(self, node: str) -> bool:
        """Every replica ``node`` should run is routed (healthy) and no action is in flight."""
        routed = (self.view.get("routed") or {}).get(node, 0)
        return self.queued == 0 and routed >= self._nodes[node] - self.state.released[node]

    def forecast_history(self, until_s: float, step_s: float) -> list[tuple[float, float]]:
        """The replay of earlier days (``serving.trace``, ``history_days``) on the grid before ``until_s``."""
        if self.history is None or not self.history_days:
            return []
        pts = [(t, self.history.demand_gpus(t)) for t in history_grid(until_s, self.history_days * 86400.0,
                                                                      step_s)]
        return [(t, y) for t, y in pts if t >= self.history.start_s]

    def health(self) -> dict[str, Any]:
        return {"kind": ADAPTER, "released": dict(self.state.released), "queued": self.queued,
                "failures": self.failures, "last_error": self.last_error or self.view.get("error"),
                "engine": {k: v for k, v in self.view.items() if k != "error"}}

    def persist(self) -> dict[str, Any]:
        return {"released": dict(self.state.released), "origin_s": self.origin_s}

    def resume(self, doc: Mapping[str, Any]) -> None:
        if doc.get("origin_s") is not None:
            self.origin_s = float(doc["origin_s"])
        self.state.resume(doc)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker; it stops every replica and the router."""
        self._stop.set()
        self._todo.put(None)
        if self._worker is not None:
            self._worker.join(timeout_s)

    # the worker thread: it alone touches the replicas

    def _left_behind(self, pids: list[int] | None) -> None:
        """Record the engine's processes (``pids``; None: stop those a killed plane left, then forget them)
        in ``pids.json``, by pid and start time: a plane killed with SIGKILL cannot stop them itself."""
        path = self.workdir / "pids.json"
        if pids is not None:
            write_atomic(path, json.dumps([[p, procs.start_time(p)] for p in pids]))
            return
        try:
            left = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        for pid, started in left if isinstance(left, list) else ():
            if isinstance(pid, int) and pid > 1 and procs.alive(pid, started):
                log.warning("stopping the engine process %d a previous plane left running", pid)
                procs.kill_group(pid)
        path.unlink(missing_ok=True)

    def _run(self) -> None:
        r: EngineReplicas | None = None
        private_dirs(self.workdir)
        self._left_behind(None)
        try:
            while r is None and not self._stop.is_set():
                try:
                    r = EngineReplicas(self.s.model, self.workdir, sum(self._nodes.values()),
                                       slots=self.s.slots, threads=self.s.threads, context=self.s.context,
                                       drain_timeout_s=self.s.drain_timeout_s).start()
                except (EngineError, OSError, ValueError) as e:
                    why = f"the engine did not start: {e}"
                    self.view = {**self.view, "error": why}
                    while not self._todo.empty():  # nothing to act on: each action fails, saying why
                        act = self._todo.get()
                        if act is not None:
                            self._done.put(dataclasses.replace(act, error=why))
                    self._stop.wait(RETRY_START_S)
            if r is None:
                return
            for node, lent in dict(self.state.released).items():  # a resumed plane's loans
                if lent:
                    self._carry_out(r, ActionDone("release", node, lent, lent))
            self._serve(r)
        finally:
            if r is not None:
                r.stop()
                self._left_behind([])

    def _serve(self, r: EngineReplicas) -> None:
        samples: collections.deque[tuple[float, dict]] = collections.deque()  # (time, each replica's scrape)
        answered: collections.deque[tuple[float, int, float | None]] = collections.deque()
        seen = {"requests_failed": 0, "requests": 0}
        written: list[int] = []
        next_sample = 0.0
        while not self._stop.is_set():
            try:
                act = self._todo.get(timeout=max(0.0, next_sample - time.monotonic()))
            except queue.Empty:
                act = None
            if act is not None:
                self._done.put(dataclasses.replace(act, error=self._carry_out(r, act)))
            if time.monotonic() < next_sample or self._stop.is_set():
                continue
            next_sample = time.monotonic() + SAMPLE_S
            try:
                r.check()
                now = time.time()
                samples.append((now, r.scrape()))
                for rec in r.answered():
                    answered.append(rec)
                    seen["requests"] += 1
                    seen["requests_failed"] += rec[1] >= 500
                while len(samples) > 2 and samples[1][0] <= now - self.s.rate_window_s:
                    samples.popleft()
                while answered and answered[0][0] < now - self.s.rate_window_s:
                    answered.popleft()
                snap = self._snapshot(r, samples, answered, seen)
                if snap["pids"] != written:  # recorded before the loop can see them
                    self._left_behind(written := snap["pids"])
                self.view = snap
            except Exception:  # one failed sample (a full disk, a router restarting): the next one
                log.exception("reading the engine's replicas failed")

    def _snapshot(self, r: EngineReplicas, samples: collections.deque, answered: collections.deque,
                  seen: dict[str, int]) -> dict[str, Any]:
        """Demand over the window (requests: those the router logged as answered in it) and the figures."""
        (t0, s0), (t1, s1) = samples[0], samples[-1]
        common = sorted(set(s0) & set(s1))
        need: float | None = None
        demand = None
        if t1 - t0 >= 0.5 * self.s.rate_window_s:
            done = sum(t0 < t <= t1 for t, _, _ in answered)
            try:
                demand = replicas_needed([s0[i] for i in common], [s1[i] for i in common], t1 - t0,
                                         slo_s=self.s.latency_target_s, slots=self.s.slots,
                                         quantile=self.s.latency_quantile, router_requests=done)
                if not math.isnan(demand.replicas):  # slots needed in replicas (fractional: the plan rounds)
                    need = max(self.s.min_replicas, (demand.servers or 0.0) / self.s.slots)
            except ValueError:  # no number of replicas meets the target at this rate: all of them
                need = float(len(r.replicas))
        ttft = np.array([h for _, st, h in answered if h is not None and st < 400], dtype=float)
        q = (lambda p: round(float(np.quantile(ttft, p)), 4)) if len(ttft) else (lambda p: None)
        return {
            "url": r.url, "replicas": len(r.replicas), "routed": {n: sum(r.replicas[i].routed for i in idx)
                                                                  for n, idx in self.index.items()},
            "warming": self._warming, "running": sum(s.running for s in s1.values()),
            "waiting": sum(s.waiting for s in s1.values()), "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99),
            "replicas_needed": None if need is None else round(min(need, float(len(r.replicas))), 3),
            "rate_per_s": None if demand is None else round(demand.rate_per_s, 3),
            "service_s": None if demand is None or demand.service_s is None else round(demand.service_s, 4),
            "tokens_per_s": None if demand is None else round(demand.tokens_per_s, 1),
            "warmup_s": r.warmup_s(), "window_s": round(t1 - t0, 2), **seen,
            "events": r.events[-10:], "pids": r.pids(), "sampled_s": t1}

    def _carry_out(self, r: EngineReplicas, act: ActionDone) -> str | None:
        """Route ``cap - lent_after`` of the node's replicas: lend the last routed ones, take back the first
        unrouted ones; None, or why it failed (the replicas' events say more)."""
        idx = self.index[act.node]
        want = len(idx) - act.lent_after
        routed = [i for i in idx if r.replicas[i].routed]
        try:
            while len(routed) > want:
                r.lend(routed.pop())
            for i in [i for i in idx if not r.replicas[i].routed][: max(0, want - len(routed))]:
                self._warming += 1
                try:
                    r.take_back(i)
                finally:
                    self._warming -= 1
        except EngineError as e:
            return f"{act.action} of {act.gpus} GPUs on {act.node}: {e}"
        return None

"""Serving adapters: how the control plane lends a serving system's GPUs and takes them back.

A :class:`ServingAdapter` answers for one serving system: its nodes and GPUs, the GPUs it needs now,
and two actions: *release* GPUs of a node for lending (fewer replicas there) and *restore* them. The
control plane (:mod:`tidal.control.loans`) decides when; an adapter decides nothing. Every action
names the node, the GPUs moved and the node's resulting lent GPUs (``lent_after``), so an operator's
hook can act idempotently. A failed *release* lends nothing; a failed *restore* leaves the GPUs in
neither pool and is retried every step: no GPU is ever counted both as serving and as lent. Times are
the control plane's (Unix seconds); :meth:`ServingAdapter.serving_time` maps them onto the serving
side's axis (``speedup`` 1 in production; a replay runs a recorded day faster).

Implementations: :class:`ReplayAdapter` (virtual nodes replaying a trace CSV), :class:`HookAdapter`
(Prometheus demand, an operator's webhook or command on a worker thread) and
:class:`tidal.serving.ray_serve.RayServeAdapter`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tidal.serving.serve_history import history_grid
from tidal.serving.sources import DEMAND_WAIT_S, BackgroundDemand, DemandSource, TraceReplay, client_demand

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)


class AdapterError(RuntimeError):
    """A serving action failed (after its retries); the message says which and why."""


class ServingAdapter(Protocol):
    speedup: float
    """Serving seconds per control-plane second (1 in production)."""

    def nodes(self) -> dict[str, int]:
        """Serving node -> GPUs it owns."""
        ...

    def serving_time(self, now_s: float) -> float:
        """``now_s`` on the serving side's time axis (the forecast's time of day)."""
        ...

    def demand_gpus(self, now_s: float) -> float:
        """GPUs serving needs at ``now_s``; NaN when unknown (never a guess)."""
        ...

    def release(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        """Serving stops using ``gpus`` GPUs of ``node`` (``lent_after`` lent there afterwards)."""
        ...

    def restore(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        """Serving may use ``gpus`` GPUs of ``node`` again (after its warm-up)."""
        ...

    def health(self) -> dict[str, Any]:
        """What the adapter knows of itself (for ``GET /v1/serving``)."""
        ...

    def persist(self) -> dict[str, Any]:
        """What the adapter needs to continue after a restart of the control plane (JSON-able)."""
        ...

    def resume(self, doc: Mapping[str, Any]) -> None:
        """Continue from :meth:`persist`'s document."""
        ...


@runtime_checkable
class ReadyAdapter(Protocol):
    """An adapter that knows when GPUs it got back serve again: a warm-up ends when its time is over *and*
    :meth:`ready` says so (without it, by time alone)."""

    def ready(self, node: str) -> bool:
        """Every GPU restored on ``node`` serves again. Quick (the reconcile loop calls it each step while
        the node warms up); False when unknown."""
        ...


@runtime_checkable
class WarmupAdapter(Protocol):
    """An adapter that measures its own warm-up: a reclaim's lead time assumes it instead of the configured
    ``warmup_s``."""

    def warmup_s(self) -> float | None:
        """Seconds from starting a replica until it serves (p95 of recent starts); None before any."""
        ...


@runtime_checkable
class HistoryAdapter(Protocol):
    """An adapter that knows demand before the plane's first live step, fed to a forecast that has seen
    nothing yet (:mod:`tidal.serving.serve_history`)."""

    def forecast_history(self, until_s: float, step_s: float) -> list[tuple[float, float]]:
        """``(serving time, GPUs or NaN)`` on the ``step_s`` grid before ``until_s`` (excluded), oldest
        first; bounded in length."""
        ...


@dataclasses.dataclass(frozen=True)
class ActionDone:
    """The outcome of an action a :class:`QueuedAdapter` carried out: ``error`` is None on success, else
    why it failed (after its retries)."""

    action: str  # "release" or "restore"
    node: str
    gpus: int
    lent_after: int
    error: str | None = None


@runtime_checkable
class QueuedAdapter(Protocol):
    """An adapter whose release and restore only check the action and queue it (:class:`AdapterError`: refused
    before queued); they run in order and :meth:`done` reports each outcome once. Until then the plane
    counts the GPUs in neither pool."""

    def done(self) -> list[ActionDone]:
        """Outcomes of the actions finished since the last call, in the order they were queued. Quick."""
        ...


def parse_nodes(spec: str | Mapping[str, int], prefix: str = "serve") -> dict[str, int]:
    """``"2x4"`` (2 nodes of 4 GPUs: serve-0, serve-1), ``"4,4,2"`` or a mapping name -> GPUs."""
    if isinstance(spec, Mapping):
        out = {}
        for name, g in spec.items():
            if not (isinstance(name, str) and name and isinstance(g, int)) or isinstance(g, bool) or g < 1:
                raise ValueError(f"serving nodes: {name!r}: GPUs must be a whole number >= 1, got {g!r}")
            out[name] = g
        if not out:
            raise ValueError("serving nodes: none given")
        return out
    s = str(spec).strip()
    try:
        if "x" in s:
            n, g = (int(p) for p in s.split("x", 1))
            sizes = [g] * n
        else:
            sizes = [int(p) for p in s.split(",")]
    except ValueError:
        raise ValueError(f"serving nodes: expected NxG (e.g. 2x4) or G,G,... , got {spec!r}") from None
    if not sizes or any(g < 1 for g in sizes) or len(sizes) > 4096:
        raise ValueError(f"serving nodes: expected 1..4096 nodes of >= 1 GPU, got {spec!r}")
    return {f"{prefix}-{i}": g for i, g in enumerate(sizes)}


class _Released:
    """Per-node count of GPUs released to lending, checked on every action."""

    def __init__(self, nodes: Mapping[str, int]) -> None:
        self.cap = dict(nodes)
        self.released = dict.fromkeys(self.cap, 0)

    def move(self, node: str, gpus: int, lent_after: int, sign: int) -> None:
        self.check(node, gpus, lent_after)
        self.released[node] = lent_after

    def check(self, node: str, gpus: int, lent_after: int) -> None:
        if node not in self.cap:
            raise AdapterError(f"unknown serving node {node!r} (have {sorted(self.cap)})")
        if gpus < 1 or not 0 <= lent_after <= self.cap[node]:
            raise AdapterError(f"{node}: cannot move {gpus} GPUs to {lent_after} lent of {self.cap[node]}")

    def resume(self, doc: Mapping[str, Any]) -> None:
        """The ``released`` counts of an adapter's persisted document (unknown nodes ignored)."""
        for node, g in (doc.get("released") or {}).items():
            if node in self.released:
                self.released[node] = int(g)


class ActionQueue:
    """The :class:`QueuedAdapter` bookkeeping both queued adapters share: release and restore check the
    action and queue it for the adapter's worker thread (started by :meth:`_ensure`), which puts each
    outcome on ``_done``; :meth:`done` reports them and only then moves the released counts."""

    def _init_actions(self, nodes: Mapping[str, int]) -> None:
        self._nodes = dict(nodes)
        self.state = _Released(self._nodes)
        self.failures = 0
        self.last_error: str | None = None
        self._todo: queue.SimpleQueue[ActionDone | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[ActionDone] = queue.SimpleQueue()
        self.queued = 0  # actions queued whose outcome done() has not reported yet
        self._worker: threading.Thread | None = None

    def _ensure(self) -> None:
        """Start the worker thread if it is not running."""
        raise NotImplementedError

    def release(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        self._queue(ActionDone("release", node, gpus, lent_after))

    def restore(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        self._queue(ActionDone("restore", node, gpus, lent_after))

    def _queue(self, act: ActionDone) -> None:
        self.state.check(act.node, act.gpus, act.lent_after)
        self._ensure()
        self.queued += 1
        self._todo.put(act)

    def done(self) -> list[ActionDone]:
        out: list[ActionDone] = []
        while True:
            try:
                act = self._done.get_nowait()
            except queue.Empty:
                return out
            self.queued -= 1
            if act.error is None:
                self.state.move(act.node, act.gpus, act.lent_after, +1 if act.action == "release" else -1)
                self.last_error = None
            else:
                self.failures += 1
                self.last_error = act.error
            out.append(act)

    def settle(self, timeout_s: float) -> bool:
        """Wait until every queued action has finished (its outcome waits for :meth:`done`) or
        ``timeout_s`` passed; whether they all finished (tests, scripts; the plane never waits)."""
        deadline = time.monotonic() + timeout_s
        while self._done.qsize() < self.queued:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


class ReplayAdapter:
    """Virtual serving nodes whose demand replays ``source``: serving time ``start_s`` (default: the
    replay's start) plays at control-plane time ``origin_s`` (set on first use unless given), ``speedup``
    trace seconds a second. ``fail(action, node) -> bool`` makes an action fail (tests, demos)."""

    def __init__(self, source: TraceReplay, nodes: Mapping[str, int], *, speedup: float = 1.0,
                 start_s: float | None = None, origin_s: float | None = None,
                 fail: Callable[[str, str], bool] | None = None) -> None:
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup!r}")
        if sum(nodes.values()) != source.serving_gpus:
            raise ValueError(f"serving nodes hold {sum(nodes.values())} GPUs, the replay is scaled to "
                             f"{source.serving_gpus}")
        self.source, self.speedup, self.origin_s = source, float(speedup), origin_s
        self.start_s = float(start_s) if start_s is not None else source.start_s
        self._nodes = dict(nodes)
        self.state = _Released(nodes)
        self.fail = fail
        self.actions = 0

    def nodes(self) -> dict[str, int]:
        return dict(self._nodes)

    def serving_time(self, now_s: float) -> float:
        if self.origin_s is None:
            self.origin_s = now_s
        return self.start_s + (now_s - self.origin_s) * self.speedup

    def demand_gpus(self, now_s: float) -> float:
        return self.source.demand_gpus(self.serving_time(now_s))

    def clients_at(self, now_s: float) -> np.ndarray | None:
        return client_demand(self.source, self.serving_time(now_s))

    def history(self, seconds: float, step_s: float) -> list[tuple[float, float]]:
        """(serving time, demand) on the ``step_s`` grid over the ``seconds`` before the replay's start,
        where the trace has them (the forecast learns them before the first live step)."""
        pts = [(t, self.source.demand_gpus(t)) for t in history_grid(self.start_s, seconds, step_s)]
        return [(t, y) for t, y in pts if t >= self.source.start_s]

    def release(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        self._act("release", node, gpus, lent_after, +1)

    def restore(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        self._act("restore", node, gpus, lent_after, -1)

    def _act(self, action: str, node: str, gpus: int, lent_after: int, sign: int) -> None:
        if self.fail is not None and self.fail(action, node):
            raise AdapterError(f"{action} of {gpus} GPUs on {node}: refused by the replay's fault injection")
        self.state.move(node, gpus, lent_after, sign)
        self.actions += 1

    def released(self) -> dict[str, int]:
        return dict(self.state.released)

    def health(self) -> dict[str, Any]:
        return {"kind": "replay", "trace": self.source.trace.name, "speedup": self.speedup,
                "released": self.released()}

    def persist(self) -> dict[str, Any]:
        return {"origin_s": self.origin_s, "released": self.released()}

    def resume(self, doc: Mapping[str, Any]) -> None:
        if doc.get("origin_s") is not None:
            self.origin_s = float(doc["origin_s"])
        self.state.resume(doc)


class HookAdapter(ActionQueue):
    """Demand from ``source`` (e.g. :class:`~tidal.serving.sources.PrometheusQuery`), actions by an
    operator's webhook (``url``: ``POST`` JSON ``{"action", "node", "gpus", "lent_after"}``, 2xx is
    success) or command (argv with ``TIDAL_SERVING_ACTION``, ``_NODE``, ``_GPUS``, ``_LENT_AFTER`` in
    its environment, exit 0 is success); ``attempts`` tries of at most ``timeout_s``, ``retry_wait_s``
    apart. A :class:`QueuedAdapter`: actions run in order on one worker thread; :meth:`done` reports
    the outcomes and only then moves the released counts."""

    speedup = 1.0

    def __init__(self, source: DemandSource, nodes: Mapping[str, int], *, url: str | None = None,
                 command: Sequence[str] | None = None, timeout_s: float = 5.0, attempts: int = 2,
                 retry_wait_s: float = 0.5, demand_wait_s: float = DEMAND_WAIT_S,
                 demand_max_age_s: float = 60.0) -> None:
        if (url is None) == (command is None):
            raise ValueError("serving actions: give exactly one of a webhook url or a command")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"serving actions: webhook url must be http(s)://..., got {url!r}")
        if command is not None and (not command or not all(isinstance(a, str) and a for a in command)):
            raise ValueError(f"serving actions: command must be a non-empty list of strings, got {command!r}")
        if not timeout_s > 0 or attempts < 1 or retry_wait_s < 0:
            raise ValueError("serving actions: timeout_s > 0, attempts >= 1 and retry_wait_s >= 0 are "
                             "required")
        self.source, self.url = source, url
        self.command = tuple(command) if command is not None else None
        self.timeout_s, self.attempts = float(timeout_s), int(attempts)
        self.retry_wait_s = float(retry_wait_s)
        self.demand = BackgroundDemand(source, demand_wait_s, demand_max_age_s)
        self._init_actions(nodes)

    def nodes(self) -> dict[str, int]:
        return dict(self._nodes)

    def serving_time(self, now_s: float) -> float:
        return now_s

    def demand_gpus(self, now_s: float) -> float:
        """The source's answer, waited for at most ``demand_wait_s`` (:class:`BackgroundDemand`)."""
        return self.demand.demand_gpus(now_s)

    def clients_at(self, now_s: float) -> np.ndarray | None:
        return self.demand.clients_at(now_s)

    def _ensure(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, daemon=True, name="tidal-serving-actions")
            self._worker.start()

    def _work(self) -> None:
        """The worker thread: one action at a time, in order; it touches nothing but the two queues."""
        while (act := self._todo.get()) is not None:  # None: stop
            self._done.put(dataclasses.replace(act, error=self._carry_out(act)))

    def _carry_out(self, act: ActionDone) -> str | None:
        body = {"action": act.action, "node": act.node, "gpus": act.gpus, "lent_after": act.lent_after}
        why = ""
        for i in range(self.attempts):
            if i:
                time.sleep(self.retry_wait_s)
            why = self._try(body)
            if not why:
                return None
        return f"{act.action} {act.gpus} GPUs on {act.node}: {why} ({self.attempts} attempts)"

    def _try(self, body: dict[str, Any]) -> str:
        """'' on success, else why it failed."""
        if self.url is not None:
            req = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 (http(s) checked)
                    resp.read(65536)
                    return "" if 200 <= resp.status < 300 else f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                return f"HTTP {e.code} from {self.url}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                return f"webhook {self.url}: {getattr(e, 'reason', e)}"
        env = {**os.environ, "TIDAL_SERVING_ACTION": body["action"], "TIDAL_SERVING_NODE": body["node"],
               "TIDAL_SERVING_GPUS": str(body["gpus"]), "TIDAL_SERVING_LENT_AFTER": str(body["lent_after"])}
        return self._run_command(env)

    def _run_command(self, env: dict[str, str]) -> str:
        """Run the command once: '' when it exited 0, else why not. Output goes to files, not pipes: a
        command that starts a server in the background and exits would be waited for until the server
        closed the pipe. Its own session; on a timeout its process group is killed."""
        command = self.command
        assert command is not None  # a command adapter (its act() ran no webhook)
        with tempfile.TemporaryFile() as err:
            try:
                p = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            except OSError as e:
                return f"command {command[0]!r}: {e}"
            try:
                code = p.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return f"command timed out after {self.timeout_s:g} s"
            if code != 0:
                err.seek(max(0, os.fstat(err.fileno()).st_size - 4096))
                tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
                return f"command exited {code}: {tail[0][:200]}"
        return ""

    def health(self) -> dict[str, Any]:
        return {"kind": "hook", "actions": self.url or " ".join(self.command or ()), "queued": self.queued,
                "failures": self.failures, "last_error": self.last_error,
                "released": dict(self.state.released)}

    def persist(self) -> dict[str, Any]:
        return {"released": dict(self.state.released)}

    def resume(self, doc: Mapping[str, Any]) -> None:
        self.state.resume(doc)

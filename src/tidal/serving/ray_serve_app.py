"""What runs inside Ray Serve for :class:`tidal.serving.ray_serve.RayServeAdapter` (imported by Serve's
replicas: only the standard library, Ray and Starlette).

:class:`Router`, the HTTP ingress, is the one FCFS queue of the Erlang C model in front of the per-node
copies of the operator's model: a request waits until a replica slot is free (``slots[node]``, set by
the adapter), then goes to the node with the most free slots. It counts arrivals, and each finished
request's wait and service time, over a sliding window. :class:`SleepModel`: a toy model with a fixed
service time (tests, demos).
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

from ray import serve

from tidal.contract import RAY_NODE_LABEL

ROUTER = "tidal-router"  # the router deployment's name in the application
MAX_SAMPLES = 200_000  # finished requests kept for the window (bounded memory at any rate)
MAX_BODY_BYTES = 64 << 20  # a larger request body is refused (413): one router holds every request's body


@serve.deployment(name=ROUTER, num_replicas=1, max_ongoing_requests=100_000,
                  ray_actor_options={"num_cpus": 0})
class Router:
    """HTTP ingress and FCFS queue in front of the per-node model deployments (module docstring)."""

    def __init__(self, handles: dict[str, Any], slots: dict[str, int], window_s: float = 30.0) -> None:
        self.handles = dict(handles)
        self.slots = {n: int(slots.get(n, 0)) for n in self.handles}
        self.busy = dict.fromkeys(self.handles, 0)
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.window_s = float(window_s)
        self.started = time.monotonic()
        self.arrivals: collections.deque[float] = collections.deque(maxlen=MAX_SAMPLES)
        self.done: collections.deque[tuple[float, float, float, bool]] = collections.deque(maxlen=MAX_SAMPLES)
        self.total = {"arrivals": 0, "ok": 0, "failed": 0, "too_large": 0}
        self.served = dict.fromkeys(self.handles, 0)  # requests answered per node, ever

    def _free_node(self) -> str | None:
        best, free = None, 0
        for n, s in self.slots.items():
            f = s - self.busy[n]
            if f > free:
                best, free = n, f
        return best

    def _dispatch(self) -> None:
        while self.waiters:
            node = self._free_node()
            if node is None:
                return
            fut = self.waiters.popleft()
            if fut.done():  # the client went away while waiting
                continue
            self.busy[node] += 1
            fut.set_result(node)

    async def _acquire(self) -> str:
        node = self._free_node() if not self.waiters else None
        if node is not None:
            self.busy[node] += 1
            return node
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # a slot was given as we were cancelled: hand it on
                self._release(fut.result())
            raise

    def _release(self, node: str) -> None:
        self.busy[node] -= 1
        self._dispatch()

    async def __call__(self, request: Any) -> Any:
        body = await _body(request)
        if body is None:  # refused before it is queued or counted as demand
            from starlette.responses import PlainTextResponse

            self.total["too_large"] += 1
            return PlainTextResponse(f"request body over {MAX_BODY_BYTES} bytes", status_code=413)
        t0 = time.monotonic()
        self.arrivals.append(t0)
        self.total["arrivals"] += 1
        node = await self._acquire()
        t1 = time.monotonic()
        ok = False
        try:
            out = await self.handles[node].remote(body)
            ok = True
            self.served[node] += 1
            return out
        finally:
            t2 = time.monotonic()
            self.done.append((t2, t1 - t0, t2 - t1, ok))
            self.total["ok" if ok else "failed"] += 1
            self._release(node)

    def sync(self, slots: dict[str, int] | None = None) -> dict[str, Any]:
        """Set the slots per node (``None``: keep them); the window's counts: ``arrivals`` over ``window_s``
        (the router's age if younger; the span of the newest :data:`MAX_SAMPLES` arrivals if more came),
        sums and quantiles of service and wait times, ``busy``, ``queued``, ``slots``, ``served``."""
        if slots is not None:
            for n in self.handles:
                self.slots[n] = max(0, int(slots.get(n, 0)))
            self._dispatch()
        now = time.monotonic()
        lo = now - self.window_s
        while self.arrivals and self.arrivals[0] < lo:
            self.arrivals.popleft()
        while self.done and self.done[0][0] < lo:
            self.done.popleft()
        served = [d for d in self.done if d[3]]
        service = sorted(d[2] for d in served)
        response = sorted(d[1] + d[2] for d in served)
        window = min(self.window_s, now - self.started)
        if len(self.arrivals) == self.arrivals.maxlen:  # more arrivals than kept: the rate over those kept
            window = min(window, now - self.arrivals[0])
        return {
            "window_s": window, "arrivals": len(self.arrivals), "completed": len(served),
            "failed": sum(1 for d in self.done if not d[3]), "service_sum_s": sum(service),
            "service_p50_s": _q(service, 0.5), "wait_p99_s": _q(sorted(d[1] for d in served), 0.99),
            "response_p50_s": _q(response, 0.5), "response_p99_s": _q(response, 0.99),
            "busy": dict(self.busy), "queued": len(self.waiters), "slots": dict(self.slots),
            "total": dict(self.total), "served": dict(self.served), "pid": os.getpid()}


async def _body(request: Any) -> bytes | None:
    """The request's body, or None once it is over :data:`MAX_BODY_BYTES` (read no further)."""
    try:
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            return None
    except ValueError:
        pass  # a bad header: the stream's length decides
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _q(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


@serve.deployment(name="sleep-model", max_ongoing_requests=1, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=0.5)
class SleepModel:
    """A toy model: every request takes ``service_s`` seconds (an ``asyncio.sleep``) and answers with the
    node it ran on."""

    def __init__(self, service_s: float = 0.03) -> None:
        import ray

        self.service_s = float(service_s)
        label = ray.get_runtime_context().get_node_labels().get(RAY_NODE_LABEL, "?")
        self.node = label[0] if isinstance(label, list) else label

    async def __call__(self, body: bytes) -> dict[str, Any]:
        await asyncio.sleep(self.service_s)
        return {"node": self.node, "bytes": len(body)}


sleep_model = SleepModel  # import path for configs: tidal.serving.ray_serve_app:sleep_model

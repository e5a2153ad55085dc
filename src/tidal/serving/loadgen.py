"""A load generator: open-loop Poisson arrivals at a (changing) request rate against an HTTP endpoint.

    rate = trace_rate(load_trace("day.csv"), speedup=600, scale=0.01)   # requests/s at second t
    records = asyncio.run(generate("http://127.0.0.1:8000/", rate, duration_s=60))
    summary(records)   # count, failures, p50/p99 latency

Open loop: each request is sent at its arrival time whether or not earlier ones were answered (a
closed loop would slow down exactly when serving does, hiding the latency a user sees). Arrivals are
a Poisson process of rate ``rate(t)``, drawn by thinning against the largest rate.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

MAX_IN_FLIGHT = 4096  # requests outstanding at most (beyond: a request is recorded as failed, not sent)
MAX_REQUESTS = 10_000_000  # arrivals drawn up front at most (max_rate x duration_s): a bad rate is an error
MAX_RATE_SAMPLES = 100_000  # a rate without a known maximum is sampled at most this often


@dataclass(frozen=True)
class Record:
    """One request, due ``t_s`` after the start, sent ``late_s`` after that (the generator's own lag);
    ``latency_s`` from sending until its answer was read."""

    t_s: float
    latency_s: float
    status: int
    error: str = ""
    late_s: float = 0.0
    ttft_s: float | None = None  # streamed: from sending until the first event arrived
    tokens: int = 0  # streamed: the tokens the answer's usage counts

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.error


def constant(rate: float) -> Callable[[float], float]:
    """``rate`` requests/s throughout (its ``max_rate`` attribute: ``rate``)."""
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate must be a finite number >= 0 (requests/s), got {rate!r}")
    return _with_max(lambda t: rate, rate)


def _with_max(fn: Callable[[float], float], top: float) -> Callable[[float], float]:
    fn.max_rate = float(top)  # type: ignore[attr-defined]  # an attribute on the function, read by generate()
    return fn


def check_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host (and a valid port), else ``ValueError`` saying why."""
    try:
        u = httpx.URL(url)
        port = u.port
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise ValueError(f"url {url!r} is not a URL: {e}") from None
    if u.scheme not in ("http", "https") or not u.host or (port is not None and not 0 < port < 65536):
        raise ValueError(f"url must be http(s)://host[:port]/..., got {url!r}")
    return url


def steps(points: Sequence[tuple[float, float]]) -> Callable[[float], float]:
    """A rate that is ``r`` from second ``t`` on, for each ``(t, r)`` (0 before the first)."""
    pts = sorted((float(t), float(r)) for t, r in points)
    if any(not (math.isfinite(r) and r >= 0) for _, r in pts):
        raise ValueError("rates must be finite numbers >= 0 (requests/s)")
    ts = [t for t, _ in pts]

    def rate(t: float) -> float:
        import bisect

        i = bisect.bisect_right(ts, t) - 1
        return pts[i][1] if i >= 0 else 0.0
    return _with_max(rate, max((r for _, r in pts), default=0.0))


def trace_rate(trace: Any, *, speedup: float = 1.0, scale: float = 1.0, start_s: float | None = None
               ) -> Callable[[float], float]:
    """A trace's load column (requests/s) times ``scale``, played from ``start_s`` (default: its first
    row) at ``speedup``; a gap replays the rate before it, past the end the last row's."""
    if not (speedup > 0 and scale >= 0 and math.isfinite(speedup) and math.isfinite(scale)):
        raise ValueError(f"speedup must be > 0 and scale >= 0, got {speedup!r}, {scale!r}")
    times = np.asarray(trace.times_s, dtype=float)
    load = np.asarray(trace.load, dtype=float).copy()
    for i in range(1, len(load)):  # a gap keeps the rate before it
        if trace.gap[i]:
            load[i] = load[i - 1]
    t0 = float(times[0]) if start_s is None else float(start_s)

    def rate(t: float) -> float:
        x = t0 + t * speedup
        i = int(np.searchsorted(times, x, side="right")) - 1
        return float(load[max(0, min(i, len(load) - 1))]) * scale
    return _with_max(rate, float(np.max(load)) * scale)


def arrivals(rate: Callable[[float], float], duration_s: float, max_rate: float,
             rng: random.Random) -> list[float]:
    """Poisson arrival times in ``[0, duration_s)`` for ``rate(t) <= max_rate`` (thinning)."""
    if not max_rate > 0:
        return []
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(max_rate)
        if t >= duration_s:
            return out
        r = rate(t)
        if r > max_rate * (1 + 1e-9):
            raise ValueError(f"rate {r:g} at t={t:.3f} s is above max_rate {max_rate:g}")
        if rng.random() * max_rate < r:
            out.append(t)


async def generate(url: str, rate: Callable[[float], float], duration_s: float, *,
                   max_rate: float | None = None,
                   body: bytes | Callable[[int], bytes] = b"{}", timeout_s: float = 30.0, seed: int = 0,
                   stream: bool = False,
                   on_record: Callable[[Record], None] | None = None, start: float | None = None,
                   stop: Callable[[], bool] | None = None) -> list[Record]:
    """Send the arrivals of ``rate`` over ``duration_s`` to ``url`` (``POST body``); every request's
    :class:`Record`, in send order. ``max_rate``: the largest ``rate(t)`` (default: sampled every 0.1 s).
    ``start``: the ``time.perf_counter()`` of second 0 (default: now); ``stop()`` true ends the sending
    early (what was sent is still awaited). ``body(i)``: the i-th request's body. ``stream``: the answer
    is server-sent events (an OpenAI-style completion): its first event and its token usage recorded."""
    check_url(url)
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    if max_rate is None:
        max_rate = getattr(rate, "max_rate", None)
    if max_rate is None:
        n = min(int(duration_s * 10), MAX_RATE_SAMPLES)
        max_rate = max(rate(i * duration_s / max(n, 1)) for i in range(n + 1))
    if not (math.isfinite(max_rate) and max_rate * duration_s <= MAX_REQUESTS):
        raise ValueError(f"a rate of up to {max_rate:g} requests/s for {duration_s:g} s is more than "
                         f"{MAX_REQUESTS} requests: lower the rate (or scale) or the duration")
    times = arrivals(rate, duration_s, max_rate, random.Random(seed))
    out: list[Record | None] = [None] * len(times)
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=256)
    in_flight = 0
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter() if start is None else start

        async def one(i: int, t: float) -> None:
            nonlocal in_flight
            sent = time.perf_counter()
            if in_flight >= MAX_IN_FLIGHT:
                out[i] = Record(t, 0.0, 0, f"not sent: {MAX_IN_FLIGHT} requests outstanding",
                                sent - start - t)
                return
            in_flight += 1
            try:
                content = body(i) if callable(body) else body
                if stream:
                    rec = await _streamed(client, url, content, sent, t, start)
                else:
                    r = await client.post(url, content=content)
                    await r.aread()
                    why = "" if r.is_success else f"HTTP {r.status_code}: {' '.join(r.text.split())[:160]}"
                    rec = Record(t, time.perf_counter() - sent, r.status_code, why, sent - start - t)
            except Exception as e:  # noqa: BLE001 (any failure is this request's, recorded, never a crash)
                why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
                rec = Record(t, time.perf_counter() - sent, 0, why, sent - start - t)
            finally:
                in_flight -= 1
            out[i] = rec
            if on_record is not None:
                on_record(rec)

        tasks = []
        for i, t in enumerate(times):
            if stop is not None and stop():
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, t)))
        if tasks:
            await asyncio.gather(*tasks)
    return [r for r in out if r is not None]


async def _streamed(client: httpx.AsyncClient, url: str, content: bytes, sent: float, t: float,
                    start: float) -> Record:
    """One request whose answer is server-sent events: ``ttft_s`` at the first ``data:`` line, ``tokens``
    from the ``usage`` of the last; an answer cut before ``data: [DONE]`` is a failure."""
    ttft, tokens, done = None, 0, False
    async with client.stream("POST", url, content=content) as r:
        if not r.is_success:
            await r.aread()
            return Record(t, time.perf_counter() - sent, r.status_code,
                          f"HTTP {r.status_code}: {' '.join(r.text.split())[:160]}", sent - start - t)
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - sent
            if line[5:].strip() == "[DONE]":
                done = True
            elif '"usage"' in line:
                tokens = int((json.loads(line[5:]).get("usage") or {}).get("completion_tokens") or 0)
    why = "" if done else "the event stream ended before [DONE]"
    return Record(t, time.perf_counter() - sent, r.status_code, why, sent - start - t, ttft, tokens)


def summary(records: Sequence[Record], start_s: float = 0.0, end_s: float = math.inf) -> dict[str, Any]:
    """Requests due in ``[start_s, end_s)``: count, failed, the latency quantiles of those answered, and
    the generator's largest lag (``late_max_s``)."""
    sel = [r for r in records if start_s <= r.t_s < end_s]
    lat = np.array([r.latency_s for r in sel if r.ok], dtype=float)
    q = (lambda p: round(float(np.quantile(lat, p)), 4)) if len(lat) else (lambda p: None)
    span = (min(end_s, max((r.t_s for r in sel), default=start_s)) - start_s) if sel else 0.0
    return {"requests": len(sel), "failed": sum(1 for r in sel if not r.ok),
            "rate": round(len(sel) / span, 2) if span > 0 else None,
            "p50_s": q(0.5), "p99_s": q(0.99), "max_s": round(float(lat.max()), 4) if len(lat) else None,
            "late_max_s": round(max((r.late_s for r in sel), default=0.0), 4),
            "errors": sorted({r.error or f"HTTP {r.status}" for r in sel if not r.ok})[:5]}


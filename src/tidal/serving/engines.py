"""LLM inference engines as the serving side sees them: how to start one (llama.cpp), where its health
endpoint is, what its Prometheus ``/metrics`` call requests running and waiting, tokens, busy time and
time to first token, and the replicas a p99 TTFT target needs at the rate they were asked.

    stats = parse_metrics(LLAMA_CPP, text)                 # one scrape of one replica
    need = replicas_needed(before, after, router_requests=n, slo_s=0.5, slots=2)

The names are the engines' documented ones (docs/loaning.md has the table); vLLM and SGLang need a GPU
and are read, not started, here. A replica is ``slots`` servers of the Erlang C queue
(:mod:`tidal.policy.queueing`): mean service time = busy seconds / requests finished.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tidal.policy.queueing import servers_needed


@dataclass(frozen=True)
class Engine:
    """What the serving side reads from one engine's ``/metrics`` (sample names; ``None``: not exposed)."""

    name: str
    health_path: str
    running: str
    waiting: str
    generated_tokens: str  # counter
    busy_s: tuple[str, ...]  # counters summed: seconds requests spent being processed
    requests: str | None  # counter of requests finished
    ttft: str | None  # histogram base name of the time to first token

    def check(self, names: Iterable[str]) -> list[str]:
        """The metric names this adapter needs that a scrape lacks (an engine of another version)."""
        have = set(names)
        need = [self.running, self.waiting, self.generated_tokens, *self.busy_s]
        need += [self.requests] if self.requests else []
        need += [f"{self.ttft}_count"] if self.ttft else []
        return [n for n in need if n not in have]


LLAMA_CPP = Engine("llama.cpp", "/health", "llamacpp:requests_processing", "llamacpp:requests_deferred",
                   "llamacpp:tokens_predicted_total",
                   ("llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"), None, None)
VLLM = Engine("vllm", "/health", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:generation_tokens_total", ("vllm:request_inference_time_seconds_sum",),
              "vllm:request_success_total", "vllm:time_to_first_token_seconds")
SGLANG = Engine("sglang", "/health", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                "sglang:generation_tokens_total", ("sglang:e2e_request_latency_seconds_sum",),
                "sglang:num_requests_total", "sglang:time_to_first_token_seconds")
ENGINES = {e.name: e for e in (LLAMA_CPP, VLLM, SGLANG)}


@dataclass(frozen=True)
class EngineStats:
    """One scrape of one replica; counters as totals since it started (a restart starts them again)."""

    running: float
    waiting: float
    generated_tokens: float
    busy_s: float
    requests: float | None
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (le seconds, cumulative count), +inf last


def parse_metrics(engine: Engine, text: str) -> EngineStats:
    """``EngineStats`` from a ``/metrics`` text (samples of one name summed over their labels: models,
    ranks). ``ValueError`` naming the engine and the missing metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    buckets: dict[float, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                totals[s.name] = totals.get(s.name, 0.0) + float(s.value)
                if engine.ttft and s.name == f"{engine.ttft}_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + float(s.value)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{engine.name} /metrics: not Prometheus text ({e})") from None
    missing = engine.check(totals)
    if missing:
        raise ValueError(f"{engine.name} /metrics lacks {', '.join(missing)} (is it started with metrics on, "
                         "and of a version with these names?)")
    return EngineStats(totals[engine.running], totals[engine.waiting], totals[engine.generated_tokens],
                       sum(totals[n] for n in engine.busy_s),
                       totals[engine.requests] if engine.requests else None, tuple(sorted(buckets.items())))


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of a cumulative histogram (Prometheus' linear interpolation within a bucket;
    the last finite bound when it falls in +Inf); ``None`` when it counted nothing."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def ttft_delta(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]
               ) -> tuple[tuple[float, float], ...]:
    """The TTFT histogram of the requests between two scrapes (counts subtracted bucket by bucket)."""
    was = dict(before)
    return tuple((le, n - was.get(le, 0.0)) for le, n in after)


@dataclass(frozen=True)
class Demand:
    """Replicas a TTFT target needs, and what it was computed from (requests/s, mean service s)."""

    replicas: float  # NaN: unknown (nothing finished to measure a service time on)
    rate_per_s: float
    service_s: float | None
    tokens_per_s: float
    servers: float | None = None  # slots the target needs (None: idle or unknown)


def replicas_needed(before: Sequence[EngineStats], after: Sequence[EngineStats], dt_s: float, *,
                    slo_s: float, slots: int, quantile: float = 0.99,
                    router_requests: float | None = None, min_replicas: int = 1) -> Demand:
    """The replicas whose ``slots`` servers each keep the ``quantile`` of the wait for a slot within
    ``slo_s`` at the request rate between two scrapes of every replica (same order; a replica restarted
    in between, its counters gone back, counts from zero). The rate is the engines' request counter,
    else ``router_requests`` (the router's count in ``dt_s``: llama.cpp counts none)."""
    if not dt_s > 0:
        raise ValueError(f"dt_s must be > 0, got {dt_s!r}")

    def delta(get: str) -> float:
        out = 0.0
        for b, a in zip(before, after, strict=True):
            x, y = getattr(b, get) or 0.0, getattr(a, get) or 0.0
            out += y - x if y >= x else y
        return out

    done = delta("requests") if after and after[0].requests is not None else router_requests
    if done is None:
        raise ValueError("the engine counts no requests: give router_requests")
    busy, tokens = delta("busy_s"), delta("generated_tokens")
    rate, waiting = done / dt_s, sum(a.waiting for a in after)
    if done <= 0 or busy <= 0:
        idle = done <= 0 and waiting == 0
        return Demand(float(min_replicas) if idle else math.nan, rate, None, tokens / dt_s)
    service_s = busy / done
    servers = float(servers_needed(rate, 1.0 / service_s, slo_s, quantile, "queue"))
    return Demand(max(float(min_replicas), float(np.ceil(servers / slots))), rate, service_s, tokens / dt_s,
                  servers)

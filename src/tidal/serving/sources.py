"""Where live serving demand comes from: a replayed trace, or a Prometheus query.

Every source answers ``demand_gpus(now_s)``: the GPUs serving needs at ``now_s``, or NaN when it cannot
tell; one that knows its clients also ``clients_at(now_s)``: that answer per client, without asking again
(:func:`client_demand`). A metrics outage is *unknown* demand, never zero: the loan policy holds its
forecast through NaN and lends nothing more because the numbers went missing. With ``requests`` (a
:class:`~tidal.serving.requests.RequestModel`) the load or value is requests/s and demand is the GPUs
that meet the latency target at that rate.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tidal.serving.client_traces import read_trace
from tidal.serving.requests import RequestModel
from tidal.serving.traces import Trace

log = logging.getLogger(__name__)


class DemandSource(Protocol):
    def demand_gpus(self, now_s: float) -> float:
        """GPUs serving needs at ``now_s`` (NaN: unknown)."""
        ...


def client_demand(source: object, now_s: float) -> np.ndarray | None:
    """The per-client demand (the tail last) of ``source``'s answer at ``now_s``; None if it has none."""
    at = getattr(source, "clients_at", None)
    return at(now_s) if callable(at) else None


def replay_of(path: str, serving_gpus: int, start_s: float | None,
              requests: RequestModel | None) -> TraceReplay:
    """A replay of the trace at ``path`` (either format; per client unless ``requests``) from ``start_s``,
    else from its first row."""
    trace, clients = read_trace(path)
    start = start_s if start_s is not None else float(trace.times_s[0])
    rates = clients.rates if clients is not None and requests is None else None
    return TraceReplay(trace, serving_gpus, start_s=start, requests=requests, clients=rates)


@dataclass(frozen=True, eq=False)
class TraceReplay:
    """Replay ``trace`` from ``start_s`` (the caller's clock), repeating it: demand at ``now_s`` is the
    row covering ``(now_s - start_s) mod length``, scaled so that ``serving_gpus`` serve the peak (with
    ``requests``: ``requests.gpus(load)``, unscaled); NaN at a gap and before ``start_s``. ``clients``: the
    trace's rates per client (rows x clients, the tail last; not with ``requests``)."""

    trace: Trace
    serving_gpus: int
    start_s: float = 0.0
    requests: RequestModel | None = None
    clients: np.ndarray | None = None
    _request_gpus: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.serving_gpus < 1:
            raise ValueError(f"TraceReplay.serving_gpus must be >= 1, got {self.serving_gpus}")
        if len(self.trace.load) == 0:
            raise ValueError(f"trace {self.trace.name!r} has no rows")
        if self.clients is not None and (self.requests or len(self.clients) != len(self.trace.load)):
            raise ValueError(f"trace {self.trace.name!r}: per-client rates: a row per row, no request model")
        if self.requests is not None:
            gpus = self.trace.request_demand_gpus(self.requests)
            object.__setattr__(self, "_request_gpus", gpus)
            peak = float(np.nanmax(gpus)) if not np.all(np.isnan(gpus)) else 0.0
            if peak > self.serving_gpus:
                log.warning("trace %r needs up to %g GPUs for its latency target (%s); the serving pool "
                            "has %d", self.trace.name, peak, self.requests.describe(), self.serving_gpus)

    def _row(self, now_s: float) -> int | None:
        if not now_s >= self.start_s:
            return None
        i = int((now_s - self.start_s) // self.trace.step_s) % len(self.trace.load)
        return None if self.trace.gap[i] else i

    def clients_at(self, now_s: float) -> np.ndarray | None:
        i = self._row(now_s)
        if self.clients is None or i is None:
            return None
        return self.serving_gpus * self.clients[i] / self.trace.peak_load

    def demand_gpus(self, now_s: float) -> float:
        i = self._row(now_s)
        if i is None:
            return math.nan
        if self._request_gpus is not None:
            return float(self._request_gpus[i])
        return float(self.serving_gpus * self.trace.load[i] / self.trace.peak_load)


@dataclass(frozen=True)
class PrometheusQuery:
    """``demand = value of query x gpus_per_unit`` from Prometheus at base ``url`` (``GET /api/v1/query``;
    with ``requests``: ``requests.gpus(value)``). One number: a scalar or one series (``sum(...)``); any
    failure reads as NaN, logged with the query and why. ``timeout_s`` bounds each request.

    With ``client_label`` the query is grouped by that label (``sum by (client) (rate(...))``): demand is
    the sum of its series, and :meth:`client_gpus` the same per client, the first ``max_clients`` labels
    seen keeping a column each (the rest, and series without the label, in the last: the tail)."""

    url: str
    query: str
    gpus_per_unit: float = 1.0
    timeout_s: float = 5.0
    requests: RequestModel | None = None
    client_label: str | None = None
    max_clients: int = 32
    _columns: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _answers: dict[float, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"PrometheusQuery.url must be an http(s) base URL like http://prometheus:9090, "
                             f"got {self.url!r}")
        if not self.query.strip():
            raise ValueError("PrometheusQuery.query must not be empty")
        if not self.gpus_per_unit > 0 or not self.timeout_s > 0:
            raise ValueError(f"PrometheusQuery.gpus_per_unit and timeout_s must be > 0, got "
                             f"{self.gpus_per_unit} and {self.timeout_s}")
        if self.client_label is not None and not self.client_label.strip() or self.max_clients < 1:
            raise ValueError(f"PrometheusQuery.client_label must not be empty and max_clients must be >= 1, "
                             f"got {self.client_label!r} and {self.max_clients}")

    def demand_gpus(self, now_s: float) -> float:
        if self.client_label is not None:
            got = self.client_gpus(now_s)
            self._answers.clear()  # the newest answer only
            if got is None:
                return math.nan
            self._answers[now_s] = got
            return float(got.sum())
        try:
            value = self.value(now_s)
        except ValueError as e:
            log.warning("serving demand unknown at %.0f: Prometheus query %r: %s", now_s, self.query, e)
            return math.nan
        if self.requests is not None:
            try:
                return float(self.requests.gpus(value))
            except ValueError as e:  # a rate no pool meets: nonsense, read as unknown like a negative value
                log.warning("serving demand unknown at %.0f: Prometheus query %r: %g requests/s: %s", now_s,
                            self.query, value, e)
                return math.nan
        return value * self.gpus_per_unit

    def clients_at(self, now_s: float) -> np.ndarray | None:
        return self._answers.get(now_s)

    def client_gpus(self, now_s: float) -> np.ndarray | None:
        """Demand per client at ``now_s`` (``max_clients + 1`` columns, the tail last; with ``requests``
        the GPUs of the total rate, shared by rate); None when unknown or without ``client_label``."""
        if self.client_label is None:
            return None
        try:
            values = self._series(now_s)
        except ValueError as e:
            log.warning("client demand unknown at %.0f: Prometheus query %r: %s", now_s, self.query, e)
            return None
        out = np.zeros(self.max_clients + 1)
        for name, v in values:
            if name is not None and name not in self._columns and len(self._columns) < self.max_clients:
                self._columns[name] = len(self._columns)
            col = self.max_clients if name is None else self._columns.get(name, self.max_clients)
            out[col] += v
        if self.requests is None:
            return out * self.gpus_per_unit
        try:  # the GPUs of the total rate, shared in proportion to the clients' rates
            gpus = float(self.requests.gpus(float(out.sum())))
        except ValueError as e:
            log.warning("client demand unknown at %.0f: Prometheus query %r: %s", now_s, self.query, e)
            return None
        return out * (gpus / out.sum()) if out.sum() > 0 else out

    def value(self, now_s: float) -> float:
        """The query's value at ``now_s`` (with ``client_label``: summed over its series); ``ValueError``
        saying what went wrong."""
        if self.client_label is not None:
            return sum(v for _, v in self._series(now_s))
        return self._series(now_s)[0][1]

    def _series(self, now_s: float) -> list[tuple[str | None, float]]:
        """(client label or None, value) of each series of the answer (one unless grouped)."""
        qs = urllib.parse.urlencode({"query": self.query, "time": f"{now_s:.3f}"})
        endpoint = f"{self.url.rstrip('/')}/api/v1/query?{qs}"
        try:
            with urllib.request.urlopen(endpoint, timeout=self.timeout_s) as resp:  # noqa: S310 (http(s) checked)
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise ValueError(f"HTTP {e.code} from {self.url}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"cannot reach {self.url}: {getattr(e, 'reason', e)}") from None
        except http.client.HTTPException as e:  # e.g. the answer was cut off
            raise ValueError(f"no complete answer from {self.url}: {type(e).__name__}") from None
        try:
            doc = json.loads(body)
        except json.JSONDecodeError:
            raise ValueError(f"{self.url} did not answer JSON") from None
        if not isinstance(doc, dict) or doc.get("status") != "success":
            raise ValueError(f"status {doc.get('status') if isinstance(doc, dict) else None!r}: "
                             f"{doc.get('error') if isinstance(doc, dict) else doc!r}")
        data = doc.get("data") or {}
        kind, result = data.get("resultType"), data.get("result")
        samples: list[tuple[str | None, Any]]  # checked by the float() below
        label = self.client_label
        if kind == "scalar" and label is None:
            samples = [(None, result)]
        elif kind == "vector" and isinstance(result, list) and label is not None:
            samples = [(_label(s, label), s.get("value") if isinstance(s, dict) else s) for s in result]
            if any(name is None for name, _ in samples):
                log.warning("%d series have no label %r: their demand counts in the tail",
                            sum(name is None for name, _ in samples), label)
        elif kind == "vector" and isinstance(result, list) and len(result) == 1:
            samples = [(None, result[0].get("value") if isinstance(result[0], dict) else None)]
        elif kind == "vector":
            n = len(result) if isinstance(result, list) else 0
            raise ValueError(f"expected exactly one series, got {n} (aggregate it, e.g. sum(...))")
        else:
            raise ValueError(f"expected a {'vector' if label else 'scalar or a vector'} result, got {kind!r}")
        out = []
        for name, sample in samples:
            try:
                v = float(sample[1])
            except (TypeError, ValueError, IndexError):
                raise ValueError(f"malformed sample {sample!r}") from None
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"value {v} is not a finite number >= 0")
            out.append((name, v))
        return out


def _label(series: Any, label: str) -> str | None:
    """The series' value of ``label``, None when it lacks it."""
    metric = series.get("metric") if isinstance(series, dict) else None
    name = metric.get(label) if isinstance(metric, dict) else None
    return name if isinstance(name, str) else None


DEMAND_WAIT_S = 0.1
"""The most the reconcile loop waits on a demand source that asks a server (seconds)."""


class BackgroundDemand:
    """``source`` (one that asks a server) asked on a thread of its own, one question at a time, so the
    reconcile loop never waits longer than ``wait_s``: a late answer is used while no older than
    ``max_age_s`` (the caller's time), else demand is unknown (NaN, as when the source raises)."""

    def __init__(self, source: DemandSource, wait_s: float = DEMAND_WAIT_S, max_age_s: float = 60.0) -> None:
        if not wait_s >= 0 or not max_age_s >= 0:
            raise ValueError("serving demand: demand_wait_s and demand_max_age_s must be >= 0")
        self.source, self.wait_s, self.max_age_s = source, float(wait_s), float(max_age_s)
        self._lock = threading.Lock()
        self._latest: tuple[float, float] | None = None  # (asked for now_s, value) of the newest answer
        self.fetching: threading.Thread | None = None

    def clients_at(self, now_s: float) -> np.ndarray | None:
        """The source's per-client answer behind the newest value, when that value is the one in use."""
        with self._lock:
            got = self._latest
        if got is None or not abs(now_s - got[0]) <= self.max_age_s:
            return None
        return client_demand(self.source, got[0])

    def demand_gpus(self, now_s: float) -> float:
        if self.fetching is None or not self.fetching.is_alive():
            self.fetching = threading.Thread(target=self._fetch, args=(now_s,), daemon=True,
                                             name="tidal-serving-demand")
            self.fetching.start()
        self.fetching.join(self.wait_s)
        with self._lock:
            got = self._latest
        if got is None or not abs(now_s - got[0]) <= self.max_age_s:
            if self.fetching.is_alive():
                log.warning("serving demand unknown: the source has not answered within %g s", self.wait_s)
            return math.nan
        return got[1]

    def _fetch(self, now_s: float) -> None:
        try:
            v = float(self.source.demand_gpus(now_s))
        except Exception as e:  # a source that raises is unknown demand, never zero
            log.warning("serving demand unknown: %s", e)
            v = math.nan
        with self._lock:
            self._latest = (now_s, v if math.isfinite(v) and v >= 0 else math.nan)

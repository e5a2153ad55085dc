"""Request rates to servers: the Erlang C (M/M/c) queue. Pure: no I/O, no clock.

Poisson arrivals at ``rate`` requests/s, ``c`` servers of exponential service at ``service_rate``, one
FCFS queue. A latency target ("the ``quantile``-quantile of the wait, or of the response time, is at
most ``target_s``") is ``P(measure > target_s) <= 1 - quantile``; :func:`servers_needed` returns the
smallest ``c`` that meets it. Erlang B by its recursion ``B(k) = a B(k-1) / (k + a B(k-1))``, started
``10 sqrt(a)`` below the load from ``B = 1`` (the error contracts below double precision), so millions
of servers cost ``O(sqrt(a))`` steps. Functions take numpy arrays and broadcast (docs/loaning.md).
"""

from __future__ import annotations

import math

import numpy as np

MEASURES = ("queue", "response")
_START_SIGMAS = 10.0  # start the Erlang B recursion this many sqrt(a) below a (see the module docstring)
MAX_SERVERS = 10_000_000  # servers_needed gives up (ValueError) beyond this many servers


def _start(a: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
    """Where the recursion for B(c, a) may start from B = 1: ``min(c, a) - 10 sqrt(a)``, at least 0."""
    top = a if c is None else np.minimum(a, c)
    return np.maximum(0.0, np.floor(top - _START_SIGMAS * np.sqrt(a))).astype(np.int64)


def _check_rates(rate: np.ndarray, service_rate: np.ndarray) -> None:
    if np.any(~(rate >= 0) & ~np.isnan(rate)) or np.any(np.isinf(rate)):
        raise ValueError("rate must be finite and >= 0 (requests/s)")
    if not np.all(service_rate > 0) or not np.all(np.isfinite(service_rate)):
        raise ValueError("service_rate must be finite and > 0 (requests/s per server)")


def erlang_b(servers, load):
    """Erlang B: P(all ``servers`` busy) in an M/M/c/c loss system with offered ``load`` (Erlangs)."""
    c, a = np.broadcast_arrays(np.asarray(servers, dtype=np.int64), np.asarray(load, dtype=float))
    if np.any(c < 0) or not np.all(a >= 0) or not np.all(np.isfinite(a)):
        raise ValueError("erlang_b needs servers >= 0 and a finite load >= 0")
    shape, c, a = c.shape, c.ravel(), a.ravel()
    if np.any(a > MAX_SERVERS):
        raise ValueError(f"erlang_b: load above {MAX_SERVERS} Erlangs")
    k = _start(a, c)
    b = np.ones(a.shape)
    while True:
        todo = k < c
        if not todo.any():
            break
        k = k + todo
        b = np.where(todo, a * b / (k + a * b), b)
    out = b.reshape(shape)
    return float(out) if out.ndim == 0 else out


def _c_from_b(b: np.ndarray, c: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Erlang C from Erlang B where ``c > a`` (1 elsewhere: the queue is unstable)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = c * b / (c - a * (1.0 - b))
    return np.where(c > a, np.minimum(out, 1.0), 1.0)


def erlang_c(servers, load):
    """Erlang C: P(an arriving request waits) in M/M/c with offered ``load`` (Erlangs); 1 when ``c <= a``."""
    c, a = np.broadcast_arrays(np.asarray(servers, dtype=np.int64), np.asarray(load, dtype=float))
    out = _c_from_b(np.asarray(erlang_b(c, a)), c, a)
    return float(out) if out.ndim == 0 else out


def _phi(x: np.ndarray) -> np.ndarray:
    """(1 - exp(-x)) / x for x >= 0, 1 at 0, without cancellation."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 1e-12, -np.expm1(-x) / np.where(x > 0, x, 1.0), 1.0 - x / 2)


def _tail(c, lam, mu, t, measure: str, erl_c: np.ndarray | None = None) -> np.ndarray:
    """P(measure > t) for stable rows (``c mu > lam``); ``erl_c`` if already known."""
    theta = c * mu - lam
    cw = erlang_c(c, lam / mu) if erl_c is None else erl_c
    if measure == "queue":
        return cw * np.exp(-theta * t)
    # P(Exp(theta) + Exp(mu) > t) = (theta e^{-mu t} - mu e^{-theta t}) / (theta - mu), symmetric in the
    # two rates: with m = min, d = |difference| it is e^{-m t} (1 + m t phi(d t)), stable as d -> 0.
    m, d = np.minimum(theta, mu), np.abs(theta - mu)
    return (1.0 - cw) * np.exp(-mu * t) + cw * np.exp(-m * t) * (1.0 + m * t * _phi(d * t))


def latency_exceeds(servers, rate, service_rate, t_s, measure: str = "queue"):
    """P(``measure`` > ``t_s``) in M/M/c, ``measure`` "queue" (waiting time) or "response" (waiting +
    service); 1 where the queue is unstable (``c mu <= lambda``)."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    c, lam, mu, t = np.broadcast_arrays(np.asarray(servers, dtype=np.int64), np.asarray(rate, dtype=float),
                                        np.asarray(service_rate, dtype=float), np.asarray(t_s, dtype=float))
    _check_rates(lam, mu)
    if not np.all(t >= 0):
        raise ValueError("t_s must be >= 0")
    stable = c * mu - lam > 0
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.where(stable, _tail(c, lam, mu, t, measure), np.where(np.isnan(lam), np.nan, 1.0))
    return float(out) if out.ndim == 0 else out


def check_target(service_rate: float, target_s: float, quantile: float, measure: str) -> None:
    """``ValueError`` naming the setting when no number of servers can meet the target."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if not (isinstance(quantile, int | float) and 0 < quantile < 1):
        raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
    if not (isinstance(target_s, int | float) and math.isfinite(target_s) and target_s >= 0):
        raise ValueError(f"target_s must be a finite number >= 0, got {target_s!r}")
    if not (isinstance(service_rate, int | float) and math.isfinite(service_rate) and service_rate > 0):
        raise ValueError(f"service_rate must be a finite number > 0, got {service_rate!r}")
    if measure == "response" and math.exp(-service_rate * target_s) > 1 - quantile:
        floor_s = -math.log1p(-quantile) / service_rate
        raise ValueError(f"target_s {target_s:g} s is below the {quantile:g}-quantile of one request's own "
                         f"service time ({floor_s:.4g} s at {service_rate:g} requests/s): no number of "
                         "servers meets it")


def servers_needed(rate, service_rate: float, target_s: float, quantile: float = 0.99,
                   measure: str = "queue", max_servers: int = MAX_SERVERS):
    """The smallest ``c`` with ``c * service_rate > rate`` meeting the target (0 for a rate of 0, NaN for
    NaN); ``rate`` may be an array. ``ValueError`` for a target no ``c`` up to ``max_servers`` meets."""
    check_target(service_rate, target_s, quantile, measure)
    lam = np.asarray(rate, dtype=float)
    _check_rates(lam, np.asarray(service_rate, dtype=float))
    shape, lam = lam.shape, lam.ravel()
    known = ~np.isnan(lam)
    with np.errstate(over="ignore"):
        a = np.where(known, lam, 0.0) / service_rate
    if np.any(a >= max_servers):
        raise ValueError(f"the target needs more than {max_servers} servers at a rate of "
                         f"{float(np.max(lam[known])):g} requests/s")
    k = _start(a)
    b = np.ones(a.shape)
    eps = 1.0 - quantile
    found = np.where(known & (lam > 0), -1, 0).astype(np.int64)
    while True:
        todo = found < 0
        if not todo.any():
            break
        stable = todo & (k * service_rate - lam > 0)
        if stable.any():
            ks, ls = k[stable], lam[stable]
            with np.errstate(over="ignore", invalid="ignore"):
                p = _tail(ks, ls, service_rate, target_s, measure, _c_from_b(b[stable], ks, a[stable]))
            ok = np.zeros(a.shape, bool)
            ok[stable] = p <= eps
            found = np.where(ok, k, found)
        if int(k[todo].max()) >= max_servers:
            raise ValueError(f"the target needs more than {max_servers} servers at a rate of "
                             f"{float(lam[found < 0].max()):g} requests/s")
        k = k + 1
        b = a * b / (k + a * b)
    out = np.where(known, found.astype(float), np.nan).reshape(shape)
    return float(out) if out.ndim == 0 else out


def gpus_needed(rate, service_rate: float, target_s: float, quantile: float = 0.99, measure: str = "queue",
                gpus_per_replica: int = 1):
    """GPUs serving needs at ``rate`` requests/s: :func:`servers_needed` replicas (each a server completing
    ``service_rate`` requests/s) times ``gpus_per_replica``. NaN rates give NaN."""
    if not isinstance(gpus_per_replica, int) or isinstance(gpus_per_replica, bool) or gpus_per_replica < 1:
        raise ValueError(f"gpus_per_replica must be a whole number >= 1, got {gpus_per_replica!r}")
    return servers_needed(rate, service_rate, target_s, quantile, measure) * gpus_per_replica

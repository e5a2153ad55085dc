"""Erlang C (tidal.policy.queueing): textbook values, an independent log-space reference for thousands of
servers, properties (hypothesis), and a seeded discrete-event M/M/c simulation."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.policy import queueing as q
from tidal.policy.queueing import (
    erlang_b,
    erlang_c,
    gpus_needed,
    latency_exceeds,
    servers_needed,
)

# Erlang B and C tables (teletraffic / call-centre handbooks), to the digits they print.
TABLE_B = [(1, 1.0, 0.5), (5, 3.0, 0.1101), (10, 5.0, 0.01838), (20, 15.0, 0.04559), (100, 80.0, 0.003992)]
TABLE_C = [(2, 1.0, 1 / 3), (5, 4.0, 0.5541), (10, 8.0, 0.4092), (11, 10.0, 0.6821), (14, 10.0, 0.1741)]


@pytest.mark.parametrize(("c", "a", "want"), TABLE_B)
def test_erlang_b_table(c, a, want):
    assert erlang_b(c, a) == pytest.approx(want, rel=5e-4)


@pytest.mark.parametrize(("c", "a", "want"), TABLE_C)
def test_erlang_c_table(c, a, want):
    assert erlang_c(c, a) == pytest.approx(want, rel=5e-4)


def _log_erlang_b(c: int, a: float) -> float:
    """log B(c, a) = log P(N = c) - log P(N <= c), N ~ Poisson(a): an independent log-space reference."""
    logs = [k * math.log(a) - a - math.lgamma(k + 1) for k in range(c + 1)]
    top = max(logs)
    return logs[c] - (top + math.log(sum(math.exp(x - top) for x in logs)))


@pytest.mark.parametrize("a", [150.0, 1234.5, 5000.0, 20000.0])
def test_large_loads_match_log_space_reference(a):
    """Thousands of servers: the shortened recursion agrees with the log-space sum to ~1e-12."""
    cs = [
        int(a / 3),
        int(a - 10 * math.sqrt(a)) + 1,
        int(a - 3 * math.sqrt(a)),
        int(a),
        int(a + 2 * math.sqrt(a)),
        int(a + 6 * math.sqrt(a)),
    ]
    got = erlang_b(cs, a)
    want = np.exp([_log_erlang_b(c, a) for c in cs])
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert np.all(np.isfinite(erlang_c(cs, a)))


def test_shortened_recursion_equals_full(monkeypatch):
    a = np.array([0.0, 0.3, 99.0, 150.0, 900.0, 4321.0])
    c = np.ceil(a + 2 * np.sqrt(a) + 1).astype(int)
    fast = erlang_b(c, a)
    monkeypatch.setattr(q, "_START_SIGMAS", 1e12)  # start every recursion at 0
    np.testing.assert_allclose(fast, erlang_b(c, a), rtol=1e-12)


def test_unstable_and_edge_cases():
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(2, 5.0) == 1.0
    assert latency_exceeds(2, 5.0, 1.0, 10.0) == 1.0
    assert erlang_b(0, 2.0) == 1.0 and erlang_b(4, 0.0) == 0.0
    assert servers_needed(0.0, 1.0, 0.1) == 0
    assert math.isnan(servers_needed(math.nan, 1.0, 0.1))
    assert np.isnan(gpus_needed(np.array([math.nan, 1.0]), 1.0, 0.1)[0])


def test_bad_arguments_say_which():
    with pytest.raises(ValueError, match="one request's own service time"):
        servers_needed(10.0, 1.0, 0.5, 0.99, "response")  # p99 of Exp(1) alone is 4.6 s
    with pytest.raises(ValueError, match="quantile"):
        servers_needed(10.0, 1.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="measure"):
        servers_needed(10.0, 1.0, 0.5, 0.9, "ttft")
    with pytest.raises(ValueError, match="rate must be finite and >= 0"):
        servers_needed(np.array([1.0, -2.0]), 1.0, 0.5)
    with pytest.raises(ValueError, match="service_rate"):
        servers_needed(1.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="gpus_per_replica"):
        gpus_needed(1.0, 1.0, 0.5, gpus_per_replica=0)
    with pytest.raises(ValueError, match="more than 100 servers"):
        servers_needed(1000.0, 1.0, 0.5, max_servers=100)
    with pytest.raises(ValueError, match="more than 100 servers"):
        servers_needed(95.0, 1.0, 0.0, 0.9999, max_servers=100)
    with pytest.raises(ValueError, match="servers at a rate of 1e"):  # no overflow, no hang
        servers_needed(np.array([1.0, 1e300]), 1e-300, 0.5)


def test_vectorised_equals_scalar_and_large_pool():
    rates = np.array([0.0, 0.5, 3.0, 47.0, 250.0, 1800.0, 9000.0])
    many = servers_needed(rates, 2.0, 0.05, 0.999)
    assert list(many) == [servers_needed(float(r), 2.0, 0.05, 0.999) for r in rates]
    assert gpus_needed(rates, 2.0, 0.05, 0.999, gpus_per_replica=8).tolist() == (many * 8).tolist()
    # a million requests/s at one per second per server: ~1e6 + a few sqrt(a) servers, not a hang
    big = servers_needed(1e6, 1.0, 0.0, 0.99)
    assert 1e6 < big < 1e6 + 4 * 1000


loads = st.floats(0.0, 3000.0)
service = st.floats(0.05, 50.0)
quantiles = st.floats(0.5, 0.9999)


def _response_target(mu: float, p: float, factor: float) -> float:
    return factor * -math.log1p(-p) / mu


@settings(max_examples=60, deadline=None)
@given(a1=loads, a2=loads, mu=service, t=st.floats(0.0, 5.0), p=quantiles,
       measure=st.sampled_from(q.MEASURES), factor=st.floats(1.01, 10.0))
def test_monotone_in_rate_stable_and_minimal(a1, a2, mu, t, p, measure, factor):
    if measure == "response":
        t = _response_target(mu, p, factor)
    lo, hi = sorted((a1 * mu, a2 * mu))
    n_lo, n_hi = servers_needed(lo, mu, t, p, measure), servers_needed(hi, mu, t, p, measure)
    assert n_lo <= n_hi
    for lam, n in ((lo, n_lo), (hi, n_hi)):
        if lam == 0:
            assert n == 0
            continue
        assert n * mu > lam  # stable
        assert latency_exceeds(int(n), lam, mu, t, measure) <= 1 - p  # meets the target
        if (n - 1) * mu > lam:  # one fewer would not
            assert latency_exceeds(int(n) - 1, lam, mu, t, measure) > 1 - p


@settings(max_examples=60, deadline=None)
@given(a=loads, mu=service, t1=st.floats(0.0, 5.0), t2=st.floats(0.0, 5.0), p1=quantiles, p2=quantiles)
def test_monotone_in_target(a, mu, t1, t2, p1, p2):
    lam = a * mu
    lo_t, hi_t = sorted((t1, t2))
    lo_p, hi_p = sorted((p1, p2))
    assert servers_needed(lam, mu, hi_t, lo_p) <= servers_needed(lam, mu, lo_t, lo_p)
    assert servers_needed(lam, mu, lo_t, lo_p) <= servers_needed(lam, mu, lo_t, hi_p)
    # a response-time target is never cheaper than the same queue-time target
    t = _response_target(mu, lo_p, 1.5)
    assert servers_needed(lam, mu, t, lo_p, "queue") <= servers_needed(lam, mu, t, lo_p, "response")


def simulate_mmc(c: int, lam: float, mu: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """FCFS M/M/c, event by event: each arrival takes the server that frees first. (waits, services)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / lam, n))
    services = rng.exponential(1 / mu, n)
    free = [0.0] * c
    waits = np.empty(n)
    for i in range(n):
        start = max(heapq.heappop(free), arrivals[i])
        waits[i] = start - arrivals[i]
        heapq.heappush(free, start + services[i])
    return waits, services


def _batch_mean(x: np.ndarray, batches: int = 20) -> tuple[float, float]:
    """Mean and its standard error by batch means (the samples are correlated)."""
    means = np.array([b.mean() for b in np.array_split(x, batches)])
    return float(means.mean()), float(means.std(ddof=1) / math.sqrt(batches))


@pytest.mark.parametrize(("c", "lam", "mu", "seed"), [(1, 0.7, 1.0, 1), (4, 3.0, 1.0, 2), (40, 72.0, 2.0, 3)])
def test_agrees_with_simulation(c, lam, mu, seed):
    """Within 4 standard errors (batch means; ~1e-3 absolute for 190k requests): tight enough that a
    10 % error in the decay rate c mu - lambda fails (4-7 standard errors at these points)."""
    waits, services = simulate_mmc(c, lam, mu, 200_000, seed)
    waits, services = waits[10_000:], services[10_000:]  # warm-up
    t = 1.5 / (c * mu - lam)
    for sample, want in ((waits > 0, erlang_c(c, lam / mu)), (waits > t, latency_exceeds(c, lam, mu, t)),
                         (waits + services > t + 1 / mu,
                          latency_exceeds(c, lam, mu, t + 1 / mu, "response"))):
        got, se = _batch_mean(sample.astype(float))
        assert abs(got - want) < 4 * se + 1e-3, (got, want, se)


def test_servers_needed_holds_in_simulation():
    """At the c it returns the simulated p95 wait meets the target; one server fewer it does not (a point
    where the model puts c and c - 1 well apart: P(W > t) = 0.021 and 0.077 against 0.05)."""
    lam, mu, t, p = 20.0, 1.0, 1.0, 0.95
    c = int(servers_needed(lam, mu, t, p))
    for servers, meets in ((c, True), (c - 1, False)):
        waits, _ = simulate_mmc(servers, lam, mu, 150_000, 7)
        got = float(np.quantile(waits[10_000:], p))
        assert (got <= t) == meets, (servers, got)
    assert c == 23

"""Per-tenant submission limits (``submit_rate_per_s`` with ``submit_burst``, ``max_queued_jobs`` in the
plane's config): a burst from one tenant is refused at the API with 429 and the reason, nothing stored,
instead of slowing the loop for everyone. The admin is not limited. Thread-safe (the API's workers): the
submissions of one tenant in flight count toward its cap until they are stored, so concurrent requests never
pass it together. And the count of a tenant's checkpoint bytes its submissions are checked against
(``checkpoint_quota_bytes``, :class:`QuotaMeter`)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from tidal.control.locations import QUOTA_CHECK_S, QUOTA_RECHECK_S, quota_use


class TenantLocks:
    """One lock per tenant, made on first use (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def __call__(self, tenant: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(tenant, threading.Lock())


class SubmitLimits:
    """A token bucket per tenant (``rate_per_s`` tokens a second, ``burst`` at most; 0: no rate limit) and a
    cap on a tenant's pending jobs (``max_queued``; 0: none)."""

    def __init__(self, rate_per_s: float = 0.0, burst: float = 0.0, max_queued: int = 0) -> None:
        self.rate_per_s, self.burst, self.max_queued = rate_per_s, max(burst, 1.0), max_queued
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when counted)
        self._lock = threading.Lock()
        self._tenant_lock = TenantLocks()  # held while a tenant's cap is checked
        self._in_flight: dict[str, int] = {}  # tenant -> submissions admitted and not yet stored

    @contextmanager
    def admit(self, tenant: str, queued: Callable[[], int], now_s: float
              ) -> Iterator[tuple[str, float] | None]:
        """Why ``tenant`` may not submit now and in how many seconds to retry; None: it may (a token is
        spent), and until the block ends (the submission stored, or refused for another reason) it counts
        toward the tenant's cap. ``queued()``: the tenant's pending jobs, every stored submission counted."""
        no = self._refuse(tenant, queued, now_s)
        try:
            yield no
        finally:
            if no is None and self.max_queued:
                with self._lock:
                    n = self._in_flight[tenant] - 1
                    if n:
                        self._in_flight[tenant] = n
                    else:
                        del self._in_flight[tenant]

    def _refuse(self, tenant: str, queued: Callable[[], int], now_s: float) -> tuple[str, float] | None:
        if self.max_queued:
            # (a submission leaves the in-flight count only once stored: queued() then has it)
            with self._tenant_lock(tenant):
                n = queued() + self._in_flight.get(tenant, 0)
                if n >= self.max_queued:
                    return (f"tenant {tenant} has {n} jobs waiting, the most it may queue (max_queued_jobs = "
                            f"{self.max_queued}): submit again once some have started", 30.0)
                no = self._spend(tenant, now_s)
                if no is None:
                    with self._lock:
                        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
                return no
        return self._spend(tenant, now_s)

    def _spend(self, tenant: str, now_s: float) -> tuple[str, float] | None:
        """The rate limit: a token spent, or why not."""
        if not self.rate_per_s:
            return None
        with self._lock:
            tokens, then = self._buckets.get(tenant, (self.burst, now_s))
            tokens = min(self.burst, tokens + (now_s - then) * self.rate_per_s)
            if tokens < 1.0:
                self._buckets[tenant] = (tokens, now_s)
                wait_s = (1.0 - tokens) / self.rate_per_s
                return (f"tenant {tenant} submits faster than {self.rate_per_s:g} jobs a second (burst "
                        f"{self.burst:g}; submit_rate_per_s): retry in {math.ceil(wait_s)} s", wait_s)
            self._buckets[tenant] = (tokens - 1.0, now_s)
        return None


class QuotaMeter:
    """A tenant's checkpoint bytes for the submission check (:func:`quota_use` over ``homes(tenant)``):
    counted again at most every :data:`QUOTA_CHECK_S` while under its quota and every
    :data:`QUOTA_RECHECK_S` once at or over it (a tenant that removed checkpoints waits seconds, not a
    minute), one count at a time per tenant, shared by the submissions waiting for it. A count walks the
    directories of every job the tenant has: a submission would otherwise cost O(its jobs)."""

    def __init__(self, homes: Callable[[str], Iterable[tuple[str, str]]],
                 quota: Callable[[str], int | None]) -> None:
        self._homes, self._quota = homes, quota
        self._tenant_lock = TenantLocks()
        self._counted: dict[str, tuple[int, float]] = {}  # tenant -> (bytes, when counted)

    def used(self, tenant: str, now_s: float) -> int:
        """``tenant``'s bytes, as counted at most :data:`QUOTA_CHECK_S` ago (0 without a quota)."""
        q = self._quota(tenant)
        if q is None:
            return 0
        with self._tenant_lock(tenant):  # (those waiting here find the count just made)
            got = self._counted.get(tenant)
            if got is not None:
                used, at = got
                if 0 <= now_s - at < (QUOTA_RECHECK_S if used >= q else QUOTA_CHECK_S):
                    return used
            used = quota_use(self._homes(tenant), self._quota).get(tenant, (0, q))[0]
            self._counted[tenant] = (used, now_s)
            return used

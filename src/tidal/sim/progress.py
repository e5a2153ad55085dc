"""One job's training timeline between two changes, in closed form: progress, checkpoints, durability.

A :class:`Segment` runs from one change (admission, resize, failure, new interval) to the next: it
trains from ``t0`` at ``rate``, every ``tau_s`` stalls ``stall_s`` for a capture that is durable
``lag_s`` after it completes, and stops at ``stop_s``; any question about a time inside it is arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar, cast

import numpy as np

K = TypeVar("K", bound=Hashable)

EPS = 1e-9


class Segment:
    """A job's training timeline from ``t0``; immutable by convention. ``dur_p`` / ``dur_ct``: progress and
    capture time of the newest checkpoint durable when it began; ``pend_*``: one still being persisted
    then (durable at ``pend_t``; ``inf`` if none)."""

    __slots__ = ("t0", "p0", "rate", "tau", "stall", "lag", "stop", "dur_p", "dur_ct", "pend_t", "pend_p",
                 "pend_ct")

    def __init__(self, t0: float, p0: float, rate: float, tau_s: float, stall_s: float, lag_s: float,
                 dur_p: float, dur_ct: float, pend: tuple[float, float, float] | None = None,
                 stop_s: float = math.inf) -> None:
        if rate <= 0:
            raise ValueError(f"Segment: rate must be > 0, got {rate}")
        self.t0, self.p0, self.rate = t0, p0, rate
        self.stall = max(0.0, stall_s)
        self.tau = max(tau_s, self.stall + 1.0)  # a period must leave some training
        self.lag = max(0.0, lag_s)
        self.stop = stop_s
        self.dur_p, self.dur_ct = dur_p, dur_ct
        if pend is None:
            self.pend_t, self.pend_p, self.pend_ct = math.inf, dur_p, dur_ct
        else:
            self.pend_t, self.pend_p, self.pend_ct = pend

    def stopped_at(self, stop_s: float) -> Segment:
        """This segment, ending at ``stop_s`` (as built again with ``stop_s``)."""
        out = object.__new__(Segment)
        for name in Segment.__slots__:
            setattr(out, name, getattr(self, name))
        out.stop = stop_s
        if out.pend_t == math.inf:
            out.pend_p, out.pend_ct = out.dur_p, out.dur_ct
        return out

    def row(self) -> tuple[float, ...]:
        """The segment's fields in ``__slots__`` order (a row of :class:`DurableTable`)."""
        return (self.t0, self.p0, self.rate, self.tau, self.stall, self.lag, self.stop, self.dur_p,
                self.dur_ct, self.pend_t, self.pend_p, self.pend_ct)

    def at(self, t: float) -> float:
        """Progress (GPU-seconds of work) reached at ``t``."""
        e = min(t, self.stop) - self.t0
        if e <= 0:
            return self.p0
        c = self.tau - self.stall
        k = math.floor(e / self.tau)
        return self.p0 + self.rate * (k * c + min(e - k * self.tau, c))

    def finish_s(self, work: float) -> float:
        """When progress reaches ``work`` (``inf`` if not before ``stop``)."""
        need = work - self.p0
        if need <= EPS:
            return self.t0
        c = self.tau - self.stall
        trained = need / self.rate
        k = max(0, math.ceil(trained / c - EPS) - 1)
        t = self.t0 + k * self.tau + (trained - k * c)
        return t if t <= self.stop + EPS else math.inf

    def _last_capture(self, t: float) -> int:
        """Index of the newest periodic capture durable at ``t`` (-1: none)."""
        c = self.tau - self.stall
        k = math.floor((t - self.lag - self.t0) / self.tau + EPS) - 1
        if self.stop < math.inf:
            k = min(k, math.floor((self.stop - self.t0 - c) / self.tau + EPS))
        return k

    def durable(self, t: float) -> tuple[float, float]:
        """(progress, capture time) of the newest checkpoint durable at ``t``: what a failure keeps."""
        p, ct = self.dur_p, self.dur_ct
        if self.pend_t <= t + EPS and self.pend_p >= p:
            p, ct = self.pend_p, self.pend_ct
        k = self._last_capture(t)
        if k >= 0:
            q = self.p0 + self.rate * (k + 1) * (self.tau - self.stall)
            if q >= p:
                p, ct = q, self.t0 + k * self.tau + (self.tau - self.stall)
        return p, ct

    def in_flight(self, t: float) -> tuple[float, float, float] | None:
        """The newest capture complete at ``t`` but not yet durable: (durable at, progress, capture time)."""
        if self.lag <= 0:
            return None
        c = self.tau - self.stall
        k = math.floor((t - self.t0) / self.tau + EPS) - 1  # newest capture complete at t
        if self.stop < math.inf:
            k = min(k, math.floor((self.stop - self.t0 - c) / self.tau + EPS))
        if k >= 0:
            dt = self.t0 + (k + 1) * self.tau + self.lag
            if dt > t + EPS:
                return dt, self.p0 + self.rate * (k + 1) * c, self.t0 + k * self.tau + c
        if self.pend_t > t + EPS and self.pend_t < math.inf:
            return self.pend_t, self.pend_p, self.pend_ct
        return None

    def next_durable_s(self, t: float) -> float:
        """The first time after ``t`` at which :meth:`durable` changes (``inf``: never in this segment)."""
        nxt = self.pend_t if self.pend_t > t + EPS else math.inf
        k = self._last_capture(t) + 1
        c = self.tau - self.stall
        if self.stop == math.inf or self.t0 + k * self.tau + c <= self.stop + EPS:
            nxt = min(nxt, self.t0 + (k + 1) * self.tau + self.lag)
        return nxt

    def rebased(self, now: float, *, p0: float, start_s: float, rate: float, tau_s: float,
                capture: tuple[float, float, float] | None = None, stop_s: float = math.inf) -> Segment:
        """The segment after this one at ``now``, resuming at ``start_s`` from ``p0``; durable and in-flight
        checkpoints carry over, ``capture`` adds one ``(durable at, progress, capture time)``."""
        dur_p, dur_ct = self.durable(now)
        pend = self.in_flight(now)
        if capture is not None:
            if capture[0] <= now + EPS:
                if capture[1] >= dur_p:
                    dur_p, dur_ct = capture[1], capture[2]
            elif pend is None or capture[1] >= pend[1]:
                pend = capture
        if pend is not None and pend[1] > p0 + EPS:  # rolled back (a failure): the write in flight is lost
            pend = None
        if dur_p > p0 + EPS:
            dur_p = p0
        return Segment(start_s, p0, rate, tau_s, self.stall, self.lag, dur_p, dur_ct, pend, stop_s)


class DurableTable(Generic[K]):
    """The newest durable checkpoint of many segments at once: one row per key (a job), its
    :class:`Segment`'s parameters and ``due``, from when its answer may have changed; :meth:`refresh`
    answers the due rows with :func:`durable_times_and_next` and moves ``due`` on."""

    def __init__(self, end_s: float) -> None:
        self.end_s = end_s
        self.rows = np.zeros((0, 12))  # Segment.row()
        self.due = np.zeros(0)
        self.slot: dict[K, int] = {}
        self.keys: list[K | None] = []
        self.free: list[int] = []

    def set(self, key: K, seg: Segment, due: float) -> None:
        """``key``'s segment from now on, first answered at ``due`` (``inf`` if not before ``end_s``)."""
        i = self.slot.get(key)
        if i is None:
            if not self.free:
                n = len(self.keys)
                grow = max(64, n)
                self.rows = np.vstack([self.rows, np.zeros((grow, 12))])
                self.due = np.concatenate([self.due, np.full(grow, math.inf)])
                self.keys += [None] * grow
                self.free = list(range(n + grow - 1, n - 1, -1))
            i = self.free.pop()
            self.slot[key] = i
            self.keys[i] = key
        self.rows[i] = seg.row()
        self.due[i] = due if due < self.end_s else math.inf

    def drop(self, key: K) -> None:
        """``key`` has no segment any more."""
        i = self.slot.pop(key, None)
        if i is not None:
            self.due[i] = math.inf
            self.keys[i] = None
            self.free.append(i)

    def refresh(self, now: float) -> tuple[list[K], list[float]]:
        """The keys due at ``now`` and the capture time of their newest durable checkpoint then."""
        idx = np.flatnonzero(self.due <= now)
        if idx.size == 0:
            return [], []
        ct, nxt = durable_times_and_next(self.rows[idx].T, now)
        self.due[idx] = np.where(nxt < self.end_s, nxt, math.inf)
        keys = self.keys  # (a due row holds a key: a dropped one is never due)
        return cast("list[K]", [keys[i] for i in idx.tolist()]), ct.tolist()


def durable_times_and_next(rows: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """(``Segment.durable(t)[1]``, ``Segment.next_durable_s(t)``) for the segments in ``rows`` (columns of
    :meth:`Segment.row`), with the same floating-point operations."""
    t0, p0, rate, tau, stall, lag, stop, dur_p, dur_ct, pend_t, pend_p, pend_ct = rows
    c = tau - stall
    k = np.floor((t - lag - t0) / tau + EPS) - 1  # _last_capture
    finite = stop < math.inf
    if finite.any():
        with np.errstate(invalid="ignore"):
            k = np.where(finite, np.minimum(k, np.floor((stop - t0 - c) / tau + EPS)), k)
    pend = (pend_t <= t + EPS) & (pend_p >= dur_p)
    p = np.where(pend, pend_p, dur_p)
    ct = np.where(pend, pend_ct, dur_ct)
    ct = np.where((k >= 0) & (p0 + rate * (k + 1) * c >= p), t0 + k * tau + c, ct)
    nxt = np.where(pend_t > t + EPS, pend_t, math.inf)
    ok = ~finite | (t0 + (k + 1) * tau + c <= stop + EPS)
    nxt = np.where(ok, np.minimum(nxt, t0 + (k + 2) * tau + lag), nxt)
    return ct, nxt

"""The pool as the reconcile loop left it after its newest step, for the API's pool reads and ``/metrics``.

At pool scale (thousands of nodes, ~20,000 waiting jobs) a pool read that queries the store (the jobs holding
GPUs, the waiting jobs counted per tenant, the head of the queue) and builds its answer costs tens of
milliseconds, in the interpreter the loop shares. The loop already holds every active job in memory, so after
each step it publishes a :class:`PlaneView`: an immutable copy of what those reads need (as Kubernetes' API
serves reads from its watch cache). ``GET /v1/pool``, ``GET /v1/dashboard/pool`` and ``GET /metrics`` serve
it without touching the database, and each part of an answer that only the view decides (a page of nodes, a
viewer's GPU map, the per-job series) is built once per view, by its first reader, and kept with it.

How fresh: a view is as of the end of its step (``as_of_s``, ``step``), the store's state then, every write
of the step committed; the loop steps every ``loop_interval_s`` (0.5 s). Jobs submitted since the loop last
read the store are added to the counts of waiting jobs (:meth:`PlaneView.waiting_counts`), so a job submitted
is counted in the next read; it is placed in the queue shown at the next step. The parts asked of the
previous view are built by the loop itself right after it publishes a view, between steps, so a reader
reading at every step seldom builds one (:meth:`Published.warm`). A cancel of a waiting job takes
effect at the next step either way (the loop moves it). Why each job waits or does not grow (the scheduler's
own reasons, :attr:`PlaneView.waiting`; a waiting job it gave none waits behind its queue's first job,
:meth:`PlaneView.why`) is in the view only: the scheduler says it afresh at every step, and at 20,000
waiting jobs hundreds of reasons change at each (a queue's head with the GPUs free). Without a
loop (the API built on a store alone, as most tests do), or before its first step, the reads query the store
as before, and no job has a reason.
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidal.control.states import State
from tidal.control.store import HeldJob, JobRow, loaded
from tidal.model import KINDS, Node, QueueKey, Waiting
from tidal.policy.scheduler import queued_behind

T = TypeVar("T")
WAITING = (State.PENDING.value, State.BACKOFF.value)
QUEUE_SHOWN = 100  # waiting jobs at the head of the queue kept and shown by the dashboard (it counts all)
WARM_MAX = 16  # parts the loop builds after a step at most (the others: by their readers), the latest asked
MEMO_MAX = 256  # answers' parts kept per view (per viewer and page): a new view every step starts afresh


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A waiting job at the head of the queue, as :func:`tidal.control.dashboard_views.queue_view` reads
    it (the fields of a :class:`~tidal.control.store.JobRow` it uses, copied: the loop's rows change)."""

    id: str
    tenant: str
    kind: str
    priority: int
    state: str
    min_gpus: int
    max_gpus: int
    submit_s: float
    restarts: int
    max_restarts: int
    retry_at_s: float | None
    nominated_s: float | None
    waiting: Waiting | None  # the scheduler's reason at the step

    @classmethod
    def of(cls, j: JobRow, waiting: Waiting | None) -> QueuedJob:
        return cls(j.id, j.tenant, j.kind, j.priority, j.state, j.min_gpus, j.max_gpus, j.submit_s,
                   j.restarts, j.max_restarts, j.retry_at_s, j.nominated_s, waiting)


_HELD_FIELDS = ("id", "tenant", "state", "kind", "placement", "releasing", "restarts", "preemptions",
                "lost_s", "lost_steps", "held_s", "productive_s", "attempt_launched_s", "progress")


def held_job(j: JobRow) -> HeldJob:
    """The row of a job holding GPUs as :meth:`Store.held` reads it with its accounting (copied; its progress
    document the row's own, never changed in place: the loop replaces a job's document, it does not edit it).
    Its values are read from the row's loaded state (a row of the loop's is loaded whole: thousands a step,
    each attribute through SQLAlchemy's descriptor would cost as much as the rest)."""
    (jid, tenant, state, kind, placement, releasing, restarts, preemptions, lost_s, lost_steps, held_s,
     productive_s, launched_s, p) = loaded(j, _HELD_FIELDS)
    return HeldJob(jid, tenant, state, kind, dict(placement or {}), dict(releasing or {}), restarts,
                   preemptions, lost_s, lost_steps, held_s, productive_s, launched_s, progress=p or {})


def told(waiting: Mapping[str, Waiting], queued: frozenset[QueueKey], j: JobRow) -> Waiting | None:
    """Why ``j`` waits or does not grow by the scheduler's reasons at a step (``waiting``): its own, else,
    pending in one of the queues with jobs still waiting after the step (``queued``), behind its queue's
    first job (:func:`~tidal.policy.scheduler.queued_behind`: the scheduler names each queue's first job
    only); a job alone in its queue since has none until the next step."""
    w = waiting.get(j.id)
    if w is None and j.state == State.PENDING and (key := (j.tenant, j.kind, j.priority)) in queued:
        return queued_behind(*key)
    return w


def with_progress(h: HeldJob, j: JobRow) -> HeldJob:
    """``h`` (the copy of ``j`` in the view before) with ``j``'s progress now: for a job whose progress alone
    changed since (the rest is shared with that copy; a view's records are never changed)."""
    (p,) = loaded(j, ("progress",))
    return HeldJob(h.id, h.tenant, h.state, h.kind, h.placement, h.releasing, h.restarts, h.preemptions,
                   h.lost_s, h.lost_steps, h.held_s, h.productive_s, h.attempt_launched_s, progress=p or {})


def queue_order(kind: str, nominated_s: float | None, priority: int, queued_s: float, job_id: str
                ) -> tuple[bool, bool, int, float, str]:
    """The order of the queue shown (:meth:`Store.waiting_head`'s): dedicated first, nominated first, by
    priority, then when each joined its queue; within one of the scheduler's queues (tenant, kind, priority)
    that is its own order (:func:`tidal.model.arrival`)."""
    return (kind != "dedicated", nominated_s is None, -priority, queued_s, job_id)


@dataclass(frozen=True)
class PlaneView:
    """See the module docstring. ``nodes``: the pool's at the step; ``jobs``: (tenant, kind, state) ->
    active jobs; ``ended``: ended jobs per state (all tenants); ``head``: the first waiting jobs in
    :func:`queue_order`; ``submitted``: the store's submissions per (tenant, kind) that the loop had read
    (:attr:`Store.taken_submits`); ``loans``: the live loans' view at the step, if the plane lends
    (:meth:`tidal.control.loans.LiveLoans.view`); ``waiting``: job id -> why it waited or did not grow at
    the step (the scheduler's own reasons, ``schedule(..., why=)``: made afresh at every step, so kept
    nowhere else); ``queued``: the queues with jobs still waiting after the step (:meth:`why`)."""

    step: int
    as_of_s: float
    nodes: tuple[Node, ...]
    held: tuple[HeldJob, ...]
    jobs: Mapping[tuple[str, str, str], int]
    ended: Mapping[str, int]
    head: tuple[QueuedJob, ...]
    submitted: Mapping[tuple[str, str], int]
    loans: dict[str, Any] | None = None
    waiting: Mapping[str, Waiting] = field(default_factory=dict)
    queued: frozenset[QueueKey] = frozenset()
    wanted: dict[Any, tuple[Callable[[PlaneView], Any], int]] = field(default_factory=dict, repr=False,
                                                                     compare=False)
    """The parts asked for lately, shared from view to view (:meth:`Published.warm`)."""
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def why(self, j: JobRow) -> Waiting | None:
        """Why ``j`` waits or does not grow, as the scheduler said at the step (:func:`told`)."""
        return told(self.waiting, self.queued, j)

    def since(self, submitted: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        """(tenant, kind) -> jobs submitted after the loop read the store (``submitted``: the store's count
        now, :attr:`Store.submitted`)."""
        return {k: n - self.submitted.get(k, 0) for k, n in list(submitted.items())
                if n > self.submitted.get(k, 0)}

    def waiting_counts(self, submitted: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        """(tenant, kind) -> jobs pending or backing off (as :meth:`Store.count_waiting`), the jobs submitted
        since the step included."""
        out: Counter[tuple[str, str]] = Counter()
        for (tenant, kind, state), n in self.jobs.items():
            if state in WAITING:
                out[tenant, kind] += n
        out.update(self.since(submitted))
        return {k: n for k, n in out.items() if n}

    def pending(self, tenant: str, submitted: Mapping[tuple[str, str], int]) -> int:
        """``tenant``'s pending jobs (as :meth:`Store.count_by_state` counts them), those submitted since the
        step included; one started since the step still counts (at most that step's admissions more)."""
        return sum(self.jobs.get((tenant, kind, State.PENDING.value), 0)
                   + max(0, submitted.get((tenant, kind), 0) - self.submitted.get((tenant, kind), 0))
                   for kind in KINDS)

    def by_state(self, submitted: Mapping[tuple[str, str], int], tenant: str | None = None) -> dict[str, int]:
        """Jobs in each state (as :meth:`Store.count_by_state`; states without jobs absent); ended jobs are
        counted for all tenants only (``tenant`` None)."""
        out: Counter[str] = Counter()
        for (t, _, state), n in self.jobs.items():
            if tenant is None or t == tenant:
                out[state] += n
        out[State.PENDING.value] += sum(n for (t, _), n in self.since(submitted).items()
                                        if tenant is None or t == tenant)
        if tenant is None:
            out.update(self.ended)
        return {s: n for s, n in out.items() if n}

    def memo(self, key: Any, make: Callable[[PlaneView], T], *, warm: bool = True) -> T:
        """``make(self)`` once per view and key (a page of nodes for a viewer, the per-job series, ...): what
        it returns must depend on nothing but the view and the key. With ``warm``, the next views build it as
        soon as they are published while it is asked for in each (:meth:`Published.warm`)."""
        if warm:
            self.wanted.pop(key, None)  # (last: the latest asked)
            self.wanted[key] = (make, self.step)
        got = self._memo.get(key, _NONE)
        if got is _NONE:
            with self._lock:  # (one reader builds it; the others wait for it rather than build it too)
                got = self._memo.get(key, _NONE)
                if got is _NONE:
                    got = make(self)
                    if len(self._memo) < MEMO_MAX:
                        self._memo[key] = got
        return got

    def build(self, key: Any, make: Callable[[PlaneView], Any]) -> None:
        """Build the part ``key`` unless built (not counted as asked for)."""
        if key not in self._memo:
            with self._lock:
                if key not in self._memo and len(self._memo) < MEMO_MAX:
                    self._memo[key] = make(self)


_NONE = object()


def waiting_head(queues: Iterable[list[Any]], backoff: Iterable[JobRow], limit: int) -> list[tuple[Any, str]]:
    """The first ``limit`` waiting jobs in :func:`queue_order` as (order, job id): the scheduler's pending
    queues (each sorted in its arrival order, :class:`tidal.model.Job`) merged, with the jobs backing off."""
    def key(j: Any) -> tuple[bool, bool, int, float, str]:
        return queue_order(j.kind, j.nominated_s, j.priority, j.queued_s, j.id)

    merged = heapq.merge(*queues, key=key)
    first = [(key(j), j.id) for _, j in zip(range(limit), merged, strict=False)]
    others = [(queue_order(b.kind, b.nominated_s, b.priority, _queued_s(b), b.id), b.id) for b in backoff]
    return heapq.nsmallest(limit, first + others) if others else first


def _queued_s(j: JobRow) -> float:
    """:attr:`tidal.model.Job.queued_s` of a row."""
    lp = j.last_preempted_s
    return lp if lp is not None and lp > j.submit_s else j.submit_s


class Published:
    """The newest :class:`PlaneView` (None before the loop's first step); swapped whole, read without a
    lock. ``wanted``: the parts of answers asked for lately (key -> (builder, the step of the newest view
    it was asked of)), passed from view to view."""

    def __init__(self) -> None:
        self.view: PlaneView | None = None
        self.wanted: dict[Any, tuple[Callable[[PlaneView], Any], int]] = {}

    def __call__(self) -> PlaneView | None:
        return self.view

    def warm(self) -> None:
        """Build in the newest view the parts asked of the view before it (or of this one), so that a reader
        reading them at every step finds them built: the reconcile loop calls it between steps, after it
        published the view. A part not asked of the view before is forgotten: one read now and then (a
        dashboard polling every 2 s, steps more often) builds what it reads itself, and nothing is built
        while nobody reads. At most :data:`WARM_MAX` parts (the latest asked for), so that many readers of
        different parts (pages, tenants) do not hold up the loop."""
        view = self.view
        if view is None:
            return
        for key, (_, asked) in list(self.wanted.items()):
            if asked < view.step - 1:
                self.wanted.pop(key, None)
        for key, (make, _) in list(self.wanted.items())[-WARM_MAX:]:  # (a key asked again moves last)
            view.build(key, make)

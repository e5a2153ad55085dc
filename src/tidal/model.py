"""Plain data shared by the control plane, the simulator and the policies; imports nothing of ours. What
the scheduler sees (a :class:`Snapshot`) and decides (``Decision`` values), frozen; times are seconds on
the caller's clock (``*_s``), sizes GPU counts; the dicts inside are read-only (docs/scheduling.md)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["dedicated", "spot"]
PoolName = Literal["serving", "training"]
Reason = Literal["reclaim", "quota", "priority", "fair_share", "demand"]
QueueKey = tuple[str, str, int]  # (tenant, kind, priority)

KINDS = ("dedicated", "spot")
POOLS = ("serving", "training")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A team or project that submits jobs. ``quota_gpus``: training-pool GPUs guaranteed to its dedicated
    jobs (they may preempt spot jobs for them); ``weight``: its fair share of the GPUs spot jobs run on."""

    name: str
    quota_gpus: int = 0
    weight: float = 1.0

    def __post_init__(self) -> None:
        _need(self.quota_gpus >= 0, f"Tenant {self.name!r}: quota_gpus must be >= 0, got {self.quota_gpus}")
        _need(self.weight > 0, f"Tenant {self.name!r}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True, slots=True)
class Node:
    """A machine with ``gpus`` GPUs in the training pool, or the serving pool (training runs there only
    on GPUs serving has lent: :class:`Loan`)."""

    name: str
    gpus: int
    pool: PoolName = "training"

    def __post_init__(self) -> None:
        _need(self.gpus >= 1, f"Node {self.name!r}: gpus must be >= 1, got {self.gpus}")
        _need(self.pool in POOLS, f"Node {self.name!r}: pool must be one of {POOLS}, got {self.pool!r}")


@dataclass(frozen=True, slots=True)
class Loan:
    """``gpus`` GPUs of serving node ``node`` lent to spot training. ``until_s``: when the loan plan
    expects to want them back (nothing new starts within ``min_loan_left_s`` of it; the binding
    instruction is a :class:`Reclaim`). ``reclaim_risk_per_hour``: reclaims with too little notice for a
    final checkpoint (the plan's forecast error); it shortens checkpoint intervals of jobs on the loan."""

    node: str
    gpus: int
    until_s: float = math.inf
    reclaim_risk_per_hour: float = 0.0

    def __post_init__(self) -> None:
        # Checked first, messages built only on failure: the loan ledger makes Loans at every plan.
        if not (self.gpus >= 1 and self.reclaim_risk_per_hour >= 0):
            _need(self.gpus >= 1, f"Loan on {self.node!r}: gpus must be >= 1, got {self.gpus}")
            _need(False, f"Loan on {self.node!r}: reclaim_risk_per_hour must be >= 0")


@dataclass(frozen=True, slots=True)
class Reclaim:
    """An instruction from the loan plan (:func:`tidal.policy.loan.plan_loans`): ``gpus`` loaned GPUs (any
    nodes; what is still outstanding, lowered as :class:`ReturnGpus` are carried out) released by ``by_s``
    (``notice_s`` + grace + final checkpoint). ``notice_s``: when to send notices (``None``: now).
    ``deadline_s``: when serving uses them again (``None`` where nobody planned it)."""

    gpus: int
    by_s: float
    notice_s: float | None = None
    deadline_s: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.gpus >= 1:  # (the message built only on failure)
            raise ValueError(f"Reclaim by {self.by_s}: gpus must be >= 1, got {self.gpus}")

    def due(self, now_s: float) -> bool:
        return self.notice_s is None or now_s >= self.notice_s


@dataclass(frozen=True, slots=True)
class Job:
    """A training job as the scheduler sees it: its request and state (docs/scheduling.md lists the
    fields); ``max_gpus`` ``None``: ``min_gpus``; every size is a multiple of ``size_step`` (lcm of
    ``multiple_of`` and ``gpus_per_node``)."""

    id: str
    tenant: str
    kind: Kind = "spot"
    priority: int = 0
    min_gpus: int = 1
    # None (the default) means min_gpus; __post_init__ sets it, so every reader sees an int.
    max_gpus: int = None  # type: ignore[assignment]  # filled by __post_init__
    multiple_of: int = 1
    gpus_per_node: int | None = None
    submit_s: float = 0.0
    placement: Mapping[str, int] = field(default_factory=dict)
    releasing: Mapping[str, int] = field(default_factory=dict)
    started_s: float | None = None
    last_preempted_s: float | None = None
    last_grown_s: float | None = None
    last_shrunk_s: float | None = None
    last_ckpt_s: float | None = None
    ckpt_stall_s: float | None = None
    ckpt_interval_s: float | None = None
    nominated_s: float | None = None
    gpus: int = field(init=False, repr=False, compare=False)
    releasing_gpus: int = field(init=False, repr=False, compare=False)
    size_step: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Checked first, messages built only on failure: the simulator makes ~10^5 Jobs a month.
        mult, g, mn = self.multiple_of, self.gpus_per_node, self.min_gpus
        if self.max_gpus is None:
            object.__setattr__(self, "max_gpus", mn)
        mx = self.max_gpus
        step = mult if g is None or g == 1 else math.lcm(mult, g) if mult >= 1 else 1
        placement, releasing = self.placement, self.releasing
        if not (self.kind in KINDS and mult >= 1 and (g is None or g >= 1) and mn >= 1 and mx >= mn
                and mn % step == 0 and mx % step == 0
                and all(0 < r <= placement.get(n, 0) for n, r in releasing.items())):
            self._explain()
        object.__setattr__(self, "gpus", sum(placement.values()))
        object.__setattr__(self, "releasing_gpus", sum(releasing.values()) if releasing else 0)
        object.__setattr__(self, "size_step", step)

    def _explain(self) -> None:
        """Raise ``ValueError`` naming the first field that is wrong (``__post_init__`` found one)."""
        me = f"Job {self.id!r}"
        _need(self.kind in KINDS, f"{me}: kind must be one of {KINDS}, got {self.kind!r}")
        _need(self.multiple_of >= 1, f"{me}: multiple_of must be >= 1, got {self.multiple_of}")
        _need(self.gpus_per_node is None or self.gpus_per_node >= 1,
              f"{me}: gpus_per_node must be >= 1 or None, got {self.gpus_per_node}")
        step = math.lcm(self.multiple_of, self.gpus_per_node or 1)
        _need(self.min_gpus >= 1, f"{me}: min_gpus must be >= 1, got {self.min_gpus}")
        _need(self.max_gpus >= self.min_gpus, f"{me}: max_gpus ({self.max_gpus}) < min_gpus "
              f"({self.min_gpus})")
        for name in ("min_gpus", "max_gpus"):
            v = getattr(self, name)
            _need(v % step == 0, f"{me}: {name}={v} is not a multiple of {step} "
                  f"(lcm of multiple_of={self.multiple_of}, gpus_per_node={self.gpus_per_node})")
        for node, g in self.releasing.items():
            _need(0 < g <= self.placement.get(node, 0), f"{me}: releasing[{node!r}]={g} must be > 0 and <= "
                  f"placement there ({self.placement.get(node, 0)})")
        raise AssertionError(f"{me}: invalid, but no check names why")  # the two lists of checks disagree

    @property
    def running(self) -> bool:
        """Holds GPUs (including while stopping)."""
        return self.gpus > 0

    @property
    def stopping(self) -> bool:
        """Told to stop (preempted) and still draining."""
        return self.gpus > 0 and self.releasing_gpus == self.gpus

    @property
    def elastic(self) -> bool:
        return self.max_gpus > self.min_gpus

    @property
    def queued_s(self) -> float:
        """When the job (re)entered its queue, which position and aging count from: submission, or its last
        preemption (so it queues behind those already waiting, and its preemptor gets the GPUs it freed)."""
        if self.last_preempted_s is not None and self.last_preempted_s > self.submit_s:
            return self.last_preempted_s
        return self.submit_s

    def work_lost_gpu_s(self, now_s: float) -> float:
        """GPU-seconds of training lost if the job died now: time since its newest durable checkpoint
        (or since it started, if that is later) times the GPUs it holds."""
        since = self.started_s if self.started_s is not None else now_s
        if self.last_ckpt_s is not None and self.last_ckpt_s > since:
            since = self.last_ckpt_s
        return max(0.0, now_s - since) * self.gpus


def queue_key(job: Job) -> QueueKey:
    """The pending queue a job waits in: one FIFO per (tenant, kind, priority)."""
    return (job.tenant, job.kind, job.priority)


def arrival(job: Job) -> tuple[bool, float, str]:
    """Order within a pending queue: nominated jobs first (``Job.nominated_s``), then ``(queued_s, id)``."""
    return (job.nominated_s is None, job.queued_s, job.id)


@dataclass(frozen=True)
class Snapshot:
    """Everything one scheduling call looks at (:meth:`build` makes one from a list of jobs).
    ``running``: jobs holding GPUs, stopping ones included. ``queues``: pending jobs per
    :func:`queue_key`, each in :func:`arrival` order (a simulator keeps them sorted incrementally, so a
    call never sorts 10,000 jobs). ``loans``: serving GPUs lent now; ``reclaims``: outstanding."""

    now_s: float
    nodes: tuple[Node, ...]
    tenants: tuple[Tenant, ...]
    running: Sequence[Job] = ()
    queues: Mapping[QueueKey, Sequence[Job]] = field(default_factory=dict)
    loans: tuple[Loan, ...] = ()
    reclaims: tuple[Reclaim, ...] = ()

    @classmethod
    def build(cls, now_s: float, nodes: Iterable[Node], tenants: Iterable[Tenant], jobs: Iterable[Job],
              loans: Iterable[Loan] = (), reclaims: Iterable[Reclaim] = ()) -> Snapshot:
        """Split ``jobs`` into running and pending and group the pending ones into queues (O(n log n))."""
        running: list[Job] = []
        queues: dict[QueueKey, list[Job]] = {}
        for j in jobs:
            if j.running:
                running.append(j)
            else:
                queues.setdefault(queue_key(j), []).append(j)
        for q in queues.values():
            q.sort(key=arrival)
        return cls(now_s, tuple(nodes), tuple(tenants), tuple(running), queues, tuple(loans), tuple(reclaims))

    def pending(self) -> Iterator[Job]:
        for q in self.queues.values():
            yield from q

    def jobs(self) -> Iterator[Job]:
        yield from self.running
        yield from self.pending()


def check_snapshot(s: Snapshot) -> None:
    """Raise ``ValueError`` naming the first inconsistency; O(size of the snapshot). The scheduler
    trusts its input for speed: call this where snapshots are built."""
    nodes: dict[str, Node] = {}
    for node_ in s.nodes:
        _need(node_.name not in nodes, f"node {node_.name!r} listed twice")
        nodes[node_.name] = node_
    tenants = {t.name for t in s.tenants}
    _need(len(tenants) == len(s.tenants), "a tenant is listed twice")
    loaned: dict[str, int] = {}
    for ln in s.loans:
        n = nodes.get(ln.node)
        if n is None:
            raise ValueError(f"loan on unknown node {ln.node!r}")
        _need(n.pool == "serving", f"loan on {ln.node!r}: only serving nodes are loaned, it is {n.pool!r}")
        _need(ln.node not in loaned, f"node {ln.node!r} has two loans")
        _need(ln.gpus <= n.gpus, f"loan on {ln.node!r}: gpus={ln.gpus} > node gpus={n.gpus}")
        loaned[ln.node] = ln.gpus
    used: dict[str, int] = {}
    ids: set[str] = set()
    for j in s.running:
        _need(j.running, f"Job {j.id!r} is in running but holds no GPUs")
        _need(j.tenant in tenants, f"Job {j.id!r}: unknown tenant {j.tenant!r}")
        _need(j.id not in ids, f"Job {j.id!r} listed twice")
        ids.add(j.id)
        step, g = j.size_step, j.gpus_per_node
        _need(j.gpus % step == 0 and j.min_gpus <= j.gpus <= j.max_gpus, f"Job {j.id!r}: holds {j.gpus} "
              f"GPUs, expected a multiple of {step} in [{j.min_gpus}, {j.max_gpus}]")
        for node, k in j.placement.items():
            n = nodes.get(node)
            if n is None:
                raise ValueError(f"Job {j.id!r}: placed on unknown node {node!r}")
            _need(k > 0, f"Job {j.id!r}: placement[{node!r}]={k} must be > 0")
            _need(g is None or k == g, f"Job {j.id!r}: holds {k} GPUs on {node!r}, gpus_per_node={g}")
            if n.pool == "serving":
                _need(j.kind == "spot", f"Job {j.id!r}: a dedicated job is placed on serving node {node!r}")
            used[node] = used.get(node, 0) + k
    for node, k in used.items():
        n = nodes[node]
        cap = n.gpus if n.pool == "training" else loaned.get(node, 0)
        what = "it has" if n.pool == "training" else "serving lent"
        _need(k <= cap, f"node {node!r}: {k} GPUs allocated, {what} {cap}")
    for key, q in s.queues.items():
        prev = None
        for j in q:
            _need(not j.running, f"Job {j.id!r} is queued but holds GPUs")
            _need(queue_key(j) == tuple(key), f"Job {j.id!r} is in queue {key}, expected {queue_key(j)}")
            _need(j.tenant in tenants, f"Job {j.id!r}: unknown tenant {j.tenant!r}")
            _need(j.id not in ids, f"Job {j.id!r} listed twice")
            ids.add(j.id)
            _need(prev is None or arrival(prev) <= arrival(j),
                  f"queue {key}: Job {j.id!r} is out of arrival order (queued_s, id)")
            prev = j


# ---------------------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class Admit:
    """Start pending job ``job`` (an id) on ``placement`` (node -> GPUs); its size is the sum."""

    job: str
    placement: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Grow:
    """Give running job ``job`` the GPUs in ``add`` (node -> GPUs) so it runs on ``to_gpus``."""

    job: str
    to_gpus: int
    add: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Shrink:
    """Running job ``job`` gives back ``release`` (node -> GPUs) by ``by_s`` and goes on with ``to_gpus``
    (a final fast checkpoint, then a reshard). ``reason``: whose need; ``for_job``: the waiting job."""

    job: str
    to_gpus: int
    release: Mapping[str, int]
    reason: Reason
    by_s: float
    for_job: str | None = None


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop running job ``job`` (the whole gang) by ``by_s``; it is requeued and resumes later from its
    newest checkpoint. ``reason`` and ``for_job`` as in :class:`Shrink`."""

    job: str
    reason: Reason
    by_s: float
    for_job: str | None = None


@dataclass(frozen=True, slots=True)
class ReturnGpus:
    """Hand ``gpus`` free loaned GPUs of serving node ``node`` back to serving (they are idle now)."""

    node: str
    gpus: int


@dataclass(frozen=True, slots=True)
class SetCkptInterval:
    """Running job ``job`` should checkpoint every ``interval_s`` seconds from now on."""

    job: str
    interval_s: float


Decision = Admit | Grow | Shrink | Preempt | ReturnGpus | SetCkptInterval


@dataclass(frozen=True, slots=True)
class Waiting:
    """Why a pending job did not start in a scheduling call, or why a running job below its maximum did
    not grow (``schedule(..., why=)`` fills these in; they are the decisions' own reasons, not a guess).
    ``until_s``: when a hold for a time ends (the grow hysteresis), else None."""

    reason: str
    until_s: float | None = None

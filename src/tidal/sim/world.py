"""The simulated store: jobs, their states and training timelines, and how decisions change them.

It carries decisions out as the control plane's store does (the job transforms are
:mod:`tidal.policy.apply`'s) and records what each costs. Every change of a job's state goes through
:func:`transition` and the one table :data:`TRANSITIONS` (the diagram: docs/simulator.md, "Jobs");
anything else raises :class:`IllegalTransition`. A shrink or preempt by ``by_s`` trains until
``by_s - stall`` and writes its final checkpoint, or, with less than a stall left, loses the work since
its newest durable checkpoint.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import cast, overload

import numpy as np

from tidal.model import (
    Admit,
    Decision,
    Grow,
    Job,
    Kind,
    Node,
    PoolName,
    Preempt,
    ReturnGpus,
    SetCkptInterval,
    Shrink,
    Snapshot,
    Tenant,
    arrival,
    queue_key,
)
from tidal.policy.apply import admitted, grown, job_with, nominated, preempted, shrunk
from tidal.policy.ckpt_interval import plan_ckpt_intervals
from tidal.policy.ledger import LoanLedger
from tidal.sim.config import SimConfig
from tidal.sim.jobs import JobSpec
from tidal.sim.progress import DurableTable, Segment

_job_of = attrgetter("job")
_SET_LAST_CKPT = Job.__dict__["last_ckpt_s"].__set__  # (a frozen slot, set in place: refresh_checkpoints)

NEW, PENDING, RUNNING, SHRINKING, STOPPING, DONE = ("new", "pending", "running", "shrinking", "stopping",
                                                   "done")

TRANSITIONS: dict[tuple[str, str], str] = {
    (NEW, "submit"): PENDING, (PENDING, "admit"): RUNNING, (RUNNING, "grow"): RUNNING,
    (RUNNING, "shrink"): SHRINKING, (RUNNING, "preempt"): STOPPING,
    (SHRINKING, "released"): RUNNING, (STOPPING, "released"): PENDING,
    (RUNNING, "fail"): RUNNING, (SHRINKING, "fail"): SHRINKING, (STOPPING, "fail"): STOPPING,
    (RUNNING, "set_interval"): RUNNING, (SHRINKING, "set_interval"): SHRINKING,
    (RUNNING, "finish"): DONE, (SHRINKING, "finish"): DONE, (STOPPING, "finish"): DONE,
}
"""(state, event) -> next state: the only legal job transitions."""


class IllegalTransition(RuntimeError):
    """A decision or event that the job's state does not allow (a bug in the caller or the policy)."""


class SimJob:
    """The simulator's record of one job (mutable). ``job`` is what the scheduler sees."""

    __slots__ = ("spec", "state", "job", "seg", "kept_p", "version", "rel_at", "rel_stop", "rel_ok", "pieces",
                 "first_start_s", "end_s", "held_gpu_s", "held_since", "lost_gpu_s", "on_serving", "tau")

    def __init__(self, spec: JobSpec, job: Job) -> None:
        self.spec, self.job = spec, job
        self.state = NEW
        self.seg: Segment | None = None
        self.kept_p = 0.0  # progress restorable while pending
        self.version = 0  # bumps when the timeline changes: older finish/fail events are stale
        self.rel_at = math.inf  # when the GPUs being released are free (shrinking / stopping)
        self.rel_stop = math.inf  # when training stops before that
        self.rel_ok = True  # the final checkpoint fits before rel_at
        self.pieces: list[tuple[float, float, float]] = []  # (progress at start, share on loans, rate)
        self.first_start_s = math.nan
        self.end_s = math.nan
        self.held_gpu_s = 0.0
        self.held_since = 0.0
        self.lost_gpu_s = 0.0
        self.on_serving = 0
        self.tau = 0.0

    def progress(self, t: float) -> float:
        return self.seg.at(t) if self.seg is not None else self.kept_p

    def kept_split(self, p: float) -> tuple[float, float]:
        """(progress on loaned GPUs, productive seconds) of the first ``p`` GPU-seconds of progress."""
        loan = secs = 0.0
        ps = self.pieces
        for i, (start, frac, rate) in enumerate(ps):
            end = min(ps[i + 1][0], p) if i + 1 < len(ps) else p
            if end > start:
                loan += (end - start) * frac
                secs += (end - start) / rate
        return loan, secs


def transition(j: SimJob, event: str) -> None:
    nxt = TRANSITIONS.get((j.state, event))
    if nxt is None:
        raise IllegalTransition(f"job {j.spec.id!r}: {event!r} is not allowed in state {j.state!r} "
                                f"(allowed there: {sorted(e for s, e in TRANSITIONS if s == j.state)})")
    j.state = nxt


Push = Callable[[float, int, str, int], None]  # (time_s, event kind, job id, version)


class RunningJobs(dict):
    """The running jobs (job id -> :class:`~tidal.model.Job`), noting which ``Job`` objects came and went
    since :meth:`take_changes` (for the scheduler's ``RunningIndex.hint``). Changed only by ``[]=`` and
    ``del``."""

    def __init__(self) -> None:
        super().__init__()
        self.added: dict[int, Job] = {}
        self.removed: dict[int, Job] = {}

    def __setitem__(self, jid: str, job: Job) -> None:
        old = self.get(jid)
        if old is not None:
            self._gone(old)
        if self.removed.get(id(job)) is job:
            del self.removed[id(job)]
        else:
            self.added[id(job)] = job
        super().__setitem__(jid, job)

    def __delitem__(self, jid: str) -> None:
        self._gone(self[jid])
        super().__delitem__(jid)

    def _gone(self, job: Job) -> None:
        if self.added.get(id(job)) is job:
            del self.added[id(job)]
        else:
            self.removed[id(job)] = job

    def take_changes(self) -> tuple[list[Job], list[Job]]:
        """(added, removed) ``Job`` objects since the last call, and start again."""
        out = list(self.added.values()), list(self.removed.values())
        self.added, self.removed = {}, {}
        return out


class LiveJobs(Sequence[Job]):
    """The running jobs read through from the store's :class:`RunningJobs`, not copied: a snapshot's
    ``running``, true while the store is unchanged, which is as long as a snapshot lives (the scheduling
    call; the caller keeps only the object, for ``RunningIndex.hint``). A tuple of the ~5,000 jobs of a
    pool of 65,536 GPUs cost ~0.3 ms a call to make, touching every job."""

    __slots__ = ("_jobs",)

    def __init__(self, jobs: RunningJobs) -> None:
        self._jobs = jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._jobs.values())

    @overload
    def __getitem__(self, i: int) -> Job: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Job]: ...

    def __getitem__(self, i: int | slice) -> Job | Sequence[Job]:
        return tuple(self._jobs.values())[i]


class Exponentials:
    """Standard exponential draws from ``rng``, taken from it in blocks: :meth:`scaled` gives the very
    number that ``rng.exponential(scale)`` would, draw after draw (numpy makes ``exponential(scale)`` as
    ``scale`` times the next standard draw, and a block as that many draws one after another), at a third
    of the cost of a numpy call per draw. ``rng`` must be drawn from through this object only."""

    def __init__(self, rng: np.random.Generator, block: int = 4096) -> None:
        self.rng, self.block = rng, block
        self.draws: list[float] = []
        self.next = 0

    def scaled(self, scale: float) -> float:
        if self.next == len(self.draws):
            self.draws, self.next = self.rng.standard_exponential(self.block).tolist(), 0
        e = self.draws[self.next]
        self.next += 1
        return scale * e


FINISH, FAIL, RELEASE = 1, 2, 0


class World:
    """Jobs, queues, nodes and the serving pool; decisions applied here. ``push`` schedules job events
    (``FINISH`` / ``FAIL``, stale once the job's ``version`` moved on; ``RELEASE``); ``rng``: failures."""

    def __init__(self, config: SimConfig, tenants: Iterable[Tenant], push: Push, rng) -> None:
        self.cfg = config
        gpn = config.gpus_per_node
        self.nodes: list[Node] = []
        serving = {}
        pools: tuple[tuple[PoolName, int, str], ...] = (("serving", config.serving_gpus, "s"),
                                                         ("training", config.training_gpus, "t"))
        for pool, total, prefix in pools:
            for i in range(math.ceil(total / gpn)):
                g = min(gpn, total - i * gpn)
                self.nodes.append(Node(f"{prefix}{i:04d}", g, pool))
                if pool == "serving":
                    serving[self.nodes[-1].name] = g
        self.node_tuple = tuple(self.nodes)
        self.serving_nodes = set(serving)
        self.serving = LoanLedger(serving, config.timing)
        self.tenants = tuple(tenants)
        self.push, self.failure_draws = push, Exponentials(rng)
        self.jobs: dict[str, SimJob] = {}
        self.running = RunningJobs()  # id -> Job, with the Job objects that came and went since last asked
        self.queues: dict[tuple, list[Job]] = {}
        self.used: dict[str, int] = {}  # node -> GPUs held by jobs
        self.held_serving = 0
        self.held_total = 0
        self.changed: dict[str, None] = {}  # jobs (re)started or resized since the last interval plan
        self.durable: DurableTable[SimJob] = DurableTable(config.end_s)  # to refresh Job.last_ckpt_s
        self.pending_synthetic_gpus = 0
        self.pending_synthetic_by_size: dict[int, int] = {}
        self.counts = {"admissions": 0, "reclaim_interruptions": 0, "preemptions": 0, "shrinks": 0,
                       "failures": 0, "final_ckpt_missed": 0, "returned_gpus": 0}
        ck = config.ckpt
        self.stall, self.lag, self.restart = ck.stall_s, ck.durable_lag_s, ck.restart_s
        self.fail_rate_per_gpu_s = config.failure_rate_per_gpu_hour / 3600.0

    def spot_wanted(self) -> int:
        """Serving GPUs spot jobs could use now, as the live plane counts them: what pending spot jobs
        could take and running ones grow by, less the training GPUs nobody holds."""
        want = sum(j.max_gpus for q in self.queues.values() for j in q if j.kind == "spot")
        want += sum(j.max_gpus - j.gpus for jid, j in self.running.items()
                    if j.kind == "spot" and self.jobs[jid].state == RUNNING)
        free = sum(n.gpus - self.used.get(n.name, 0) for n in self.nodes if n.pool == "training")
        return max(0, want - max(0, free))

    def rate(self, gpus: int) -> float:
        a = self.cfg.scaling_exponent
        return float(gpus) if a == 1.0 else float(gpus) ** a

    def snapshot(self, now: float) -> Snapshot:
        s = self.serving
        return Snapshot(now, self.node_tuple, self.tenants, LiveJobs(self.running), self.queues,
                        tuple(s.loans.values()), tuple(s.reclaims))

    def _hold(self, sj: SimJob, now: float, delta: Mapping[str, int], sign: int) -> None:
        """Account GPUs taken (+1) or freed (-1) on nodes, and the job's held GPU-seconds."""
        sj.held_gpu_s += sj.job.gpus * (now - sj.held_since)
        sj.held_since = now
        for node, g in delta.items():
            self.used[node] = self.used.get(node, 0) + sign * g
            self.held_total += sign * g
            if node in self.serving_nodes:
                self.held_serving += sign * g
                sj.on_serving += sign * g

    def _schedule_events(self, sj: SimJob, now: float) -> None:
        """New finish / failure events for the job's current segment (older ones go stale)."""
        sj.version += 1
        seg = sj.seg
        assert seg is not None
        t_fin = seg.finish_s(sj.spec.work_gpu_s)
        if t_fin < math.inf:
            self.push(max(t_fin, now), FINISH, sj.spec.id, sj.version)
        lam = self.fail_rate_per_gpu_s * sj.job.gpus
        if lam > 0:
            t_fail = now + self.failure_draws.scaled(1.0 / lam)
            if t_fail < min(t_fin, sj.rel_at, self.cfg.end_s):
                self.push(t_fail, FAIL, sj.spec.id, sj.version)
        self.durable.set(sj, seg, seg.next_durable_s(now))

    def _new_piece(self, sj: SimJob, p0: float, rate: float) -> None:
        ps = sj.pieces
        while ps and ps[-1][0] >= p0:
            ps.pop()
        ps.append((p0, sj.on_serving / sj.job.gpus if sj.job.gpus else 0.0, rate))

    def submit(self, spec: JobSpec, now: float) -> None:
        mx = spec.min_gpus if self.cfg.resize == "restart-full" else spec.max_gpus
        job = Job(spec.id, spec.tenant, cast(Kind, spec.kind), priority=spec.priority, min_gpus=spec.min_gpus,
                  max_gpus=mx, multiple_of=spec.multiple_of, gpus_per_node=spec.gpus_per_node,
                  submit_s=spec.submit_s, ckpt_stall_s=self.stall)
        if spec.id in self.jobs:
            raise ValueError(f"job {spec.id!r} submitted twice")
        sj = SimJob(spec, job)
        self.jobs[spec.id] = sj
        transition(sj, "submit")
        self._enqueue(sj)

    def _enqueue(self, sj: SimJob) -> None:
        q = self.queues.setdefault(queue_key(sj.job), [])
        if not q or arrival(q[-1]) <= arrival(sj.job):
            q.append(sj.job)
        else:
            bisect.insort(q, sj.job, key=arrival)
        if sj.spec.synthetic:
            self.pending_synthetic_gpus += sj.spec.min_gpus
            by = self.pending_synthetic_by_size
            by[sj.spec.min_gpus] = by.get(sj.spec.min_gpus, 0) + 1

    def _dequeue(self, sj: SimJob) -> None:
        q = self.queues[queue_key(sj.job)]
        jid = sj.spec.id
        for i, j in enumerate(q):
            if j.id == jid:
                del q[i]
                break
        else:
            raise AssertionError(f"job {jid!r} is not in its queue")
        if sj.spec.synthetic:
            self.pending_synthetic_gpus -= sj.spec.min_gpus
            self.pending_synthetic_by_size[sj.spec.min_gpus] -= 1

    def apply(self, decisions: list[Decision], now: float) -> list[tuple[float, str]]:
        """Carry out ``schedule()``'s decisions at ``now``. Returns (time, node) for GPUs handed back
        to serving: when they serve again (the engine wakes then)."""
        ready: list[tuple[float, str]] = []
        for d in decisions:
            if isinstance(d, Admit):
                self._admit(d, now)
            elif isinstance(d, Grow):
                self._grow(d, now)
            elif isinstance(d, Shrink | Preempt):
                self._release_order(self.jobs[d.job], d, now)
                self._nominate(d.for_job, now)
                if isinstance(d, Shrink):
                    self.counts["shrinks"] += 1
                else:
                    self.counts["preemptions"] += 1
                    key = f"preempted_for_{d.reason}"
                    self.counts[key] = self.counts.get(key, 0) + 1
                self.counts["reclaim_interruptions"] += d.reason == "reclaim"
            elif isinstance(d, ReturnGpus):
                if self.used.get(d.node, 0) + d.gpus > self.serving.lent_on(d.node):
                    raise AssertionError(f"{d}: {self.used.get(d.node, 0)} GPUs of {d.node} are held by jobs")
                ready.append((self.serving.return_gpus(d.node, d.gpus, now), d.node))
                self.counts["returned_gpus"] += d.gpus
            elif isinstance(d, SetCkptInterval):
                self.set_interval(d.job, d.interval_s, now)
            else:
                raise TypeError(f"unknown decision {d!r}")
        return ready

    def _nominate(self, for_job: str | None, now: float) -> None:
        """Others give GPUs back for pending ``for_job``: nominate it (the front of its queue)."""
        if for_job is None:
            return
        sj = self.jobs[for_job]
        if sj.job.running:
            return
        self._dequeue(sj)
        sj.job = nominated(sj.job, now, in_place=True)  # (a pending job: referenced only by its queue)
        self._enqueue(sj)

    def _admit(self, d: Admit, now: float) -> None:
        sj = self.jobs[d.job]
        transition(sj, "admit")
        self.counts["admissions"] += 1
        self._dequeue(sj)
        sj.job = admitted(sj.job, d, now, in_place=True)  # (the RunningIndex tells running jobs by object)
        sj.held_since = now
        self._hold(sj, now, d.placement, +1)
        self.running[d.job] = sj.job
        if math.isnan(sj.first_start_s):
            sj.first_start_s = now
        sj.tau = sj.job.ckpt_interval_s or self.cfg.ckpt_interval.max_interval_s
        rate = self.rate(sj.job.gpus)
        sj.seg = Segment(now + self.restart, sj.kept_p, rate, sj.tau, self.stall, self.lag, sj.kept_p, now)
        sj.rel_at, sj.rel_stop, sj.rel_ok = math.inf, math.inf, True
        self._new_piece(sj, sj.kept_p, rate)
        self.changed[d.job] = None
        self._schedule_events(sj, now)

    def _grow(self, d: Grow, now: float) -> None:
        sj = self.jobs[d.job]
        transition(sj, "grow")
        job = grown(sj.job, d, now)
        self._hold(sj, now, d.add, +1)
        sj.job = job
        self.running[d.job] = sj.job
        self._resize(sj, now)

    def _resize(self, sj: SimJob, now: float) -> None:
        """Checkpoint now (unless still restoring) and restore on the job's current GPUs."""
        seg = sj.seg
        assert seg is not None
        rate = self.rate(sj.job.gpus)
        if now < seg.t0:  # still restoring: restore onto the new layout instead
            p, cap, start = seg.p0, None, now + self.restart
        else:
            p = seg.at(now)
            cap = (now + self.stall + self.lag, p, now)
            start = now + self.stall + self.restart
        sj.seg = seg.rebased(now, p0=p, start_s=start, rate=rate, tau_s=sj.tau, capture=cap)
        self._new_piece(sj, p, rate)
        self.changed[sj.spec.id] = None
        self._schedule_events(sj, now)

    def _release_order(self, sj: SimJob, d: Shrink | Preempt, now: float) -> None:
        shrink = isinstance(d, Shrink)
        transition(sj, "shrink" if shrink else "preempt")
        by = max(d.by_s, now)
        ok = by - now >= self.stall - 1e-9
        if ok and self.cfg.release_when_captured:
            by = now + self.stall
        sj.rel_at, sj.rel_ok = by, ok
        sj.rel_stop = by - self.stall if ok else by
        sj.job = shrunk(sj.job, d, now) if isinstance(d, Shrink) else preempted(sj.job, d, now)
        self.running[sj.spec.id] = sj.job
        seg = sj.seg
        assert seg is not None
        sj.seg = seg.stopped_at(sj.rel_stop)
        self._schedule_events(sj, now)
        self.push(by, RELEASE, sj.spec.id, 0)

    def release(self, jid: str, now: float) -> int | None:
        """The job has given back its releasing GPUs (at ``rel_at``). Returns how many of them are on
        serving nodes (``None``: a stale event)."""
        sj = self.jobs[jid]
        if sj.state not in (SHRINKING, STOPPING) or abs(sj.rel_at - now) > 1e-6:
            return None
        seg = sj.seg
        assert seg is not None
        if sj.rel_ok:
            kept, cap = seg.at(sj.rel_stop), (now + self.lag, seg.at(sj.rel_stop), sj.rel_stop)
        else:
            kept, cap = seg.durable(now)[0], None
            sj.lost_gpu_s += seg.at(now) - kept
            self.counts["final_ckpt_missed"] += 1
        rel = sj.job.releasing
        freed = sum(g for n, g in rel.items() if n in self.serving_nodes)
        left = {n: g - rel.get(n, 0) for n, g in sj.job.placement.items() if g - rel.get(n, 0) > 0}
        self._hold(sj, now, rel, -1)
        stopping = sj.state == STOPPING
        transition(sj, "released")
        sj.rel_at, sj.rel_stop, sj.rel_ok = math.inf, math.inf, True
        if stopping:
            del self.running[jid]
            sj.job = job_with(sj.job, placement={}, releasing={}, started_s=None)
            sj.seg, sj.kept_p = None, kept
            sj.version += 1
            self.durable.drop(sj)
            self._enqueue(sj)
            return freed
        sj.job = job_with(sj.job, placement=left, releasing={})
        self.running[jid] = sj.job
        rate = self.rate(sj.job.gpus)
        sj.seg = seg.rebased(now, p0=kept, start_s=now + self.restart, rate=rate, tau_s=sj.tau, capture=cap)
        self._new_piece(sj, kept, rate)
        self.changed[jid] = None
        self._schedule_events(sj, now)
        return freed

    def finish(self, jid: str, version: int, now: float) -> int | None:
        """The job's work is done: it leaves. Returns its GPUs on serving nodes (``None``: stale event)."""
        sj = self.jobs[jid]
        if sj.version != version or sj.state not in (RUNNING, SHRINKING, STOPPING):
            return None
        freed = sj.on_serving
        transition(sj, "finish")
        self._hold(sj, now, sj.job.placement, -1)
        del self.running[jid]
        sj.job = job_with(sj.job, placement={}, releasing={})
        sj.kept_p = sj.spec.work_gpu_s
        sj.seg = None
        sj.end_s = now
        sj.version += 1
        self.durable.drop(sj)
        return freed

    def fail(self, jid: str, version: int, now: float) -> bool:
        sj = self.jobs[jid]
        if sj.version != version or sj.state not in (RUNNING, SHRINKING, STOPPING):
            return False
        transition(sj, "fail")
        seg = sj.seg
        assert seg is not None
        keep = seg.durable(now)[0]
        sj.lost_gpu_s += max(0.0, seg.at(now) - keep)
        sj.seg = seg.rebased(now, p0=keep, start_s=now + self.restart, rate=seg.rate, tau_s=sj.tau,
                             stop_s=seg.stop)
        self._new_piece(sj, keep, seg.rate)
        self.counts["failures"] += 1
        self._schedule_events(sj, now)
        return True

    def set_interval(self, jid: str, interval_s: float, now: float) -> None:
        sj = self.jobs[jid]
        transition(sj, "set_interval")
        seg = sj.seg
        assert seg is not None
        sj.tau = interval_s
        object.__setattr__(sj.job, "ckpt_interval_s", interval_s)  # in place, as refresh_checkpoints
        if now < seg.t0:
            pend = (seg.pend_t, seg.pend_p, seg.pend_ct) if seg.pend_t < math.inf else None
            sj.seg = Segment(seg.t0, seg.p0, seg.rate, interval_s, seg.stall, seg.lag, seg.dur_p, seg.dur_ct,
                             pend, seg.stop)
        else:
            sj.seg = seg.rebased(now, p0=seg.at(now), start_s=now, rate=seg.rate, tau_s=interval_s,
                                 stop_s=seg.stop)
        self._schedule_events(sj, now)

    def plan_intervals(self, now: float) -> list[Decision]:
        """Checkpoint intervals (the pure policy) for jobs (re)started or resized since the last call."""
        if not self.changed:
            return []
        jobs = tuple(self.running[j] for j in self.changed if j in self.running)
        self.changed = {}
        # Only the loans on these jobs' nodes (the policy reads no other): not all ~1,000 of a large pool.
        lent = self.serving.loans
        loans = tuple(lent[n] for n in dict.fromkeys(n for j in jobs for n in j.placement) if n in lent)
        snap = Snapshot(now, self.node_tuple, self.tenants, jobs, {}, loans)
        persist = dict.fromkeys((j.id for j in jobs), self.cfg.ckpt.persist_s)
        return list(plan_ckpt_intervals(snap, self.cfg.ckpt_interval, persist))

    def refresh_checkpoints(self, now: float) -> tuple[list[Job], list[float]]:
        """Bring ``Job.last_ckpt_s`` (the victim order's "least work lost") up to ``now``; returns the jobs
        it moved and their new times (for ``RunningIndex.ckpt_moved``). Set in place on the store's own
        frozen object (as ``ckpt_interval_s`` in :meth:`set_interval`): a rebuild per checkpoint would cost
        more than the rest of the simulator, and no snapshot outlives a scheduling call."""
        sjs, cts = self.durable.refresh(now)
        moved = list(map(_job_of, sjs))
        deque(map(_SET_LAST_CKPT, moved, cts), maxlen=0)  # (the slot's own setter, in a loop of C)
        return moved, cts

"""The store's job rows as the scheduler sees them (:class:`SchedulerView`) and an attempt's environment for
the executor (:func:`job_env`)."""

from __future__ import annotations

import json
from bisect import bisect_left, insort
from operator import itemgetter
from pathlib import Path
from typing import cast

from tidal import contract as c
from tidal.contract import DEFAULT_GRACE_S
from tidal.control.states import HELD, TERMINAL
from tidal.control.states import State as S
from tidal.control.store import JobRow, Store
from tidal.model import Job, Kind, Loan, Node, QueueKey, Reclaim, Snapshot, Tenant, arrival, queue_key
from tidal.policy.apply import job_with


def job_view(j: JobRow) -> Job:
    """A pending or held job row as the scheduler sees it: stopping jobs release all they hold."""
    held = S(j.state) in HELD
    releasing = dict(j.placement) if j.state in (S.PREEMPTING, S.CANCELLING) else dict(j.releasing or {})
    return Job(  # (Job checks the kind)
        j.id, j.tenant, cast(Kind, j.kind), j.priority, j.min_gpus, j.max_gpus, j.multiple_of,
        submit_s=j.submit_s, placement=dict(j.placement) if held else {},
        releasing=releasing if held else {}, started_s=j.started_s if held else None,
        last_preempted_s=j.last_preempted_s, last_grown_s=j.last_grown_s, last_shrunk_s=j.last_shrunk_s,
        last_ckpt_s=j.last_ckpt_s, ckpt_stall_s=j.ckpt_stall_s, ckpt_interval_s=j.ckpt_interval_s,
        nominated_s=None if held else j.nominated_s)


RESORT_AT = 8  # a queue of which more than 1/RESORT_AT changed since the last sort is sorted whole again


class SchedulerView:
    """The scheduler's view of the active jobs, kept from step to step: a job's view is made again only when
    its row is :meth:`put` (written), the running jobs listed and a queue sorted again only when one of theirs
    changed; so a step costs what changed, not how many jobs wait. Running jobs in submission order."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}  # pending or held job id -> its view
        self._run: dict[str, tuple[int, Job]] = {}  # running job id -> (seq, view)
        self._running: tuple[Job, ...] | None = ()  # None: listed again at the next snapshot
        self._queues: dict[QueueKey, dict[str, Job]] = {}
        self._sorted: dict[QueueKey, list[Job]] = {}
        # queue -> (views taken out of its sorted list, views to put in) since the last :meth:`queues`
        self._moved: dict[QueueKey, tuple[dict[str, Job], dict[str, Job]]] = {}

    def sizes(self) -> tuple[int, int]:
        """(jobs running, jobs waiting)."""
        return len(self._run), len(self.jobs) - len(self._run)

    def put(self, row: JobRow) -> None:
        """The job's row was written: its view made again (none unless pending or held)."""
        self.drop(row.id)
        if row.state != S.PENDING and S(row.state) not in HELD:
            return
        j = self.jobs[row.id] = job_view(row)
        if j.running:
            self._run[row.id], self._running = (row.seq, j), None
        else:
            key = queue_key(j)
            self._queues.setdefault(key, {})[row.id] = j
            self._moved.setdefault(key, ({}, {}))[1][row.id] = j

    def checkpointed(self, row: JobRow) -> None:
        """Only the running job's checkpoint times were written (``last_ckpt_s``, ``ckpt_stall_s``): its view
        copied with them (:func:`~tidal.policy.apply.job_with`, unchecked: ~1/5 of :func:`job_view`'s cost,
        thousands a step at pool scale), else made again as by :meth:`put`."""
        old = self._run.get(row.id)
        if old is None:
            self.put(row)
            return
        j = self.jobs[row.id] = job_with(old[1], last_ckpt_s=row.last_ckpt_s, ckpt_stall_s=row.ckpt_stall_s)
        self._run[row.id], self._running = (old[0], j), None

    def drop(self, job_id: str) -> None:
        j = self.jobs.pop(job_id, None)
        if j is not None and self._run.pop(job_id, None) is not None:
            self._running = None
        elif j is not None:
            key = queue_key(j)
            self._queues[key].pop(job_id)
            gone, new = self._moved.setdefault(key, ({}, {}))
            if new.get(job_id) is j:  # (put since the last sort: not in the sorted list)
                del new[job_id]
            else:
                gone[job_id] = j

    def pending_counts(self) -> dict[QueueKey, int]:
        """The jobs in each pending queue (none empty)."""
        return {key: len(q) for key, q in self._queues.items() if q}

    def queues(self) -> dict[QueueKey, list[Job]]:
        """The pending queues, each in :func:`~tidal.model.arrival` order. A changed queue's list is copied
        and its jobs that left or came taken out and put in by bisection (a step changes a few jobs of a queue
        of thousands), or sorted again when many changed; a list is replaced, never changed, so one handed out
        stays as it was."""
        for key, (gone, new) in self._moved.items():
            q = self._queues.get(key)
            old = self._sorted.get(key)
            if not q:
                self._sorted.pop(key, None)
                self._queues.pop(key, None)
            elif old is None or (len(gone) + len(new)) * RESORT_AT > len(q):
                self._sorted[key] = sorted(q.values(), key=arrival)
            else:
                lst = old.copy()
                for j in gone.values():
                    i = bisect_left(lst, arrival(j), key=arrival)
                    assert lst[i] is j, f"job {j.id} is not where its queue's order puts it"
                    del lst[i]
                for j in new.values():
                    insort(lst, j, key=arrival)
                self._sorted[key] = lst
        self._moved.clear()
        return self._sorted

    def snapshot(self, now_s: float, nodes: tuple[Node, ...], tenants: tuple[Tenant, ...],
                 loans: tuple[Loan, ...], reclaims: tuple[Reclaim, ...]) -> Snapshot:
        queues = dict(self.queues())
        if self._running is None:
            self._running = tuple(j for _, j in sorted(self._run.values(), key=itemgetter(0)))
        return Snapshot(now_s, nodes, tenants, self._running, queues, loans, reclaims)


def default_ckpt(ckpt_root: Path | None, job: JobRow) -> str | None:
    """The job's checkpoint location when its spec names none: ``<ckpt_root>/<job>/ckpt``."""
    return str(ckpt_root / job.id / "ckpt") if ckpt_root else None


def own_dirs(job: JobRow, ckpt_root: Path | None) -> tuple[str, ...]:
    """The checkpoint directories the executor makes for the job before its ranks start (its uid cannot create
    them in the state dir): its default location when used (or that of the job it resumes), and each directory
    of its spec under ``<state dir>/tenants/<tenant>/``."""
    ck = job.spec.get("checkpoint") or {}
    default = default_ckpt(ckpt_root, job)
    if ck.get("tiers") is None and ck.get("url") in (None, default):
        return (default,) if default else ()
    if ckpt_root is None:
        return ()
    resumed = str(ckpt_root / ck["resume_from"] / "ckpt") if ck.get("resume_from") else None
    if resumed is not None and ck.get("tiers") is None and ck.get("url") == resumed:
        return (resumed,)  # the default location of the job it resumes: made here if that job never ran
    from tidal.control.locations import TENANTS_DIRNAME, locations

    prefix = (ckpt_root.parent / TENANTS_DIRNAME / job.tenant).resolve()
    try:
        _, locs = locations(ck)
    except ValueError:
        return ()
    return tuple(loc for kind, loc, _ in locs if kind == "dir" and Path(loc).resolve().is_relative_to(prefix))


def taken_over(job: JobRow, store: Store) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The directories ``job`` took over with ``resume_from`` and the ended jobs of its tenant at them; ``((),
    ())`` for a job that resumes nothing."""
    ck = job.spec.get("checkpoint") or {}
    rid = ck.get("resume_from")
    if not rid:
        return (), ()
    from tidal.control.locations import locations, overlaps

    try:
        _, locs = locations(ck)
    except ValueError:
        return (), ()
    dirs = tuple(loc for kind, loc, _ in locs if kind == "dir")
    earlier = {rid} | {jid for jid, tenant, loc, state in store.ckpt_locations(dirs)
                       if jid != job.id and tenant == job.tenant and S(state) in TERMINAL
                       and any(overlaps(loc, d) for d in dirs)}
    return (dirs, tuple(sorted(earlier))) if dirs else ((), ())


def job_env(job: JobRow, ckpt_root: Path | None, max_interval_s: float) -> dict[str, str]:
    """The job's own variables plus the runtime's: checkpoint interval (``auto``: the policy's once the
    stall is measured, until then ``max_interval_s``), grace, and the checkpoint tiers or location."""
    spec = job.spec
    ck = spec.get("checkpoint") or {}
    url = ck.get("url") or default_ckpt(ckpt_root, job)
    env = dict(spec.get("env") or {})
    interval = ck.get("interval_s", "auto")
    if interval == "auto":
        interval = job.ckpt_interval_s or max_interval_s
    env[c.ENV_CKPT_INTERVAL_S] = f"{float(interval):g}"
    env[c.ENV_GRACE_S] = f"{float(spec.get('grace_s', DEFAULT_GRACE_S)):g}"
    if ck.get("tiers"):
        env[c.ENV_CKPT_TIERS] = json.dumps(ck["tiers"])
    elif url:
        env[c.ENV_CKPT_URL] = url
    return env

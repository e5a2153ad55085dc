"""The scheduler: one pure function from a :class:`~tidal.model.Snapshot` to a list of decisions.

    decisions = schedule(snapshot, SchedulerConfig())

No I/O, no clock (``snapshot.now_s``), no randomness: the same snapshot and config give the same list.
The caller applies the decisions before the next snapshot; the scheduler is level-triggered
(``Job.releasing`` keeps it from acting twice on one need). One call is a cycle of numbered steps,
after Kueue's (docs/scheduling.md): 1. snapshot (index the running jobs once, views of free GPUs, fair
shares); 2. reclaim (:mod:`.scheduling.reclaim`); 3. nominate (only pending-queue heads); 4. order
(:mod:`.scheduling.ordering`); 5. admit, or compute victims and then act on them
(:mod:`.scheduling.targets`); 6. grow (:mod:`.scheduling.growth`); 7. requeue (nothing to emit).
With ``why``, the call also says why each job waits (:class:`~tidal.model.Waiting`), from the same checks.
"""

from __future__ import annotations

from functools import lru_cache

from tidal.model import Decision, Job, Preempt, Shrink, Snapshot, Waiting
from tidal.policy.scheduling.config import SchedulerConfig
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.growth import grow_step
from tidal.policy.scheduling.index import RunningIndex
from tidal.policy.scheduling.ordering import QueueHeads, aged_priority
from tidal.policy.scheduling.placement import fits, place
from tidal.policy.scheduling.reclaim import reclaim_step
from tidal.policy.scheduling.targets import preempt_for

__all__ = ["RunningIndex", "SchedulerConfig", "queued_behind", "schedule"]


def schedule(snapshot: Snapshot, config: SchedulerConfig | None = None, index: RunningIndex | None = None,
             why: dict[str, Waiting] | None = None) -> list[Decision]:
    """Decide what to admit, grow, shrink, preempt and return to serving now (see the module docstring).

    ``index``: a :class:`~tidal.policy.scheduling.index.RunningIndex` kept by a caller that schedules the
    same pool call after call (step 1 then costs O(jobs changed); the same decisions). ``why``: filled in
    with job id -> :class:`~tidal.model.Waiting` for every job the call gave a reason of its own: each
    pending job it looked at and did not admit, each queue's first job not admitted, each running job that
    did not grow. Every other job of a queue waits behind that first one: :func:`queued_behind` of its queue
    (O(queues) more, not O(pending jobs))."""
    cfg = config or SchedulerConfig()
    # 1. Snapshot.
    c = Cycle(snapshot, cfg, index)
    c.why = why
    c.build_views(c.blocked_loans())
    pending_spot = {key[0] for key, q in snapshot.queues.items() if key[1] == "spot" and q}
    c.compute_fair(pending_spot)
    # 2. Reclaim.
    reclaim_step(c)
    c.compute_fair(pending_spot)
    # 3-4. Nominate and order: pending-queue heads, merged by key, dedicated before spot.
    phases = _nominate(c)
    # 5. Admit (and preempt for those that do not fit).
    admitted = _admit(c, phases)
    # 6. Grow.
    grow_step(c, admitted)
    # 7. Requeue: implicit.
    if why is not None:
        _explain_queues(c, admitted)
    return c.decisions


def _nominate(c: Cycle) -> list[QueueHeads]:
    """The dedicated phase and the spot phase, each a merge of its queues' heads in key order."""
    cfg, now = c.cfg, c.now
    ded: list = []
    spot: list = []
    for key, q in c.snap.queues.items():
        if q:
            (ded if key[1] == "dedicated" else spot).append(q)

    ttl = cfg.nomination_ttl_s

    def waiting(j: Job) -> bool:  # not nominated lately (False sorts first)
        return j.nominated_s is None or now - j.nominated_s > ttl

    def ded_key(j: Job) -> tuple:
        return (waiting(j), -aged_priority(j, now, cfg), j.queued_s, j.id)

    def spot_key(j: Job) -> tuple:
        return (waiting(j), -aged_priority(j, now, cfg), c.share(j.tenant), j.queued_s, j.id)

    return [QueueHeads(ded, ded_key), QueueHeads(spot, spot_key)]


def _admit(c: Cycle, phases: list[QueueHeads]) -> dict[str, tuple[int, Job]]:
    """Admit in order, searching victims for those that do not fit; returns id -> (index of the Admit,
    job) for the grow step."""
    cfg = c.cfg
    admitted: dict[str, tuple[int, Job]] = {}
    attempts = 0
    for phase, heads in enumerate(phases):
        views = [c.training] if phase == 0 else [c.training, c.loan]
        skips = 0  # per phase: dedicated jobs blocked on quota never starve spot admission
        while skips < cfg.max_skips_per_cycle:
            if attempts >= cfg.max_preemption_attempts_per_cycle and not any(v.total for v in views):
                break  # nothing free and no more victim searches: nobody else can start
            job = heads.pop()
            if job is None:
                break
            if job.kind == "dedicated" and c.quota_room(job.tenant) <= 0 and not c.quota_can_free(job):
                heads.drop_queue_of_last()  # its tenant's quota is full: nothing in this queue can start
                c.wait(job, _quota_full(c, job))
                continue
            if _try_place(c, job):
                admitted[job.id] = (len(c.decisions) - 1, job)
                continue
            searched = attempts < cfg.max_preemption_attempts_per_cycle
            if searched:
                attempts += 1
                before = len(c.decisions)
                if preempt_for(c, job):
                    if c.why is not None:
                        c.wait(job, _freeing(c.decisions[before:]))
                    continue
            if c.why is not None:
                c.wait(job, _no_room(c, job, searched))
            skips += 1
    return admitted


def _try_place(c: Cycle, job: Job) -> bool:
    size, g = job.min_gpus, job.gpus_per_node
    if job.kind == "dedicated" and c.quota_room(job.tenant) < size:
        return False
    for views in c.views_for(job):
        if fits(views, size, g):
            placement = place(views, size, g)
            assert placement is not None  # fits() said it would
            c.issue_admit(job, placement)
            return True
    return False


# ------------------------------------------------------------------------------------ why it waits
def _quota_full(c: Cycle, job: Job) -> str:
    t = c.tenants[job.tenant]
    return (f"waiting: tenant {job.tenant}'s quota is full ({c.ded_held[job.tenant]} of {t.quota_gpus} "
            "GPUs held by its dedicated jobs, none of which may give way)")


def _freeing(issued: list) -> str:
    stops = [d for d in issued if isinstance(d, Preempt | Shrink)]
    if not stops:
        return "waiting: GPUs other jobs are releasing now are kept for it"
    what = ", ".join((f"preempting {d.job}" if isinstance(d, Preempt) else f"shrinking {d.job} to "
                      f"{d.to_gpus}") + f" ({d.reason})" for d in stops[:3])
    if len(stops) > 3:
        what += f" and {len(stops) - 3} more"
    return f"waiting: GPUs are being freed for it ({what})"


def _no_room(c: Cycle, job: Job, searched: bool) -> str:
    size, free = job.min_gpus, c.free_for(job)
    need = f"needs {size} GPU{'s' if size != 1 else ''}"
    if job.gpus_per_node:
        need += f" ({job.gpus_per_node} per node)"
    if job.kind == "dedicated" and c.quota_room(job.tenant) < size:
        why = f"{need} of tenant {job.tenant}'s quota, {max(0, c.quota_room(job.tenant))} left"
    else:
        why = f"{need}, {free} free" + (" where it may run" if free >= size else "")
    if not searched:
        return f"waiting: {why} (no more victim searches this cycle)"
    return f"waiting: {why}; nothing may be preempted or shrunk for it ({job.kind}, priority {job.priority})"


def _explain_queues(c: Cycle, admitted: dict[str, tuple[int, Job]]) -> None:
    """The first job of each queue that the admit step did not admit and gave no reason waits on the cycle's
    limit; the rest of the queue behind it (:func:`queued_behind`, not written per job: a queue costs its
    head, not a pass over its thousands)."""
    why = c.why
    assert why is not None
    for q in c.snap.queues.values():
        ahead = next((j for j in q if j.id not in admitted), None)
        if ahead is not None and ahead.id not in why:
            why[ahead.id] = _NONE_FREE if c.free_for(ahead) == 0 else _turn(c.cfg.max_skips_per_cycle)


@lru_cache(maxsize=4096)
def queued_behind(tenant: str, kind: str, priority: int) -> Waiting:
    """Why a job of the queue ``(tenant, kind, priority)`` waits when the scheduler gave it no reason of its
    own: behind the queue's first job, which has one (the same object from call to call: it does not name the
    job ahead, so it stays put as the head moves)."""
    return Waiting(f"queued behind earlier jobs in tenant {tenant}'s {kind} queue at priority {priority}")


@lru_cache(maxsize=16)
def _turn(skips: int) -> Waiting:
    return Waiting(f"waiting its turn: the scheduler stopped this cycle after {skips} jobs that could not "
                   "start")


_NONE_FREE = Waiting("waiting: no GPU free, and no more victim searches this cycle")

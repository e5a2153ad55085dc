"""The store's side of the scheduler's decisions, written once: ``apply(snapshot, decisions) -> snapshot``.

Pure (the time is the snapshot's ``now_s``). The per-decision job transforms are shared with the
simulator's store (:class:`tidal.sim.world.World`), so the semantics of :mod:`tidal.model`'s lifecycle
live here only; a decision the snapshot does not allow raises :class:`IllegalDecision`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from tidal.model import (
    Admit,
    Decision,
    Grow,
    Job,
    Loan,
    Preempt,
    Reclaim,
    ReturnGpus,
    SetCkptInterval,
    Shrink,
    Snapshot,
)


class IllegalDecision(ValueError):
    """A decision that the snapshot it is applied to does not allow (a bug in the policy or the caller)."""


_SET = object.__setattr__
_JOB_FIELDS = tuple(f.name for f in fields(Job))  # every slot, the derived ones (gpus, ...) included


def _slot_copier(cls: type, names: Sequence[str]) -> Callable[[Any], Any]:
    """A function copying an instance of the slotted (frozen) dataclass ``cls`` slot by slot, unchecked:
    each slot set through its descriptor, by generated code (as ``dataclasses`` makes ``__init__``), less
    than half the time of ``object.__setattr__`` by name in a loop."""
    args = ", ".join(f"_s{i}=_d[{n!r}].__set__" for i, n in enumerate(names))
    body = "".join(f"    _s{i}(out, obj.{n})\n" for i, n in enumerate(names))
    src = f"def copy(obj, _new=_new, _cls=_cls, {args}):\n    out = _new(_cls)\n{body}    return out\n"
    ns: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_d": {n: cls.__dict__[n] for n in names}}
    exec(src, ns)  # noqa: S102 (the source is made above from the class's own field names)
    return ns["copy"]


_copy_job: Callable[[Job], Job] = _slot_copier(Job, _JOB_FIELDS)


def job_with(job: Job, in_place: bool = False, **changes) -> Job:
    """``dataclasses.replace(job, **changes)``, 3x faster for a store's frequent state changes: the request
    fields are copied unchecked (``changes`` must not touch them); only the GPU counts are recomputed.
    ``in_place``: ``job`` itself changed, not a copy (for a store's own object that nothing else holds: the
    simulator's pending jobs, referenced only by their queue)."""
    resized = "placement" in changes or "releasing" in changes
    if resized:
        placement = changes.get("placement", job.placement)
        releasing = changes.get("releasing", job.releasing)
        if not all(0 < r <= placement.get(n, 0) for n, r in releasing.items()):
            replace(job, **changes)  # raises ValueError naming the field
            raise AssertionError(f"{job.id!r}: releasing {releasing} exceeds placement {placement}")
    out = job if in_place else _copy_job(job)
    for name, v in changes.items():
        _SET(out, name, v)
    if resized:
        _SET(out, "gpus", sum(placement.values()))
        _SET(out, "releasing_gpus", sum(releasing.values()) if releasing else 0)
    return out


def admitted(job: Job, d: Admit, now_s: float, in_place: bool = False) -> Job:
    """Pending ``job`` after :class:`Admit` ``d`` at ``now_s`` (``in_place``: see :func:`job_with`)."""
    if job.running:
        raise IllegalDecision(f"{d}: job {job.id!r} already holds {job.gpus} GPUs")
    return job_with(job, in_place, placement=dict(d.placement), started_s=now_s, nominated_s=None)


def grown(job: Job, d: Grow, now_s: float) -> Job:
    """Running ``job`` after :class:`Grow` ``d`` at ``now_s``."""
    p = dict(job.placement)
    for n, g in d.add.items():
        p[n] = p.get(n, 0) + g
    if not job.running or job.releasing or sum(p.values()) != d.to_gpus:
        raise IllegalDecision(f"{d}: job {job.id!r} holds {job.gpus} GPUs (releasing {job.releasing_gpus}); "
                              f"it would hold {sum(p.values())}")
    return job_with(job, placement=p, last_grown_s=now_s)


def shrunk(job: Job, d: Shrink, now_s: float) -> Job:
    """Running ``job`` after :class:`Shrink` ``d`` at ``now_s``: it releases ``d.release``."""
    if not job.running or job.releasing or job.gpus - sum(d.release.values()) != d.to_gpus:
        raise IllegalDecision(f"{d}: job {job.id!r} holds {job.gpus} GPUs (releasing {job.releasing_gpus})")
    return job_with(job, releasing=dict(d.release), last_shrunk_s=now_s)


def preempted(job: Job, d: Preempt, now_s: float) -> Job:
    """Running ``job`` after :class:`Preempt` ``d`` at ``now_s``: it releases everything it holds."""
    if not job.running or job.releasing:
        raise IllegalDecision(f"{d}: job {job.id!r} holds {job.gpus} GPUs (releasing {job.releasing_gpus})")
    return job_with(job, releasing=dict(job.placement), last_preempted_s=now_s)


def nominated(job: Job, now_s: float, in_place: bool = False) -> Job:
    """``job`` after others were shrunk or preempted for it at ``now_s`` (``Shrink``/``Preempt``
    ``for_job``): a pending job is nominated; a running one is left as it is (``in_place``: see
    :func:`job_with`)."""
    return job if job.running else job_with(job, in_place, nominated_s=now_s)


def interval_set(job: Job, d: SetCkptInterval, now_s: float) -> Job:
    """Running ``job`` after :class:`SetCkptInterval` ``d``."""
    if not job.running:
        raise IllegalDecision(f"{d}: job {job.id!r} is not running")
    return job_with(job, ckpt_interval_s=d.interval_s)


def returned(loans: Mapping[str, Loan], reclaims: Iterable[Reclaim], d: ReturnGpus,
             held_gpus: int = 0) -> tuple[dict[str, Loan], list[Reclaim]]:
    """Loans (node -> loan) and outstanding reclaims after :class:`ReturnGpus` ``d``; ``held_gpus``:
    GPUs of ``d.node`` jobs hold (they are not free to return). Reclaims come back earliest first."""
    ln = loans.get(d.node)
    if ln is None or not 1 <= d.gpus <= ln.gpus - held_gpus:
        raise IllegalDecision(f"{d}: {ln.gpus if ln else 0} GPUs of {d.node!r} on loan, "
                              f"{held_gpus} held by jobs")
    out = dict(loans)
    if d.gpus == ln.gpus:
        del out[d.node]
    else:
        out[d.node] = replace(ln, gpus=ln.gpus - d.gpus)
    return out, lowered(reclaims, d.gpus)


def lowered(reclaims: Iterable[Reclaim], gpus: int) -> list[Reclaim]:
    """``reclaims`` with ``gpus`` fewer GPUs asked back, taken from the earliest ``by_s``; earliest first."""
    left = gpus
    rs = sorted(reclaims, key=lambda r: r.by_s)
    while left and rs:
        r = rs[0]
        k = min(left, r.gpus)
        left -= k
        # (a Reclaim made directly: ``dataclasses.replace`` costs ~3x as much per ReturnGpus)
        rs = ([Reclaim(r.gpus - k, r.by_s, r.notice_s, r.deadline_s)] if r.gpus > k else []) + rs[1:]
    return rs


def after(job: Job, d: Admit | Grow | Shrink | Preempt | SetCkptInterval, now_s: float) -> Job:
    """``job`` after the job decision ``d`` at ``now_s`` (a ``for_job``'s nomination: :func:`nominated`)."""
    transform = _AFTER.get(type(d))
    if transform is None:
        raise TypeError(f"not a job decision: {d!r}")
    return transform(job, d, now_s)


_AFTER: dict[type, Callable[[Job, Any, float], Job]] = {
    Admit: admitted, Grow: grown, Shrink: shrunk, Preempt: preempted, SetCkptInterval: interval_set}


def apply(s: Snapshot, decisions: Sequence[Decision]) -> Snapshot:
    """The snapshot after ``decisions`` at ``s.now_s`` (``s`` unchanged; queues in arrival order)."""
    now = s.now_s
    jobs = {j.id: j for j in s.jobs()}
    loans = {ln.node: ln for ln in s.loans}
    reclaims: list[Reclaim] = list(s.reclaims)

    def job(jid: str, d: Decision) -> Job:
        j = jobs.get(jid)
        if j is None:
            raise IllegalDecision(f"{d}: no job {jid!r} in the snapshot")
        return j

    for d in decisions:
        if isinstance(d, ReturnGpus):
            held = sum(j.placement.get(d.node, 0) for j in jobs.values())
            loans, reclaims = returned(loans, reclaims, d, held)
            continue
        if type(d) not in _AFTER:
            raise TypeError(f"unknown decision {d!r}")
        jobs[d.job] = after(job(d.job, d), d, now)
        if isinstance(d, Shrink | Preempt) and d.for_job is not None:
            jobs[d.for_job] = nominated(job(d.for_job, d), now)
    return Snapshot.build(now, s.nodes, s.tenants, jobs.values(), loans.values(), reclaims)

"""Victims: who gives GPUs back so that a need is met. Computing targets is separate from acting.

A *need* says when enough has been released: :class:`GangNeed` (a pending gang fits on the nodes it
may use, and its tenant's quota has room) or :class:`CountNeed` (a reclaim: so many GPUs on loaned
nodes). :func:`find_victims` is pure over a need and two candidate lists and returns the victims;
callers act on them through ``Cycle.issue_*``. The rules, in order:

1. Shrink before killing. Elastic candidates give back GPUs above their minimum, in units of their
   ``size_step`` (whole nodes for ``gpus_per_node`` jobs), only on nodes that help, one unit at a
   time until the need is met: nobody shrinks by more than needed.
2. Then preempt whole gangs, in the caller's order (least work lost first: freshest durable
   checkpoint; then lowest priority; then furthest over fair share).
3. Give back: victims are reconsidered newest first, and any the need can do without is spared
   (as Kueue does), so a big preemption late in the list spares earlier small ones.

If the need cannot be met even with every candidate, nothing is touched (no partial damage).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from tidal.model import Job, Reason
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.ordering import aged_priority
from tidal.policy.scheduling.placement import View, pack


class Need(Protocol):
    def helps(self, node: str) -> bool: ...
    def level(self, node: str) -> int: ...
    def release(self, node: str, gpus: int) -> None: ...
    def unrelease(self, node: str, gpus: int) -> None: ...
    def fits(self) -> bool: ...


class GangNeed:
    """A gang of ``size`` GPUs (``g`` per node, or any split) on the nodes in ``vfree`` (node -> GPUs free
    or draining); plus ``quota_short`` GPUs of quota its tenant must get back first."""

    def __init__(self, vfree: dict[str, int], size: int, g: int | None, quota_short: int = 0) -> None:
        self.vfree, self.size, self.g, self.quota_short = vfree, size, g, quota_short
        self.total = sum(vfree.values())
        self.ok_nodes = sum(1 for f in vfree.values() if f >= g) if g else 0

    def helps(self, node: str) -> bool:
        return node in self.vfree

    def level(self, node: str) -> int:
        return self.vfree.get(node, 0)

    def release(self, node: str, gpus: int) -> None:
        f = self.vfree.get(node)
        if f is None:
            return
        self.vfree[node] = f + gpus
        self.total += gpus
        if self.g and f < self.g <= f + gpus:
            self.ok_nodes += 1

    def unrelease(self, node: str, gpus: int) -> None:
        f = self.vfree.get(node)
        if f is None:
            return
        self.vfree[node] = f - gpus
        self.total -= gpus
        if self.g and f - gpus < self.g <= f:
            self.ok_nodes -= 1

    def fits(self) -> bool:
        if self.quota_short > 0:
            return False
        return self.total >= self.size if self.g is None else self.ok_nodes >= self.size // self.g


class CountNeed:
    """``need`` GPUs released on ``nodes`` (a reclaim of loaned GPUs)."""

    def __init__(self, nodes: set[str] | dict[str, object], need: int) -> None:
        self.nodes, self.need, self.got = nodes, need, 0

    def helps(self, node: str) -> bool:
        return node in self.nodes

    def level(self, node: str) -> int:
        return 0

    def release(self, node: str, gpus: int) -> None:
        if node in self.nodes:
            self.got += gpus

    def unrelease(self, node: str, gpus: int) -> None:
        if node in self.nodes:
            self.got -= gpus

    def fits(self) -> bool:
        return self.got >= self.need


class Victim:
    """One chosen victim: ``release`` is what it gives back (all of ``placement`` if ``preempt``)."""

    __slots__ = ("job", "release", "preempt", "reason", "quota")

    def __init__(self, job: Job, release: dict[str, int], preempt: bool, reason: Reason, quota: bool) -> None:
        self.job, self.release, self.preempt, self.reason, self.quota = job, release, preempt, reason, quota


def _apply(need: Need, v: Victim, sign: int) -> None:
    for node, g in v.release.items():
        (need.release if sign > 0 else need.unrelease)(node, g)
    if v.quota and isinstance(need, GangNeed):
        need.quota_short -= sign * sum(v.release.values())


def _shrink_release(job: Job, need: Need, quota: bool) -> dict[str, int]:
    """Release ``job``'s GPUs above its minimum on helpful nodes, one size step at a time, until the need
    is met or nothing more can go. Mutates ``need``; returns node -> GPUs released."""
    unit = job.size_step
    room = job.gpus - job.min_gpus
    nodes = sorted((n for n in job.placement if need.helps(n)), key=lambda n: (-need.level(n), n))
    out: dict[str, int] = {}
    if room < unit or not nodes:
        return out
    g = job.gpus_per_node
    gang = isinstance(need, GangNeed)
    if g:
        per = unit // g
        for u in range(min(room // unit, len(nodes) // per)):
            if need.fits():
                break
            for node in nodes[u * per:(u + 1) * per]:
                need.release(node, g)
                out[node] = g
            if quota and gang:
                need.quota_short -= unit
        return out
    left = {n: job.placement[n] for n in nodes}
    avail = min(room, sum(left.values())) // unit * unit
    i = 0
    while avail > 0 and not need.fits():
        chunk = unit
        while chunk:
            node = nodes[i]
            t = min(chunk, left[node])
            need.release(node, t)
            out[node] = out.get(node, 0) + t
            left[node] -= t
            chunk -= t
            if left[node] == 0:
                i += 1
        if quota and gang:
            need.quota_short -= unit
        avail -= unit
    return out


def find_victims(need: Need, shrinkable: Iterable[tuple[Job, Reason, bool]],
                 preemptable: Iterable[tuple[Job, Reason, bool]]) -> list[Victim] | None:
    """Compute victims for ``need`` (see the module docstring); ``None`` if it cannot be met.

    Candidates are ``(job, reason, frees_quota)`` in the order they should be tried. ``need`` is left
    in the state the returned victims produce.
    """
    chosen: list[Victim] = []
    if need.fits():
        return chosen
    by_id: dict[str, Victim] = {}
    for job, reason, quota in shrinkable:
        rel = _shrink_release(job, need, quota)
        if rel:
            v = Victim(job, rel, False, reason, quota)
            chosen.append(v)
            by_id[job.id] = v
        if need.fits():
            break
    if not need.fits():
        for job, reason, quota in preemptable:
            old = by_id.pop(job.id, None)
            if old is not None:  # preempting a job already picked for shrinking: undo the shrink
                _apply(need, old, -1)
                chosen.remove(old)
            v = Victim(job, dict(job.placement), True, reason, quota)
            _apply(need, v, +1)
            chosen.append(v)
            if need.fits():
                break
    if not need.fits():
        return None
    kept: list[Victim] = []
    for v in reversed(chosen):
        _apply(need, v, -1)
        if need.fits():
            continue  # not needed after all
        _apply(need, v, +1)
        kept.append(v)
    kept.reverse()
    return kept


def in_order(items: Sequence[tuple[tuple, tuple[Job, Reason, bool]]]) -> Iterator[tuple[Job, Reason, bool]]:
    """Yield candidates by key lazily (heapify is O(n); most searches stop after a few victims)."""
    heap = list(items)
    heapq.heapify(heap)
    while heap:
        yield heapq.heappop(heap)[1]


# ---------------------------------------------------------------------------------------------
# Targets for a pending job (the admission step's preemption path).


def protected(c: Cycle, job: Job) -> bool:
    """Started less than ``min_runtime_before_preempt_s`` ago."""
    return job.started_s is not None and c.now - job.started_s < c.cfg.min_runtime_before_preempt_s


def recently_grown(c: Cycle, job: Job) -> bool:
    return job.last_grown_s is not None and c.now - job.last_grown_s < c.cfg.hysteresis_s


def shrink_key(c: Cycle, job: Job) -> tuple:
    return (job.priority, -c.share(job.tenant), job.id)


def preempt_key(c: Cycle, job: Job) -> tuple:
    return (protected(c, job), job.work_lost_gpu_s(c.now), job.priority, -c.share(job.tenant), job.id)


def _victim_pool(c: Cycle) -> list[Job]:
    if c._victim_index is None:
        c._victim_index = [j for j in c.snap.running if not j.releasing_gpus]
    return c._victim_index  # type: ignore[return-value]


def targets_for(c: Cycle, job: Job, views: Sequence[View]) -> tuple[list[Victim], dict[str, int]] | None:
    """Victims that let pending ``job`` start at its minimum, and where it will start; ``None`` if none do.

    Dedicated job (its tenant's guarantee): any spot job on the training pool may be shrunk or
    preempted, min runtime notwithstanding; its own tenant's dedicated jobs may be shrunk (priority
    at most its aged priority, not grown within ``hysteresis_s``) or preempted (priority at least
    ``preempt_priority_gap`` lower, past the minimum runtime). Spot job: other spot jobs may be
    shrunk under the same rule, and preempted past their minimum runtime if their priority is at
    least the gap lower (``priority``) or equal-or-lower while their tenant would stay further over
    its fair share than the waiting job's tenant after the swap (``fair_share``).
    """
    cfg, now = c.cfg, c.now
    e = aged_priority(job, now, cfg)
    size, g = job.min_gpus, job.gpus_per_node
    vfree = {}
    for v in views:
        for node in v.placeable():
            vfree[node] = v.free[node] + v.draining.get(node, 0)
    ded = job.kind == "dedicated"
    quota_short = max(0, size - c.quota_room(job.tenant)) if ded else 0
    need = GangNeed(vfree, size, g, quota_short)
    shrink: list[tuple[tuple, tuple[Job, Reason, bool]]] = []
    pre: list[tuple[tuple, tuple[Job, Reason, bool]]] = []
    touched = c.touched
    share_after = c.share(job.tenant, size) if not ded else 0.0
    # Keys start with a class: for a dedicated job, spot victims (0) go before its tenant's own jobs (1).
    for v in _victim_pool(c):
        if v.id in touched:
            continue
        if v.kind == "spot":
            if not any(n in vfree for n in v.placement):
                continue
            if ded:
                if v.gpus > v.min_gpus:
                    shrink.append(((0, *shrink_key(c, v)), (v, "quota", False)))
                pre.append(((0, *preempt_key(c, v)), (v, "quota", False)))
                continue
            if v.priority <= e and v.gpus > v.min_gpus and not recently_grown(c, v):
                shrink.append(((0, *shrink_key(c, v)), (v, "demand", False)))
            if protected(c, v) or v.priority > e:
                continue
            if v.priority <= e - cfg.preempt_priority_gap:
                pre.append(((0, *preempt_key(c, v)), (v, "priority", False)))
            elif v.tenant != job.tenant and share_after < c.share(v.tenant, -v.gpus):
                pre.append(((0, *preempt_key(c, v)), (v, "fair_share", False)))
        elif ded and v.tenant == job.tenant:
            if v.priority <= e and v.gpus > v.min_gpus and not recently_grown(c, v):
                shrink.append(((1, *shrink_key(c, v)), (v, "demand", True)))
            if v.priority <= e - cfg.preempt_priority_gap and not protected(c, v):
                pre.append(((1, *preempt_key(c, v)), (v, "priority", True)))
    if quota_short:
        own_pre = {v.id: v.gpus for _, (v, _, q) in pre if q}
        room = sum(own_pre.values())
        room += sum(v.gpus - v.min_gpus for _, (v, _, q) in shrink if q and v.id not in own_pre)
        if room < quota_short:
            return None  # even all of the tenant's own jobs would not make room in its quota
    shrink.sort(key=lambda t: t[0])
    victims = find_victims(need, [x for _, x in shrink], in_order(pre))
    if victims is None:
        return None
    placement = pack(need.vfree, size, g)
    assert placement is not None, "a met need packs"
    return victims, placement


def reserve(c: Cycle, job: Job, placement: dict[str, int]) -> None:
    """Hold ``placement`` for ``job`` until its victims have drained: the free and draining GPUs it
    uses are taken out of the views (so nobody else is placed there in this call) and its usage is
    counted against its quota and share."""
    for node, t in placement.items():
        view = c.training if c.pool_of[node] == "training" else c.loan
        f = min(t, view.free.get(node, 0))
        if f:
            view.take(node, f)
            t -= f
        d = min(t, view.draining.get(node, 0))
        if d:
            view.claim_draining(node, d)
    c._count(job, sum(placement.values()))


def preempt_for(c: Cycle, job: Job) -> bool:
    """Compute targets for ``job``, then act: issue shrinks and preemptions and reserve its place."""
    views = [c.training] if job.kind == "dedicated" else [c.loan, c.training]
    found = targets_for(c, job, views)
    if found is None:
        return False
    victims, placement = found
    by_s = c.now + c.cfg.preempt_grace_s
    for v in victims:
        claimed = {n: g for n, g in v.release.items() if n in placement}
        if v.preempt:
            c.issue_preempt(v.job, v.reason, by_s, job.id, claimed)
        else:
            c.issue_shrink(v.job, v.release, v.reason, by_s, job.id, claimed)
    reserve(c, job, placement)
    return True

"""Victims: who gives GPUs back so that a need is met, computed apart from acting.

A need (:class:`GangNeed`: a pending gang fits, with quota room; :class:`CountNeed`: a reclaim) and
two candidate lists in; victims out (:func:`find_victims`): shrink before killing (only where and as
much as it helps), then preempt whole gangs in the caller's order, then spare any victim the need can
do without, newest first. If the need cannot be met, nothing is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from tidal.model import Job, Reason
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.placement import View


class Need(Protocol):
    """What a search tries to meet; victims' releases are added to it one by one."""

    quota_short: int  # GPUs of quota still to be freed (only a dedicated gang has any)

    def helps(self, node: str) -> bool: ...  # GPUs released on this node count at all
    def level(self, node: str) -> int: ...  # GPUs available on this node so far
    def want(self, node: str) -> int: ...  # more GPUs on this node that would still help
    def release(self, node: str, gpus: int) -> None: ...
    def unrelease(self, node: str, gpus: int) -> None: ...
    def room_fits(self) -> bool: ...  # met but for quota
    def fits(self) -> bool: ...


class GangNeed:
    """A gang of ``size`` GPUs (``g`` per node, or any split) on the nodes in ``allowed``, counting GPUs
    free or draining there; plus ``quota_short`` GPUs of quota its tenant must get back first."""

    def __init__(self, views: Sequence[View], allowed: AbstractSet[str], size: int, g: int | None,
                 quota_short: int = 0) -> None:
        self.allowed, self.size, self.g, self.quota_short = allowed, size, g, quota_short
        vfree: dict[str, int] = {}
        for v in views:
            for f in range(1, len(v.buckets)):
                for node in v.buckets[f]:
                    vfree[node] = f
            for node, d in v.draining.items():
                if node in allowed:
                    vfree[node] = v.free[node] + d
        self.vfree = vfree
        self.total = sum(vfree.values())
        self.ok_nodes = sum(1 for f in vfree.values() if f >= g) if g else 0

    def helps(self, node: str) -> bool:
        return node in self.allowed

    def level(self, node: str) -> int:
        return self.vfree.get(node, 0)

    def want(self, node: str) -> int:
        if self.g is None:
            return max(0, self.size - self.total)
        f = self.vfree.get(node, 0)
        return self.g - f if f < self.g else 0

    def release(self, node: str, gpus: int) -> None:
        if node not in self.allowed:
            return
        f = self.vfree.get(node, 0)
        self.vfree[node] = f + gpus
        self.total += gpus
        if self.g and f < self.g <= f + gpus:
            self.ok_nodes += 1

    def unrelease(self, node: str, gpus: int) -> None:
        if node not in self.allowed:
            return
        f = self.vfree[node]
        self.vfree[node] = f - gpus
        self.total -= gpus
        if self.g and f - gpus < self.g <= f:
            self.ok_nodes -= 1

    def room_fits(self) -> bool:
        """The gang fits on the nodes (quota aside)."""
        return self.total >= self.size if self.g is None else self.ok_nodes >= self.size // self.g

    def fits(self) -> bool:
        return self.quota_short <= 0 and self.room_fits()


class CountNeed:
    """``need`` GPUs released on ``nodes`` (a reclaim); a node's level is minus what would still be held
    there (``used``), so releases go first where they empty a node."""

    quota_short = 0

    def __init__(self, nodes: set[str] | Mapping[str, object], need: int, used: dict[str, int]) -> None:
        self.nodes, self.need, self.got, self.used = nodes, need, 0, used
        self.released: dict[str, int] = {}

    def helps(self, node: str) -> bool:
        return node in self.nodes

    def level(self, node: str) -> int:
        return self.released.get(node, 0) - self.used.get(node, 0)

    def want(self, node: str) -> int:
        return max(0, self.need - self.got)

    def release(self, node: str, gpus: int) -> None:
        if node in self.nodes:
            self.got += gpus
            self.released[node] = self.released.get(node, 0) + gpus

    def unrelease(self, node: str, gpus: int) -> None:
        if node in self.nodes:
            self.got -= gpus
            self.released[node] -= gpus

    def fits(self) -> bool:
        return self.got >= self.need

    room_fits = fits


class Victim:
    """One chosen victim: ``release`` is what it gives back (all of ``placement`` if ``preempt``)."""

    __slots__ = ("job", "release", "preempt", "reason", "quota")

    def __init__(self, job: Job, release: dict[str, int], preempt: bool, reason: Reason, quota: bool) -> None:
        self.job, self.release, self.preempt, self.reason, self.quota = job, release, preempt, reason, quota


def _apply(need: Need, v: Victim, sign: int) -> None:
    for node, g in v.release.items():
        (need.release if sign > 0 else need.unrelease)(node, g)
    if v.quota:
        need.quota_short -= sign * sum(v.release.values())


def _shrink_release(job: Job, need: Need, quota: bool) -> dict[str, int]:
    """Release ``job``'s GPUs above its minimum on helpful nodes (those still wanting GPUs, fullest
    first) until the need is met, in whole size steps; ``quota``: they also give quota back. Mutates
    ``need``; returns node -> GPUs released."""
    unit = job.size_step
    room = (job.gpus - job.min_gpus) // unit * unit
    out: dict[str, int] = {}
    done = need.fits if quota else need.room_fits  # GPUs that give no quota back only help the room
    if room < unit or done():
        return out
    nodes = sorted(
        (n for n in job.placement if need.helps(n)), key=lambda n: (need.want(n) == 0, -need.level(n), n)
    )
    if not nodes:
        return out
    g = job.gpus_per_node
    if g:  # whole nodes, unit // g of them per step
        per = unit // g
        for u in range(min(room // unit, len(nodes) // per)):
            if done():
                break
            for node in nodes[u * per:(u + 1) * per]:
                need.release(node, g)
                out[node] = g
            if quota:
                need.quota_short -= unit
        return out
    released = 0
    for node in nodes:
        if released >= room or done():
            break
        w = max(need.want(node), need.quota_short - released if quota else 0)
        t = min(job.placement[node], w, room - released)
        if t > 0:
            need.release(node, t)
            out[node] = t
            released += t
    extra = -released % unit
    if extra and room - released >= extra:  # round up to a whole step, on any helpful node
        for node in nodes:
            t = min(extra, job.placement[node] - out.get(node, 0))
            if t > 0:
                need.release(node, t)
                out[node] = out.get(node, 0) + t
                released += t
                extra -= t
            if not extra:
                break
    if released % unit:  # could not round up: round down
        cut = released % unit
        for node in reversed(list(out)):
            t = min(cut, out[node])
            need.unrelease(node, t)
            out[node] -= t
            released -= t
            cut -= t
            if not out[node]:
                del out[node]
            if not cut:
                break
    if quota:
        need.quota_short -= released
    return out


def find_victims(need: Need, shrinkable: Iterable[tuple[Job, Reason, bool]],
                 preemptable: Iterable[tuple[Job, Reason, bool]]) -> list[Victim] | None:
    """Victims for ``need`` from ``(job, reason, frees_quota)`` candidates in the order to try them;
    ``None`` if it cannot be met. ``need`` is left as the victims make it."""
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
            if not quota and need.room_fits():
                continue  # only quota is missing, and this one gives none back
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


def protected(c: Cycle, job: Job) -> bool:
    """Started less than ``min_runtime_before_preempt_s`` ago."""
    return job.started_s is not None and c.now - job.started_s < c.cfg.min_runtime_before_preempt_s


def recently_grown(c: Cycle, job: Job) -> bool:
    return job.last_grown_s is not None and c.now - job.last_grown_s < c.cfg.hysteresis_s


def shrink_key(c: Cycle, job: Job) -> tuple:
    """Shrink order, smaller first: lowest priority, then the tenant furthest over its fair share."""
    return (job.priority, -c.share(job.tenant), job.id)


def preempt_keys(c: Cycle, jobs: Iterable[Job]) -> dict[str, tuple]:
    """Preemption order, smaller first: ``(protected, work lost in GPU-seconds, priority, -share, id)``
    (the victim index sorts by the same keys as columns)."""
    now = c.now
    shares = {t: -c.share(t) for t in c.tenants}
    return {j.id: (protected(c, j), j.work_lost_gpu_s(now), j.priority, shares[j.tenant], j.id) for j in jobs}


"""The admission step's preemption path: targets for one pending job (computed), then acting on them.

:func:`targets_for` returns the victims and where the job will start, changing nothing;
:func:`preempt_for` issues the shrinks and preemptions and reserves the job's place. Who may lose GPUs
to whom (``priority`` within a tenant, ``fair_share`` across tenants; aging never lets a job preempt):
docs/scheduling.md, "Who may lose GPUs to whom".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import numpy as np

from tidal.model import Job, Reason
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.placement import View, pack
from tidal.policy.scheduling.preemption import (
    GangNeed,
    Victim,
    find_victims,
    protected,
    recently_grown,
    shrink_key,
)
from tidal.policy.scheduling.victims import victim_index

Cand = tuple[Job, Reason, bool]  # (job, reason, frees its tenant's quota)
WALK_BLOCK = 256  # candidates given as columns are read by blocks of this many positions


def _allowed(c: Cycle, views: Sequence[View]) -> AbstractSet[str]:
    """The nodes of ``views`` open to placement (read only)."""
    key = tuple(v.name for v in views)
    got = c.allowed_nodes.get(key)
    if got is None:
        index = c.index
        if index is not None and c.used is index.used and key in _INDEX_KEYS:
            # The views hold every training node and every loaned one (blocked: c.loan.blocked): the index
            # keeps both sets across calls.
            training, placeable = index.placeable(c.loan.blocked)
            got = training if key == ("training",) else placeable
        else:
            mine: set[str] = set()
            for v in views:  # the nodes of v.free not in v.blocked (set operations, not a Python loop)
                mine.update(v.free.keys() - v.blocked if v.blocked else v.free)
            got = mine
        c.allowed_nodes[key] = got
    return got


_INDEX_KEYS = (("training",), ("loan", "training"))  # the views whose nodes RunningIndex.placeable keeps


def _candidates(c: Cycle, job: Job, quota_short: int
                ) -> tuple[list[Cand], Iterator[Cand] | _PreCols] | None:
    """Shrink candidates (a list) and preemption candidates (lazily, the search usually stops early; or as
    columns), each in the order to try them; ``None`` if the job's tenant cannot get the quota it lacks."""
    cfg = c.cfg
    e = job.priority  # aging orders the queue; it never lets a job preempt (no ping-pong)
    gap = cfg.preempt_priority_gap
    idx = victim_index(c)
    touched = c.touched
    if job.kind == "dedicated":
        own_shrink: list[Cand] = []
        own_pre: list[Cand] = []
        room = 0
        for v in idx.dedicated_order(c, job.tenant):
            if v.id in touched or v.priority > e:
                continue
            if v.priority <= e - gap and not protected(c, v):
                own_pre.append((v, "priority", True))
                room += v.gpus
            elif v.gpus > v.min_gpus and not recently_grown(c, v):
                room += v.gpus - v.min_gpus
            if v.gpus > v.min_gpus and not recently_grown(c, v):
                own_shrink.append((v, "demand", True))
        if room < quota_short:
            return None  # even all of the tenant's own jobs would not make room in its quota
        own_shrink.sort(key=lambda t: shrink_key(c, t[0]))
        on_t = idx.on_training
        spot_shrink: list[Cand] = [
            (v, "quota", False) for v in idx.spot_shrink if v.id in on_t and v.id not in touched
        ]
        spot_pre: Iterator[Cand] = ((v, "quota", False) for v in idx.spot_pre_training()
                                    if v.id not in touched)
        if quota_short:  # only the tenant's own jobs give quota back: try them first
            return own_shrink + spot_shrink, itertools.chain(own_pre, spot_pre)
        return spot_shrink + own_shrink, itertools.chain(spot_pre, own_pre)
    on_t, on_l = idx.on_training, idx.on_loan
    shrink: list[Cand] = [(v, "demand", False) for v in idx.spot_shrink if v.priority <= e and (
        v.id in on_t or v.id in on_l) and v.id not in touched and not recently_grown(c, v)]
    cols = _spot_pre_cols(c, job, e)
    return shrink, _spot_pre(c, job, e) if cols is None else cols


class _PreCols(NamedTuple):
    """:func:`_spot_pre`'s candidates as the victim index's columns: positions in its ``spot`` jobs, in
    victim order, and which are of the pending job's own tenant; those in ``c.touched`` still in."""

    pos: np.ndarray
    own: np.ndarray


def _share_left(c: Cycle, t: str, gpus: int) -> float:
    """``c.share(t, -gpus)`` (a hot path): tenant ``t``'s share of its spot GPUs less ``gpus``."""
    held = c.spot_held[t] - gpus
    if held <= 0:
        return 0.0
    f = c.fair.get(t, 0.0)
    return held / f if f > 0 else math.inf


def _spot_pre_cols(c: Cycle, job: Job, e: int) -> _PreCols | None:
    """:func:`_spot_pre` by columns (``None``: no columns): whole (priority, tenant) groups that cannot yield
    a victim (even by their smallest job) dropped in one mask, then each job's own check as columns."""
    idx = victim_index(c)
    got = idx.open_group_codes()
    if got is None:
        return None
    o = idx._cols
    assert o is not None and c.index is not None
    gap = c.cfg.preempt_priority_gap
    share_after = c.share(job.tenant, job.min_gpus)
    codes, groups, n_codes = got
    keep = np.zeros(n_codes, dtype=bool)
    for p, t, k, fewest in groups:
        if p <= e and (
            (t == job.tenant and p <= e - gap)
            or (t != job.tenant and share_after <= _share_left(c, t, fewest))
        ):
            keep[k] = True
    pos = o.open_order[keep[codes]]  # positions in o.spot, in victim order
    # The kept groups hold only jobs at priority <= e, and of the job's own tenant only those a priority gap
    # below it, so only another tenant's share after is left.
    tenant, gpus = o.tenant[pos], o.gpus[pos]
    own = tenant == c.index.tenant_code.get(job.tenant, -1)
    spot_held, fair = c.spot_held, c.fair
    held = np.array([spot_held.get(t, 0) for t in o.tenant_names])[tenant] - gpus
    f = np.array([fair.get(t, 0.0) for t in o.tenant_names])[tenant]
    with np.errstate(divide="ignore", invalid="ignore"):
        share_left = np.where(held <= 0, 0.0, np.where(f > 0, held / f, math.inf))  # as _share_left()
    ok = own | (share_after <= share_left)
    return _PreCols(pos[ok], own[ok])


def _pre_from_cols(c: Cycle, pre: _PreCols) -> Iterator[Cand]:
    """The candidates of ``pre``, lazily, those in ``c.touched`` left out."""
    o = victim_index(c)._cols
    assert o is not None
    spot, touched = o.spot, c.touched
    pos, own = pre
    for a in range(0, pos.size, WALK_BLOCK):  # (a search usually stops early: read the columns by blocks)
        for i, mine in zip(pos[a:a + WALK_BLOCK].tolist(), own[a:a + WALK_BLOCK].tolist(), strict=True):
            v = spot[i]
            if v.id not in touched:
                yield (v, "priority" if mine else "fair_share", False)


def _spot_pre(c: Cycle, job: Job, e: int) -> Iterator[Cand]:
    """``spot_pre_open`` filtered for ``job`` (priority ``e``), lazily, in victim order; whole (priority,
    tenant) groups that cannot yield a victim (even by their smallest job) are skipped first. (Without the
    index's columns: else :func:`_spot_pre_cols`.)"""
    idx = victim_index(c)
    gap = c.cfg.preempt_priority_gap
    share_after = c.share(job.tenant, job.min_gpus)
    touched = c.touched
    parts = [ranks for p, t, ranks, fewest in idx.open_groups()
             if p <= e and ((t == job.tenant and p <= e - gap)
                            or (t != job.tenant and share_after <= _share_left(c, t, fewest)))]
    if not parts:
        return
    ranks = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
    seq = idx.spot_pre_open
    for r in ranks.tolist():  # not protected, on a usable node
        v = seq[r]
        if v.priority > e or v.id in touched:
            continue
        if v.tenant == job.tenant:  # priority preempts only within a tenant; across tenants, fair share only
            if v.priority <= e - gap:
                yield (v, "priority", False)
        elif share_after <= _share_left(c, v.tenant, v.gpus):
            yield (v, "fair_share", False)


def _node_counter(need: GangNeed) -> tuple[Callable[[int, Job, int], None], list[str], dict[str, list[int]]]:
    """For a ``gpus_per_node`` gang, what candidates could give back per node: ``count(i, v, room)`` adds
    candidate ``i`` (``v``, at most ``room`` GPUs a node); ``done``: the nodes that could reach ``g`` (what
    they have plus what is given back) in the order they did; ``on``: node -> the candidates there (the
    nodes short of ``g``)."""
    g, allowed, vfree = need.g, need.allowed, need.vfree
    assert g is not None
    pot: dict[str, int] = {}  # node -> GPUs it could have free
    done: list[str] = []
    on: dict[str, list[int]] = {}
    vget, pget, oget = vfree.get, pot.get, on.get

    def count(i: int, v: Job, room: int) -> None:
        for n, t in v.placement.items():
            if n in allowed:
                f = vget(n, 0)
                if f < g:
                    at = oget(n)
                    if at is None:
                        on[n] = [i]
                    else:
                        at.append(i)
                    before = pget(n, f)
                    after = before + (t if t < room else room)
                    pot[n] = after
                    if before < g <= after:
                        done.append(n)

    return count, done, on


def _focus_nodes(need: GangNeed, shrink: list[Cand], pre: Iterator[Cand]
                 ) -> tuple[list[Cand], list[Cand]] | None:
    """For a ``gpus_per_node`` gang: the cheapest nodes to clear (walk the candidates in order until
    enough nodes could be whole) and the candidates on them (the plain order is blind to nodes)."""
    assert need.g is not None
    missing = need.size // need.g - need.ok_nodes
    count, done, on = _node_counter(need)
    givers: list[int] = []  # positions of the candidates giving their tenant quota back
    quota = 0  # quota the candidates seen could give back
    for i, (v, _, q) in enumerate(shrink):
        room = v.gpus - v.min_gpus
        if q:
            quota += room
            givers.append(i)
        count(i, v, room)
    seen: list[Cand] = []
    ns = len(shrink)
    if len(done) < missing or quota < need.quota_short:
        for x in pre:
            v = x[0]
            if x[2]:
                quota += v.gpus
                givers.append(ns + len(seen))
            count(ns + len(seen), v, v.gpus)
            seen.append(x)
            if len(done) >= missing and quota >= need.quota_short:
                break
    if len(done) < missing or quota < need.quota_short:
        return None
    keep = set(givers)  # on a chosen node, or giving the tenant quota back
    for n in done[:missing]:
        keep.update(on[n])
    ks = sorted(keep)
    return [shrink[i] for i in ks if i < ns], [seen[i - ns] for i in ks if i >= ns]


def _focus_cols(c: Cycle, need: GangNeed, shrink: list[Cand], pre: _PreCols
                ) -> tuple[list[Cand], list[Cand]] | None:
    """:func:`_focus_nodes` for a spot gang (no quota to give back) whose preemption candidates are columns:
    the same walk over the positions, a candidate's tuple made only if it is kept (a walk reads a few
    hundred small jobs to clear a node or two)."""
    g = need.g
    assert g is not None and need.quota_short == 0
    missing = need.size // g - need.ok_nodes
    count, done, on = _node_counter(need)
    for i, (v, _, _) in enumerate(shrink):
        count(i, v, v.gpus - v.min_gpus)
    ns = len(shrink)
    walked: list[int] = []  # the candidates walked, by their index in ``pre``
    o = victim_index(c)._cols
    assert o is not None
    spot = o.spot
    if len(done) < missing:
        touched = c.touched
        k = ns
        for a in range(0, pre.pos.size, WALK_BLOCK):  # (the walk usually stops early: read by blocks)
            for j, i in enumerate(pre.pos[a:a + WALK_BLOCK].tolist(), a):
                v = spot[i]
                if v.id in touched:
                    continue
                count(k, v, v.gpus)
                walked.append(j)
                k += 1
                if len(done) >= missing:
                    break
            else:
                continue
            break
        else:
            return None
    keep: set[int] = set()
    for n in done[:missing]:
        keep.update(on[n])
    ks = sorted(keep)
    pos, own = pre.pos, pre.own
    return [shrink[i] for i in ks if i < ns], [
        (spot[int(pos[walked[i - ns]])], "priority" if own[walked[i - ns]] else "fair_share", False)
        for i in ks if i >= ns]


def targets_for(c: Cycle, job: Job) -> tuple[list[Victim], dict[str, int]] | None:
    """Victims that let pending ``job`` start at its minimum, and the placement it will get; ``None``
    if no allowed set of victims does it. Changes nothing in ``c``."""
    views = c.views_for(job)[-1]
    size, g = job.min_gpus, job.gpus_per_node
    quota_short = max(0, size - c.quota_room(job.tenant)) if job.kind == "dedicated" else 0
    need = GangNeed(views, _allowed(c, views), size, g, quota_short)
    shrink: list[Cand] = []
    pre: Iterable[Cand] = ()
    if not need.fits():
        cands = _candidates(c, job, quota_short)
        if cands is None:
            return None
        shrink, found = cands
        if g is not None:
            focused = (_focus_cols(c, need, shrink, found) if isinstance(found, _PreCols)
                       else _focus_nodes(need, shrink, found))
            if focused is None:
                return None
            shrink, pre = focused
        else:
            pre = _pre_from_cols(c, found) if isinstance(found, _PreCols) else found
    victims = find_victims(need, shrink, pre)
    if victims is None:
        return None
    placement = pack(need.vfree, size, g)
    assert placement is not None, "a met need packs"
    return victims, placement


def reserve(c: Cycle, job: Job, placement: dict[str, int]) -> None:
    """Hold ``placement`` for ``job`` while its victims drain: its GPUs leave the views and count against
    its tenant's quota and share as if admitted."""
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
    """Compute targets for ``job``, then act: issue shrinks and preemptions, reserve its place."""
    found = targets_for(c, job)
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

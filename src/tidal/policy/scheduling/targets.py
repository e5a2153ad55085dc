"""The admission step's preemption path: targets for one pending job (computed), then acting on them.

:func:`targets_for` decides who may lose GPUs to a pending job and returns the victims that
:func:`~tidal.policy.scheduling.preemption.find_victims` chose, plus where the job will start; it
changes nothing. :func:`preempt_for` acts: it issues the shrinks and preemptions and reserves the
job's future place, so nobody else is placed there while the victims drain.

Who may lose GPUs to whom (priorities here are the jobs' own: aging only orders the queue, so a
requeued victim that has waited long can never turn around and preempt its preemptor):

* a **dedicated** job (its tenant's guarantee): any spot job on the training pool may be shrunk or
  preempted, minimum runtime notwithstanding (victims past it still go first); its own tenant's
  dedicated jobs may be shrunk (priority at most its own, not grown within
  ``hysteresis_s``) or preempted (priority at least ``preempt_priority_gap`` lower, past the minimum
  runtime). Other tenants' dedicated jobs are never touched.
* a **spot** job: other spot jobs may be shrunk under the same rule, and preempted past their
  minimum runtime if their priority is at least the gap lower (``priority``), or equal or lower
  while, after the swap, the waiting job's tenant would be no further over its fair share than the
  victim's (``fair_share``, Kueue's LessThanOrEqualToFinalShare). The swap back is then never
  allowed: it would need the victim's tenant, holding more, to end at or below the other.

Cost: the first search in a call indexes the running jobs once (sorted by victim key); each search
then filters those lists (O(running), simple comparisons) and stops as soon as the need is met.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

from tidal.model import Job, Reason
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.placement import View, pack
from tidal.policy.scheduling.preemption import (
    GangNeed,
    Victim,
    find_victims,
    preempt_keys,
    protected,
    recently_grown,
    shrink_key,
)

Cand = tuple[Job, Reason, bool]  # (job, reason, frees its tenant's quota)


class VictimIndex:
    """Running jobs that could give GPUs back in this call, indexed on the first search.

    ``spot_pre``: spot jobs by preemption key (least work lost first); ``spot_shrink``: elastic spot
    jobs above their minimum by shrink key; ``dedicated``: per tenant. ``on_training`` / ``on_loan``:
    spot job ids with GPUs on training nodes / on loaned nodes open to placement. Keys are computed
    once per call (shares move a little as the call goes on; the order they give is close enough).
    """

    def __init__(self, c: Cycle) -> None:
        spot: list[Job] = []
        self.dedicated: dict[str, list[Job]] = {}
        self.on_training: set[str] = set()  # spot job ids with GPUs on training nodes
        self.on_loan: set[str] = set()  # ... on loaned nodes open to placement
        self.on_any_loan: set[str] = set()  # ... on any loaned node (reclaims)
        pool_of, blocked = c.pool_of, c.loan.blocked
        # With the caller's RunningIndex, each job's nodes are already split into training and other.
        where = c.index.where if c.index is not None and c.used is c.index.used else None
        on_t, on_l, on_a = self.on_training, self.on_loan, self.on_any_loan
        for j in c.snap.running:
            if j.releasing_gpus:
                continue
            if j.kind == "dedicated":
                self.dedicated.setdefault(j.tenant, []).append(j)
                continue
            if where is not None:
                training, others = where[id(j)]
                if training:
                    on_t.add(j.id)
                for n in others:
                    if pool_of.get(n) == "loan":
                        on_a.add(j.id)
                        if n not in blocked:
                            on_l.add(j.id)
                spot.append(j)
                continue
            for n in j.placement:
                p = pool_of.get(n)
                if p == "training":
                    on_t.add(j.id)
                elif p == "loan":
                    on_a.add(j.id)
                    if n not in blocked:
                        on_l.add(j.id)
            spot.append(j)
        keys = preempt_keys(c, spot)
        self.protected = {jid for jid, k in keys.items() if k[0]}
        # Keys end with the (unique) job id, so sorting (key, job) pairs never compares jobs.
        self.spot_pre = [j for _, j in sorted(zip([keys[j.id] for j in spot], spot, strict=True))]
        # The spot preemption candidates for a spot job: past their minimum runtime, on a node it may use.
        on_t, on_l, prot = self.on_training, self.on_loan, self.protected
        self.spot_pre_open = [j for j in self.spot_pre if j.id not in prot and (j.id in on_t or j.id in on_l)]
        shares = {t: -c.share(t) for t in c.tenants}  # shrink_key, inlined
        self.spot_shrink = sorted((j for j in spot if j.gpus > j.min_gpus),
                                  key=lambda j: (j.priority, shares[j.tenant], j.id))
        self._pre_training: list[Job] | None = None

    def spot_pre_training(self) -> list[Job]:
        """``spot_pre`` restricted to jobs with GPUs on training nodes (a dedicated job's candidates)."""
        if self._pre_training is None:
            on_t = self.on_training
            self._pre_training = [j for j in self.spot_pre if j.id in on_t]
        return self._pre_training


def victim_index(c: Cycle) -> VictimIndex:
    if c._victim_index is None:
        c._victim_index = VictimIndex(c)
    return c._victim_index  # type: ignore[return-value]


def _allowed(c: Cycle, views: Sequence[View]) -> set[str]:
    key = tuple(v.name for v in views)
    got = c.allowed_nodes.get(key)
    if got is None:
        got = set()
        for v in views:
            got.update(n for n in v.free if n not in v.blocked)
        c.allowed_nodes[key] = got
    return got


def _candidates(c: Cycle, job: Job, quota_short: int) -> tuple[list[Cand], Iterator[Cand]] | None:
    """Shrink candidates (a list) and preemption candidates (lazily, the search usually stops early),
    each in the order to try them; ``None`` if the job's tenant cannot get the quota it lacks."""
    cfg = c.cfg
    e = job.priority  # aging orders the queue; it never lets a job preempt (no ping-pong)
    gap = cfg.preempt_priority_gap
    idx = victim_index(c)
    touched = c.touched
    if job.kind == "dedicated":
        own_shrink: list[Cand] = []
        own_pre: list[Cand] = []
        room = 0
        own = idx.dedicated.get(job.tenant, [])
        own_keys = preempt_keys(c, own)
        for v in sorted(own, key=lambda j: own_keys[j.id]):
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
        spot_shrink: list[Cand] = [(v, "quota", False) for v in idx.spot_shrink if v.id in on_t and v.id not in touched]
        spot_pre = ((v, "quota", False) for v in idx.spot_pre_training() if v.id not in touched)
        if quota_short:  # only the tenant's own jobs give quota back: try them first
            return own_shrink + spot_shrink, itertools.chain(own_pre, spot_pre)
        return spot_shrink + own_shrink, itertools.chain(spot_pre, own_pre)
    on_t, on_l = idx.on_training, idx.on_loan
    shrink: list[Cand] = []
    for v in idx.spot_shrink:
        if v.priority <= e and (v.id in on_t or v.id in on_l) and v.id not in touched and not recently_grown(c, v):
            shrink.append((v, "demand", False))
    return shrink, _spot_pre(c, job, e)


def _spot_pre(c: Cycle, job: Job, e: int) -> Iterator[Cand]:
    idx = victim_index(c)
    gap = c.cfg.preempt_priority_gap
    share_after = c.share(job.tenant, job.min_gpus)
    touched, spot_held, fair = c.touched, c.spot_held, c.fair
    inf = math.inf
    for v in idx.spot_pre_open:  # not protected, on a node the job may use
        if v.priority > e or v.id in touched:
            continue
        if v.priority <= e - gap:
            yield (v, "priority", False)
        elif v.tenant != job.tenant:
            held = spot_held[v.tenant] - v.gpus  # c.share(v.tenant, -v.gpus), inlined
            if held <= 0:
                after = 0.0
            else:
                f = fair.get(v.tenant, 0.0)
                after = held / f if f > 0 else inf
            if share_after <= after:
                yield (v, "fair_share", False)


def _focus_nodes(need: GangNeed, shrink: list[Cand], pre: Iterator[Cand]) -> tuple[list[Cand], list[Cand]] | None:
    """For a ``gpus_per_node`` gang: the nodes to clear and the candidates on them.

    The greedy victim order alone is blind to nodes and would release GPUs all over the pool before
    k nodes are whole. Instead walk the candidates in order (shrinks, then preemptions, cheapest
    first), adding up what each node could get back, and stop as soon as enough nodes could be
    completed: those nodes are the cheapest to clear, and only candidates seen on them are kept.
    """
    g, allowed, vfree = need.g, need.allowed, need.vfree
    assert g is not None
    missing = need.size // g - need.ok_nodes
    pot: dict[str, int] = {}
    done: list[str] = []

    def add(n: str, t: int) -> None:
        before = pot.get(n, vfree.get(n, 0))
        pot[n] = before + t
        if before < g <= before + t:
            done.append(n)

    quota = 0  # quota the candidates seen could give back
    for v, _, q in shrink:
        room = v.gpus - v.min_gpus
        if q:
            quota += room
        for n, t in v.placement.items():
            if n in allowed and vfree.get(n, 0) < g:
                add(n, min(t, room))
    seen: list[Cand] = []
    if len(done) < missing or quota < need.quota_short:
        for x in pre:
            seen.append(x)
            if x[2]:
                quota += x[0].gpus
            for n, t in x[0].placement.items():
                if n in allowed and vfree.get(n, 0) < g:
                    add(n, t)
            if len(done) >= missing and quota >= need.quota_short:
                break
    if len(done) < missing or quota < need.quota_short:
        return None
    nodes = set(done[:missing])

    def keep(x: Cand) -> bool:  # on a chosen node, or giving the tenant quota back
        return x[2] or any(n in nodes for n in x[0].placement)

    return [x for x in shrink if keep(x)], [x for x in seen if keep(x)]


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
        shrink, pre = cands
        if g is not None:
            focused = _focus_nodes(need, shrink, pre)
            if focused is None:
                return None
            shrink, pre = focused
    victims = find_victims(need, shrink, pre)
    if victims is None:
        return None
    placement = pack(need.vfree, size, g)
    assert placement is not None, "a met need packs"
    return victims, placement


def reserve(c: Cycle, job: Job, placement: dict[str, int]) -> None:
    """Hold ``placement`` for ``job`` while its victims drain: the free and draining GPUs it will use
    leave the views (nobody else is placed there in this call), and it counts against its tenant's
    quota and share as if admitted."""
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

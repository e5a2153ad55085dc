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
  minimum runtime if they are its own tenant's and their priority is at least the gap lower
  (``priority``: a tenant chooses its jobs' priorities, so priority never preempts across tenants),
  or another tenant's of equal or lower priority
  while, after the swap, the waiting job's tenant would be no further over its fair share than the
  victim's (``fair_share``, Kueue's LessThanOrEqualToFinalShare). The swap back is then never
  allowed: it would need the victim's tenant, holding more, to end at or below the other.

Cost: the first search in a call indexes the running jobs once (ordered by victim key with one
``numpy.lexsort``; with the caller's ``RunningIndex`` the jobs come pre-split by kind and pool, sorted
by id with their fixed key columns, so only ``last_ckpt_s`` (not even that when the caller reports its
moves) and the shares are read per call and the orders stay index arrays until a list is asked for);
each search then filters those lists and stops as soon as the need is met. A spot job's search skips
whole (priority, tenant) groups that cannot yield a victim (see :func:`_spot_pre`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from tidal.model import Job, Reason
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.index import RunningIndex, SpotColumns
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

    With the caller's ``RunningIndex`` the orders are index arrays over its id-sorted spot jobs and
    the lists are made only when read (:attr:`spot_pre`, :attr:`protected`, :attr:`spot_pre_open`).
    """

    def __init__(self, c: Cycle) -> None:
        self.dedicated: dict[str, list[Job]] = {}
        self.on_training: set[str]  # spot job ids with GPUs on training nodes
        self.on_loan: set[str] = set()  # ... on loaned nodes open to placement
        self.on_any_loan: set[str] = set()  # ... on any loaned node (reclaims)
        pool_of, blocked = c.pool_of, c.loan.blocked
        on_l, on_a = self.on_loan, self.on_any_loan
        index = c.index
        self._spot_pre: list[Job] | None = None
        self._protected: set[str] | None = None
        self._pre_open: list[Job] | None = None
        self._pre_training: list[Job] | None = None
        self._open_groups: list[tuple[int, str, np.ndarray, int]] | None = None
        self._cols: _Orders | None = None
        self._group_src: tuple[RunningIndex, SpotColumns] | None = None
        self._group_codes: tuple[np.ndarray, list[tuple[int, str, int, int]], int] | None = None
        self._any_loan_rows: tuple[list[int], SpotColumns] | None = None  # rows of on_any_loan's jobs
        if index is not None and c.used is index.used:
            # The caller's RunningIndex keeps these jobs split by kind, and their nodes by pool.
            self.dedicated = {t: list(d.values()) for t, d in index.ded_jobs.items() if d}
            self.on_training = index.spot_on_training  # read only; valid for this call
            open_loan: list[int] = []  # id(job) of those on loaned nodes open to placement
            any_loan: list[int] = []  # ... on any loaned node
            for key, (jid, others) in index.spot_elsewhere.items():
                for n in others:
                    if pool_of.get(n) == "loan":
                        on_a.add(jid)
                        any_loan.append(key)
                        if n not in blocked:
                            on_l.add(jid)
                            open_loan.append(key)
            cols = index.spot_columns()
            if cols is not None:
                row_of = index.row_of
                self._cols = _spot_orders_cols(c, index, cols, [row_of[k] for k in open_loan])
                self.spot_shrink = self._cols.shrink
                self._group_src = (index, cols)
                if not index.repeated_ids:  # (else an id names more than one job: filter by id below)
                    self._any_loan_rows = ([row_of[k] for k in any_loan], cols)
                return
            spot = list(index.spot_sorted)
        else:
            spot = []
            self.on_training = on_t = set()
            for j in c.snap.running:
                if j.releasing_gpus:
                    continue
                if j.kind == "dedicated":
                    self.dedicated.setdefault(j.tenant, []).append(j)
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
        self._spot_pre, self._protected, self.spot_shrink = _spot_orders(c, spot)

    @property
    def spot_pre(self) -> list[Job]:
        if self._spot_pre is None:
            o = self._cols
            assert o is not None
            spot = o.spot
            self._spot_pre = [spot[i] for i in o.order.tolist()]
        return self._spot_pre

    @property
    def protected(self) -> set[str]:
        """Ids of the spot jobs still inside their minimum runtime."""
        if self._protected is None:
            o = self._cols
            assert o is not None
            spot = o.spot
            self._protected = {spot[i].id for i in np.flatnonzero(o.prot).tolist()}
        return self._protected

    @property
    def spot_pre_open(self) -> list[Job]:
        """The spot preemption candidates for a spot job: past their minimum runtime, on a node it may use."""
        if self._pre_open is None:
            o = self._cols
            if o is not None:
                spot = o.spot
                self._pre_open = [spot[i] for i in o.open_order.tolist()]
            else:
                on_t, on_l, prot = self.on_training, self.on_loan, self.protected
                self._pre_open = [
                    j for j in self.spot_pre if j.id not in prot and (j.id in on_t or j.id in on_l)
                ]
        return self._pre_open

    def open_groups(self) -> list[tuple[int, str, np.ndarray, int]]:
        """``spot_pre_open`` split by (priority, tenant): ``(priority, tenant, ranks, fewest GPUs)``,
        ``ranks`` the ascending positions in ``spot_pre_open`` of the group's jobs, so the sorted union
        of some groups' ranks gives ``spot_pre_open`` with the other groups left out."""
        if self._open_groups is None:
            o = self._cols
            if o is not None:
                self._open_groups = _groups_np(o)
            else:
                groups: dict[tuple[int, str], list] = {}  # (priority, tenant) -> [fewest GPUs, [rank]]
                for r, j in enumerate(self.spot_pre_open):
                    g = groups.get((j.priority, j.tenant))
                    if g is None:
                        groups[(j.priority, j.tenant)] = [j.gpus, [r]]
                    else:
                        g[1].append(r)
                        if j.gpus < g[0]:
                            g[0] = j.gpus
                self._open_groups = [(p, t, np.array(lst, dtype=np.intp), fewest)
                                     for (p, t), (fewest, lst) in groups.items()]
        return self._open_groups

    def open_group_codes(self) -> tuple[np.ndarray, list[tuple[int, str, int, int]], int] | None:
        """:meth:`open_groups` by the index's (priority, tenant) codes: each ``spot_pre_open`` job's code
        (by rank), ``(priority, tenant, code, fewest GPUs)`` per group present, and the number of codes;
        ``None`` without the index's columns."""
        if self._group_codes is None:
            o, got = self._cols, self._group_src
            if o is None or got is None:
                return None
            index, cols = got
            codes = cols.group[o.open_order]
            n = len(index.group_key)
            fewest = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(fewest, codes, o.gpus[o.open_order])
            keys, few = index.group_key, fewest.tolist()
            present = np.flatnonzero(np.bincount(codes, minlength=n)).tolist()
            self._group_codes = (codes, [(*keys[k], k, few[k]) for k in present], n)
        return self._group_codes

    def spot_pre_any_loan(self) -> list[Job]:
        """``spot_pre`` restricted to jobs with GPUs on a loaned node (:attr:`on_any_loan`, a reclaim's
        candidates)."""
        got = self._any_loan_rows
        o = self._cols
        if got is None or o is None:
            on_a = self.on_any_loan
            return [j for j in self.spot_pre if j.id in on_a]
        rows, cols = got
        by_row = np.zeros(cols.table_rows, dtype=bool)
        by_row[rows] = True
        order, spot = o.order, o.spot
        return [spot[i] for i in order[by_row[cols.rows][order]].tolist()]

    def spot_pre_training(self) -> list[Job]:
        """``spot_pre`` restricted to jobs with GPUs on training nodes (a dedicated job's candidates)."""
        if self._pre_training is None:
            o = self._cols
            if o is not None:
                spot = o.spot
                order = o.order
                self._pre_training = [spot[i] for i in order[o.on_training[order]].tolist()]
            else:
                on_t = self.on_training
                self._pre_training = [j for j in self.spot_pre if j.id in on_t]
        return self._pre_training


class _Orders(NamedTuple):
    """The victim orders of one call as positions in the index's id-sorted spot jobs (``spot``)."""

    spot: list[Job]
    order: np.ndarray  # preemption order
    prot: np.ndarray  # inside the minimum runtime (bool, by position)
    on_training: np.ndarray  # with GPUs on a training node (bool, by position)
    open_order: np.ndarray  # preemption order, not protected, on a training or open loaned node
    priority: np.ndarray  # by position
    tenant: np.ndarray  # tenant code, by position
    gpus: np.ndarray  # by position
    tenant_names: list[str]  # code -> tenant
    shrink: list[Job]


def _spot_orders(c: Cycle, spot: list[Job]) -> tuple[list[Job], set[str], list[Job]]:
    """``spot`` in preemption order (:func:`preempt_keys`), the ids of the protected ones, and the
    elastic ones above their minimum in shrink order (:func:`shrink_key`).

    The same orders as sorting by those keys, computed as one ``numpy.lexsort`` over the key columns
    (the same float arithmetic; the job id, the last key, as its rank among the ids), so a call pays
    O(n) Python attribute reads, not O(n log n) tuple comparisons. Ids containing NUL (which numpy's
    strings would drop) take the plain sort."""
    shares = {t: -c.share(t) for t in c.tenants}
    ids = [j.id for j in spot]
    if len(spot) >= 2 and "\0" not in "".join(ids):
        try:
            return _spot_orders_np(c, spot, ids, shares)
        except OverflowError:  # a priority beyond int64
            pass
    keys = preempt_keys(c, spot)
    # Keys end with the (unique) job id, so sorting (key, job) pairs never compares jobs.
    pre = [j for _, j in sorted(zip([keys[j.id] for j in spot], spot, strict=True))]
    shrink = sorted(
        (j for j in spot if j.gpus > j.min_gpus), key=lambda j: (j.priority, shares[j.tenant], j.id)
    )
    return pre, {jid for jid, k in keys.items() if k[0]}, shrink


def _lost_and_protected(c: Cycle, started: np.ndarray, ckpt: np.ndarray, gpus: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Per job: ``Job.work_lost_gpu_s`` as :func:`preempt_keys` computes it (the same float arithmetic;
    ``None`` times as NaN, which compares false as ``None`` is skipped there), and whether it is inside
    its minimum runtime."""
    now = c.now
    since = np.where(np.isnan(started), now, started)
    since = np.where(ckpt > since, ckpt, since)
    lost = now - since
    with np.errstate(invalid="ignore"):
        prot = (now - started) < c.cfg.min_runtime_before_preempt_s
    return np.where(lost > 0.0, lost, 0.0) * gpus, prot


def _spot_orders_np(c: Cycle, spot: list[Job], ids: list[str], shares: dict[str, float]
                    ) -> tuple[list[Job], set[str], list[Job]]:
    id_rank = np.empty(len(ids), dtype=np.int64)
    id_rank[np.argsort(np.array(ids), kind="stable")] = np.arange(len(ids))
    prio = np.array([j.priority for j in spot], dtype=np.int64)
    neg_share = np.array([shares[j.tenant] for j in spot], dtype=np.float64)
    gpus = np.array([j.gpus for j in spot], dtype=np.int64)
    started = np.array([j.started_s for j in spot], dtype=np.float64)  # None -> NaN
    ckpt = np.array([j.last_ckpt_s for j in spot], dtype=np.float64)
    lost_gpu_s, prot = _lost_and_protected(c, started, ckpt, gpus)
    pre = [spot[i] for i in np.lexsort((id_rank, neg_share, prio, lost_gpu_s, prot)).tolist()]
    protected = {spot[i].id for i in np.flatnonzero(prot).tolist()}
    elastic = np.flatnonzero(gpus > np.array([j.min_gpus for j in spot], dtype=np.int64))
    order = np.lexsort((id_rank[elastic], neg_share[elastic], prio[elastic]))
    shrink = [spot[i] for i in elastic[order].tolist()]
    return pre, protected, shrink


def _spot_orders_cols(c: Cycle, index: RunningIndex, cols: SpotColumns, open_loan_rows: list[int]) -> _Orders:
    """:func:`_spot_orders` for the caller's ``RunningIndex``: its spot jobs come sorted by job id with
    their key columns kept across calls, so only ``last_ckpt_s`` (which the caller may move in place)
    and the shares are read now; ``numpy.lexsort`` is stable, so the id order stands in for the id key."""
    tenants = c.tenants
    spot = index.spot_sorted
    codes = index.tenant_code
    names = list(codes)
    shares = np.zeros(len(codes), dtype=np.float64)
    for t, k in codes.items():
        if t in tenants:
            shares[k] = -c.share(t)
    neg_share = shares[cols.tenant]
    prio, gpus, started = cols.priority, cols.gpus, cols.started_s
    ckpt = cols.last_ckpt_s  # kept by the index while the caller reports its in-place moves
    if ckpt is None:
        ckpt = np.array([j.last_ckpt_s for j in spot], dtype=np.float64)
    lost_gpu_s, prot = _lost_and_protected(c, started, ckpt, gpus)
    # np.lexsort((neg_share, prio, lost_gpu_s, prot)) and, over the elastic ones, np.lexsort((neg_share,
    # prio)), in fewer passes: the (prio, neg_share) order once; the elastic jobs in it (a stable sort
    # keeps a subset's relative order); that order stably by lost_gpu_s; then the unprotected first.
    base = np.lexsort((neg_share, prio))
    is_elastic = np.zeros(len(spot), dtype=bool)
    is_elastic[cols.elastic] = True
    shrink_order = base[is_elastic[base]]
    by_lost = base[np.argsort(lost_gpu_s[base], kind="stable")]
    p = prot[by_lost]
    order = np.concatenate((by_lost[~p], by_lost[p])) if p.any() else by_lost
    shrink = [spot[i] for i in shrink_order.tolist()]
    if open_loan_rows:  # on a training node or on an open loaned node (marked by table row)
        by_row = np.zeros(cols.table_rows, dtype=bool)
        by_row[open_loan_rows] = True
        usable = (cols.on_training | by_row[cols.rows]) & ~prot
    else:
        usable = cols.on_training & ~prot
    return _Orders(
        spot, order, prot, cols.on_training, order[usable[order]], prio, cols.tenant, gpus, names, shrink
    )


def _groups_np(o: _Orders) -> list[tuple[int, str, np.ndarray, int]]:
    """:meth:`VictimIndex.open_groups` from the arrays: a stable sort of the open ranks by (priority,
    tenant) leaves each group's ranks ascending."""
    pos = o.open_order
    if pos.size == 0:
        return []
    p, t = o.priority[pos], o.tenant[pos]
    by = np.lexsort((t, p))
    ps, ts = p[by], t[by]
    cuts = np.flatnonzero((ps[1:] != ps[:-1]) | (ts[1:] != ts[:-1])) + 1
    starts = np.concatenate(([0], cuts))
    fewest = np.minimum.reduceat(o.gpus[pos][by], starts)
    names = o.tenant_names
    starts_l = starts.tolist()
    ends = [*starts_l[1:], len(by)]
    ps_l, ts_l = ps.tolist(), ts.tolist()
    return [(ps_l[a], names[ts_l[a]], by[a:b], f)  # by[a:b]: np.split(by, cuts) without its overhead
            for a, b, f in zip(starts_l, ends, fewest.tolist(), strict=True)]


def victim_index(c: Cycle) -> VictimIndex:
    if c._victim_index is None:
        c._victim_index = VictimIndex(c)
    return c._victim_index  # type: ignore[return-value]


def _allowed(c: Cycle, views: Sequence[View]) -> set[str]:
    key = tuple(v.name for v in views)
    got = c.allowed_nodes.get(key)
    if got is None:
        got = set()
        for v in views:  # the nodes of v.free not in v.blocked (set operations, not a Python loop)
            got.update(v.free.keys() - v.blocked if v.blocked else v.free)
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
        spot_shrink: list[Cand] = [
            (v, "quota", False) for v in idx.spot_shrink if v.id in on_t and v.id not in touched
        ]
        spot_pre = ((v, "quota", False) for v in idx.spot_pre_training() if v.id not in touched)
        if quota_short:  # only the tenant's own jobs give quota back: try them first
            return own_shrink + spot_shrink, itertools.chain(own_pre, spot_pre)
        return spot_shrink + own_shrink, itertools.chain(spot_pre, own_pre)
    on_t, on_l = idx.on_training, idx.on_loan
    shrink: list[Cand] = []
    for v in idx.spot_shrink:
        if (
            v.priority <= e
            and (v.id in on_t or v.id in on_l)
            and v.id not in touched
            and not recently_grown(c, v)
        ):
            shrink.append((v, "demand", False))
    return shrink, _spot_pre(c, job, e)


def _spot_pre(c: Cycle, job: Job, e: int) -> Iterator[Cand]:
    """``spot_pre_open`` filtered for ``job`` (priority ``e``), lazily, in victim order.

    Whole (priority, tenant) groups that cannot yield are skipped before the walk: priorities above
    ``e``, another tenant's group for ``priority`` (priority never preempts across tenants), and for a
    ``fair_share`` group, a tenant whose share after losing even its smallest job
    would stay below the waiting tenant's (the share after losing a job only falls as the job grows).
    The rest are merged back in victim order and checked one by one as before. Nothing the walk reads
    changes while a search consumes it (decisions are issued after the search)."""
    idx = victim_index(c)
    gap = c.cfg.preempt_priority_gap
    share_after = c.share(job.tenant, job.min_gpus)
    touched, spot_held, fair = c.touched, c.spot_held, c.fair
    inf = math.inf

    def after(t: str, gpus: int) -> float:  # c.share(t, -gpus), inlined
        held = spot_held[t] - gpus
        if held <= 0:
            return 0.0
        f = fair.get(t, 0.0)
        return held / f if f > 0 else inf

    got = idx.open_group_codes()
    seq: Sequence[Job]
    if got is not None:  # the groups by code: the ranks of those kept, in one mask
        codes, groups, n_codes = got
        keep = np.zeros(n_codes, dtype=bool)
        for p, t, k, fewest in groups:
            if p <= e and (
                (t == job.tenant and p <= e - gap) or (t != job.tenant and share_after <= after(t, fewest))
            ):
                keep[k] = True
        if not keep.any():
            return
        o = idx._cols
        assert o is not None
        seq = o.spot  # spot_pre_open[r] is o.spot[o.open_order[r]]: no list of them all is made
        ranks = o.open_order[keep[codes]]
    else:
        parts = [ranks for p, t, ranks, fewest in idx.open_groups()
                 if p <= e and ((t == job.tenant and p <= e - gap)
                                or (t != job.tenant and share_after <= after(t, fewest)))]
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
        elif share_after <= after(v.tenant, v.gpus):
            yield (v, "fair_share", False)


def _focus_nodes(
    need: GangNeed, shrink: list[Cand], pre: Iterator[Cand]
) -> tuple[list[Cand], list[Cand]] | None:
    """For a ``gpus_per_node`` gang: the nodes to clear and the candidates on them.

    The greedy victim order alone is blind to nodes and would release GPUs all over the pool before
    k nodes are whole. Instead walk the candidates in order (shrinks, then preemptions, cheapest
    first), adding up what each node could get back, and stop as soon as enough nodes could be
    completed: those nodes are the cheapest to clear, and only candidates seen on them are kept.
    """
    g, allowed, vfree = need.g, need.allowed, need.vfree
    assert g is not None
    missing = need.size // g - need.ok_nodes
    pot: dict[str, int] = {}  # node -> GPUs it could have free (what it has plus what is given back)
    done: list[str] = []  # nodes that could reach g, in the order they did
    vget, pget = vfree.get, pot.get

    quota = 0  # quota the candidates seen could give back
    for v, _, q in shrink:
        room = v.gpus - v.min_gpus
        if q:
            quota += room
        for n, t in v.placement.items():
            if n in allowed:
                f = vget(n, 0)
                if f < g:  # add what the shrink could give back here (inlined, as below)
                    before = pget(n, f)
                    after = before + (t if t < room else room)
                    pot[n] = after
                    if before < g <= after:
                        done.append(n)
    seen: list[Cand] = []
    if len(done) < missing or quota < need.quota_short:
        for x in pre:
            seen.append(x)
            if x[2]:
                quota += x[0].gpus
            for n, t in x[0].placement.items():
                if n in allowed:
                    f = vget(n, 0)
                    if f < g:
                        before = pget(n, f)
                        after = before + t
                        pot[n] = after
                        if before < g <= after:
                            done.append(n)
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

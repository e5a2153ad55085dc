"""The victim index: running jobs that could give GPUs back, ordered once per scheduling call by the
rule of :func:`~tidal.policy.scheduling.preemption.preempt_keys` and ``shrink_key``, as sorts of key
columns (docs/scheduling.md, "The victim order")."""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping
from typing import NamedTuple

import numpy as np

from tidal.model import Job
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.index import RunningIndex, SpotColumns
from tidal.policy.scheduling.preemption import preempt_keys, shrink_key


class VictimIndex:
    """Running jobs that could give GPUs back in this call: ``spot_pre`` by preemption key, ``spot_shrink``
    (elastic) by shrink key, ``dedicated`` per tenant; ``on_training`` / ``on_loan``: spot job ids with
    GPUs on training nodes / on open loaned nodes. Keys are computed once per call."""

    def __init__(self, c: Cycle) -> None:
        self.dedicated: Mapping[str, Collection[Job]] = {}  # tenant -> its dedicated jobs not releasing
        self.on_training: Container[str]  # spot job ids with GPUs on training nodes
        self.on_loan: Container[str]  # ... on loaned nodes open to placement
        self.on_any_loan: Container[str]  # ... on any loaned node (reclaims)
        pool_of, blocked = c.pool_of, c.loan.blocked
        index = c.index
        self._spot_pre: list[Job] | None = None
        self._protected: set[str] | None = None
        self._pre_open: list[Job] | None = None
        self._pre_training: list[Job] | None = None
        self._open_groups: list[tuple[int, str, np.ndarray, int]] | None = None
        self._cols: _Orders | None = None
        self._group_src: tuple[RunningIndex, SpotColumns] | None = None
        self._group_codes: tuple[np.ndarray, list[tuple[int, str, int, int]], int] | None = None
        self._any_loan_rows: tuple[RunningIndex, SpotColumns] | None = None  # on_any_loan's jobs by row
        self._ded_order: dict[str, list[Job]] = {}  # tenant -> dedicated_order()
        if index is not None and c.used is index.used:
            # The caller's RunningIndex keeps these jobs split by kind, and their nodes by pool.
            self.dedicated = {t: d.values() for t, d in index.ded_jobs.items() if d}  # (views, not copies)
            self.on_training = index.spot_on_training  # read only; valid for this call
            self.on_any_loan, self.on_loan = index.spot_on_loans(blocked)  # (the same; kept across calls)
            cols = index.spot_columns()
            if cols is not None:
                self._cols = _spot_orders_cols(c, index, cols)
                self.spot_shrink = self._cols.shrink
                self._group_src = (index, cols)
                if not index.repeated_ids:  # (else an id names more than one job: filter by id below)
                    self._any_loan_rows = (index, cols)
                return
            spot = list(index.spot_sorted)
        else:
            spot = []
            ded: dict[str, list[Job]] = {}
            self.dedicated = ded
            self.on_training = on_t = set()
            self.on_loan = on_l = set()
            self.on_any_loan = on_a = set()
            for j in c.snap.running:
                if j.releasing_gpus:
                    continue
                if j.kind == "dedicated":
                    ded.setdefault(j.tenant, []).append(j)
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

    def dedicated_order(self, c: Cycle, tenant: str) -> list[Job]:
        """``tenant``'s dedicated jobs not releasing in preemption order (:func:`preempt_keys`): sorted once a
        call, as only the tenant's share changes within one and it is one value for all its jobs."""
        got = self._ded_order.get(tenant)
        if got is None:
            own = self.dedicated.get(tenant, ())
            keys = preempt_keys(c, own)
            got = self._ded_order[tenant] = sorted(own, key=lambda j: keys[j.id])
        return got

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
        ``ranks`` ascending positions in ``spot_pre_open``."""
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
        """:meth:`open_groups` by the index's codes: each ``spot_pre_open`` job's code, ``(priority, tenant,
        code, fewest GPUs)`` per group present, and the number of codes; ``None`` without the index."""
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
        """``spot_pre`` restricted to jobs with GPUs on a loaned node (a reclaim's candidates)."""
        got = self._any_loan_rows
        o = self._cols
        if got is None or o is None:
            on_a = self.on_any_loan
            return [j for j in self.spot_pre if j.id in on_a]
        index, cols = got
        on_loan = index.loan_marks(cols.rows)[0]
        order, spot = o.order, o.spot
        return [spot[i] for i in order[on_loan[order]].tolist()]

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
    """``spot`` in preemption order, the ids of the protected ones, and the elastic ones in shrink order:
    by key columns, or (ids with NUL, a single job, a priority beyond int64) the keys' plain sort."""
    ids = [j.id for j in spot]
    if len(spot) >= 2 and "\0" not in "".join(ids):
        try:
            return _spot_orders_np(c, spot, ids)
        except OverflowError:  # a priority beyond int64
            pass
    keys = preempt_keys(c, spot)
    # Keys end with the (unique) job id, so sorting (key, job) pairs never compares jobs.
    pre = [j for _, j in sorted(zip([keys[j.id] for j in spot], spot, strict=True))]
    shrink = sorted((j for j in spot if j.gpus > j.min_gpus), key=lambda j: shrink_key(c, j))
    return pre, {jid for jid, k in keys.items() if k[0]}, shrink


def _column_orders(c: Cycle, base: np.ndarray, gpus: np.ndarray, started: np.ndarray, ckpt: np.ndarray,
                   elastic: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`preempt_keys` and :func:`shrink_key` as stable sorts of key columns, for jobs in id order
    (the keys' last tie-break) and ``base``, their positions sorted stably by (priority, -share):
    ``(preemption order, protected mask, shrink order of the elastic positions)``. Work lost is computed
    as ``Job.work_lost_gpu_s`` does (``None`` times as NaN)."""
    now = c.now
    since = np.where(np.isnan(started), now, started)
    since = np.where(ckpt > since, ckpt, since)
    lost = now - since
    lost_gpu_s = np.where(lost > 0.0, lost, 0.0) * gpus
    with np.errstate(invalid="ignore"):
        prot = (now - started) < c.cfg.min_runtime_before_preempt_s
    is_elastic = np.zeros(len(base), dtype=bool)
    is_elastic[elastic] = True
    by_lost = base[stable_argsort(lost_gpu_s[base])]
    p = prot[by_lost]
    order = np.concatenate((by_lost[~p], by_lost[p])) if p.any() else by_lost
    return order, prot, base[is_elastic[base]]


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of a 1-d float array, the same permutation, faster where keys
    repeat (the work lost of ~4,000 spot jobs takes ~250 values: jobs started together): the keys' ranks
    from a quick sort, then a stable sort of the ranks (a radix sort of small integers)."""
    if keys.size < 2:
        return np.argsort(keys, kind="stable")
    by = np.argsort(keys)
    ordered = keys[by]
    if ordered[-1] != ordered[-1]:  # NaN (sorted last): equal for the stable sort, not for !=
        return np.argsort(keys, kind="stable")
    step = np.empty(keys.size, dtype=bool)
    step[0] = False
    np.not_equal(ordered[1:], ordered[:-1], out=step[1:])
    rank = np.empty(keys.size, dtype=np.int16 if keys.size < 2**15 else np.intp)
    rank[by] = np.cumsum(step, dtype=rank.dtype)
    return np.argsort(rank, kind="stable")


def _spot_orders_np(c: Cycle, spot: list[Job], ids: list[str]) -> tuple[list[Job], set[str], list[Job]]:
    """:func:`_spot_orders` by :func:`_column_orders`, the jobs put in id order first."""
    by_id = [spot[i] for i in np.argsort(np.array(ids), kind="stable").tolist()]
    shares = {t: -c.share(t) for t in c.tenants}
    base = np.lexsort((np.array([shares[j.tenant] for j in by_id], dtype=np.float64),
                       np.array([j.priority for j in by_id], dtype=np.int64)))
    order, prot, shrink = _column_orders(
        c,
        base,
        np.array([j.gpus for j in by_id], dtype=np.int64),
        np.array([j.started_s for j in by_id], dtype=np.float64),  # None -> NaN
        np.array([j.last_ckpt_s for j in by_id], dtype=np.float64),
        np.flatnonzero([j.gpus > j.min_gpus for j in by_id]),
    )
    return ([by_id[i] for i in order.tolist()], {by_id[i].id for i in np.flatnonzero(prot).tolist()},
            [by_id[i] for i in shrink.tolist()])


def _spot_orders_cols(c: Cycle, index: RunningIndex, cols: SpotColumns) -> _Orders:
    """:func:`_spot_orders` from the caller's ``RunningIndex`` (jobs sorted by id, key columns kept);
    only ``last_ckpt_s`` and the shares are read now (and which jobs are on open loaned nodes, kept by the
    index: call ``spot_on_loans`` first)."""
    tenants = c.tenants
    spot = index.spot_sorted
    codes = index.tenant_code
    names = list(codes)
    shares = np.zeros(len(codes), dtype=np.float64)
    for t, k in codes.items():
        if t in tenants:
            shares[k] = -c.share(t)
    prio, gpus = cols.priority, cols.gpus
    ckpt = cols.last_ckpt_s  # kept by the index while the caller reports its in-place moves
    if ckpt is None:
        ckpt = np.array([j.last_ckpt_s for j in spot], dtype=np.float64)
    # (priority, -share) is one value per (priority, tenant) group: rank the groups, then sort the jobs by
    # their group's rank (equal keys, equal ranks), a radix sort of small integers instead of a lexsort.
    keys = [(p, float(shares[codes[t]])) for p, t in index.group_key]
    rank_of = {k: r for r, k in enumerate(sorted(set(keys)))}
    rank = np.array([rank_of[k] for k in keys], dtype=np.int16 if len(rank_of) < 2**15 else np.int64)
    base = np.argsort(rank[cols.group], kind="stable")
    order, prot, shrink_order = _column_orders(c, base, gpus, cols.started_s, ckpt, cols.elastic)
    shrink = [spot[i] for i in shrink_order.tolist()]
    usable = (cols.on_training | index.loan_marks(cols.rows)[1]) & ~prot  # on a training or open loaned node
    return _Orders(spot, order, prot, cols.on_training, order[usable[order]], prio, cols.tenant, gpus, names,
                   shrink)


def _groups_np(o: _Orders) -> list[tuple[int, str, np.ndarray, int]]:
    """:meth:`VictimIndex.open_groups` from the arrays (a stable sort keeps each group's ranks ascending)."""
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
    idx = c._victim_index  # (cycle.py cannot name the type: this module imports it)
    if not isinstance(idx, VictimIndex):
        idx = c._victim_index = VictimIndex(c)
    return idx

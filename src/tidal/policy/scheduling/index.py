"""An optional accelerator for callers that schedule the same pool again and again: incremental indexes.

:class:`RunningIndex` keeps the previous call's per-node and per-tenant sums and updates them from the
running jobs added or removed since (by object identity: a changed :class:`~tidal.model.Job` is a new
object), and the victim index's inputs (the spot jobs sorted by id, their fixed key columns in a numpy
table). A memo, not a policy: the same decisions with or without it (docs/scheduling.md, "Incremental
indexes"). A caller may change a job in place only in ``last_ckpt_s`` and ``ckpt_interval_s`` (and
report the first, :meth:`RunningIndex.ckpt_moved`). One index per caller and pool; not thread-safe.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from tidal.model import Job, Loan, Node


class RunningIndex:
    """Per-node and per-tenant sums over the running jobs, kept up to date across calls."""

    def __init__(self) -> None:
        self._nodes: object = None  # the node tuple the node tables below were made for
        self._node_gpus: dict[str, int] = {}  # training node -> GPUs
        self.training_gpus = 0
        self.max_node_gpus = 1
        self.other_nodes: set[str] = set()  # nodes not in the training pool
        self.pos: dict[str, int] = {}  # node -> its position in the node list
        self.tenant_code: dict[str, int] = {}  # tenant -> its row in per-tenant vectors (first seen first)
        self.group_code: dict[tuple[int, str], int] = {}  # (priority, tenant) of spot jobs -> code, for life
        self.group_key: list[tuple[int, str]] = []  # code -> (priority, tenant)
        self._hint: tuple | None = None  # (running, since, added, removed), see hint()
        self._loan_hint: tuple | None = None  # (loans, since, changed), see hint_loans()
        self.ckpt_reported = False  # the caller reports every in-place move of last_ckpt_s (ckpt_moved())
        self._reset_jobs()

    def _reset_jobs(self) -> None:
        self._jobs: dict[int, Job] = {}  # id(job) -> job, the running jobs of the last call
        self._running: Sequence[Job] | None = None  # the last call's running sequence (the object)
        self.used: dict[str, int] = {}  # node -> GPUs held by running jobs
        self.draining: dict[str, int] = {}  # node -> GPUs being released
        self.jobs_of: dict[str, int] = {}  # tenant -> running jobs
        self.ded_held: dict[str, int] = {}  # tenant -> GPUs of its dedicated jobs
        self.spot_held: dict[str, int] = {}  # tenant -> GPUs of its spot jobs not being released
        self.ded_prio: dict[str, dict[int, int]] = {}  # tenant -> priority -> dedicated jobs not releasing
        self.ded_elastic: dict[str, int] = {}  # tenant -> dedicated jobs not releasing above their minimum
        self.growable: dict[int, Job] = {}  # id(job) -> running job not releasing, below its maximum
        # The same jobs per grow group (kind rank, tenant) sorted by the grow step's key, and by id.
        self.grow_sorted: dict[tuple[int, str], list[tuple[int, float, str]]] = {}
        self.grow_job: dict[str, Job] = {}
        self.grow_repeats = 0  # growable jobs whose id another has (invalid snapshots only)
        self.train_free: dict[str, int] = dict(self._node_gpus)  # training node -> GPUs free, in node order
        # ... those with free GPUs, in node order (with their positions, sorted)
        self.train_open: list[str] = [n for n, g in self.train_free.items() if g > 0]
        self._open_pos: list[int] = [self.pos[n] for n in self.train_open] if self.train_open else []
        # The victim index's inputs (``victims.VictimIndex``), over running jobs not releasing:
        self.spot_jobs: dict[int, Job] = {}  # id(job) -> spot job
        self.spot_on_training: set[str] = set()  # ids of those spot jobs with GPUs on a training node
        # id(job) -> (job id, its nodes outside the training pool, its row in the key table below)
        self.spot_elsewhere: dict[int, tuple[str, tuple[str, ...], int]] = {}
        self.ded_jobs: dict[str, dict[int, Job]] = {}  # tenant -> id(job) -> dedicated job
        # Those spot jobs on nodes outside the training pool, kept as jobs, loans and blocked nodes come and
        # go (the victim index reads them, spot_on_loans()): node -> id(job) -> None for the jobs there, and
        # job id -> how many listed jobs of that id are on a loaned node / on a loaned node not blocked. A
        # job's count of such nodes is kept in its table row (loan_n, open_n).
        self.spot_at: dict[str, dict[int, None]] = {}
        self.spot_loan_ids: dict[str, int] = {}
        self.spot_open_ids: dict[str, int] = {}
        # The same spot jobs sorted by job id; their fixed key columns in a table, a reused row each.
        self.spot_ids: list[str] = []
        self.repeated_ids = 0  # listed spot jobs whose id an earlier listed one has (invalid snapshots only)
        self.spot_sorted: list[Job] = []
        # Each one's row in the key table (rows are reused): a C array of intp, read by numpy without a walk.
        self.spot_rows = array("q" if np.dtype(np.intp).itemsize == 8 else "i")
        self.row_of: dict[int, int] = {}  # id(job) -> its row
        self._table = _Table(np.zeros(0, np.int64), np.zeros(0, np.intp), np.zeros(0, np.int64),
                             np.zeros(0, np.float64), np.zeros(0, bool), np.zeros(0, bool),
                             np.zeros(0, np.float64), np.zeros(0, np.intp), np.zeros(0, np.int64),
                             np.zeros(0, np.int64))
        self._free: list[int] = []
        self._overflow: dict[int, Job] = {}  # listed jobs whose priority does not fit int64
        self._spot_cols: SpotColumns | None = None
        # The loans of the last loan_map() and sums over them (they depend on ``used``: rebuilt with it).
        self._loans_seen: Sequence[Loan] | None = None  # the last call's loans (the object)
        self.loan_of: dict[str, Loan] = {}  # node -> its loan
        self.loan_free: dict[str, int] = {}  # node outside the training pool -> GPUs lent less those held
        self.loan_ends: dict[str, float] = {}  # node -> its loan's until_s, for the loans with a finite end
        self.loaned_gpus = 0
        self.loans_moved: tuple[list[str], list[str]] | None = None  # (came, went) at the last loan_map()

    def nodes(self, nodes: Sequence[Node]) -> bool:
        """Bring the node tables to ``nodes`` (rebuilt, and the job sums with them, unless it is the
        previous call's tuple). ``False`` if node names repeat (the full walk then decides)."""
        if nodes is self._nodes and isinstance(nodes, tuple):
            return True
        self._nodes = nodes
        self._node_gpus = {n.name: n.gpus for n in nodes if n.pool == "training"}
        self._pool_of = dict.fromkeys(self._node_gpus, "training")  # and the loaned nodes: see loaned()
        self._loaned: set[str] = set()  # the nodes outside the training pool on loan at the last call
        self._blocked: set[str] = set()  # the loaned nodes blocked at the last placeable() / spot_on_loans()
        self._training_names = frozenset(self._node_gpus)
        self._placeable = set(self._node_gpus)  # training nodes and loaned nodes not blocked
        self._loan_order: list[str] = []  # ... in node order
        self._loan_pos: list[int] = []  # ... their positions (sorted)
        self.training_gpus = sum(self._node_gpus.values())
        self.max_node_gpus = max([1, *(n.gpus for n in nodes)])
        self.other_nodes = {n.name for n in nodes if n.pool != "training"}
        self.pos = {n.name: i for i, n in enumerate(nodes)}
        self._reset_jobs()
        if len(self.pos) != len(nodes) or len(self._node_gpus) + len(self.other_nodes) != len(nodes):
            self._nodes = None
            return False
        return True

    def loaned(self, names: AbstractSet[str], moved: tuple[list[str], list[str]] | None = None
               ) -> tuple[dict[str, str], list[str]]:
        """While the nodes ``names`` are on loan: node -> ``"training"`` for the training pool's nodes and
        ``"loan"`` for the loaned ones outside it, and those loaned ones in node order. Both are kept across
        calls, changed by the nodes whose loan came or went (set differences aside, or ``moved``: (came,
        went) since the last call's ``names``, as :meth:`loan_map` finds them), and read only: valid
        until the next call. Call :meth:`nodes` first."""
        had, pool_of, order = self._loaned, self._pool_of, self._loan_order
        if moved is not None:  # O(nodes that came or went)
            others = self.other_nodes
            self._move_loaned([n for n in moved[0] if n in others and n not in had],
                              [n for n in moved[1] if n in had])
            return pool_of, order
        if had == names:  # the same loaned nodes (the usual case: one set comparison, no new set)
            return pool_of, order
        now = self.other_nodes.intersection(names)
        if now != had:
            self._move_loaned(now - had, had - now)
        return pool_of, order

    def _move_loaned(self, came: Iterable[str], went: Iterable[str]) -> None:
        """The nodes ``came`` (outside the training pool, not loaned) are loaned now, ``went`` no more."""
        pos, at, order, pool_of = self.pos, self._loan_pos, self._loan_order, self._pool_of
        loaned = self._loaned
        for name in went:
            i = bisect_left(at, pos[name])
            del at[i], order[i], pool_of[name]
            self._loan_moved(name, -1, name not in self._blocked)
            self._placeable.discard(name)
            loaned.discard(name)
        for name in came:
            i = bisect_left(at, pos[name])
            at[i:i] = (pos[name],)  # (slice assignment moves the tail by memmove, insert() by a loop)
            order[i:i] = (name,)
            pool_of[name] = "loan"
            loaned.add(name)
            self._loan_moved(name, +1, name not in self._blocked)
            if name not in self._blocked:
                self._placeable.add(name)

    def spot_on_loans(self, blocked: set[str]) -> tuple[dict[str, int], dict[str, int]]:
        """For the loaned nodes of the last :meth:`loaned` with ``blocked`` not open to placement: the ids
        of the listed spot jobs on a loaned node, and of those on an open one (as dicts: id -> how many
        listed jobs of that id; read only, valid for this call), each job's counts in its table row
        (:meth:`loan_marks`). Kept across calls, changed by the jobs, loans and blocked nodes that changed."""
        self._block(blocked)
        return self.spot_loan_ids, self.spot_open_ids

    def placeable(self, blocked: set[str]) -> tuple[frozenset[str], set[str]]:
        """The training pool's nodes, and those with the loaned nodes of the last :meth:`loaned` not in
        ``blocked`` (read only, valid for this call): kept across calls, changed by the loans and blocked
        nodes that came or went."""
        self._block(blocked)
        return self._training_names, self._placeable

    def _block(self, blocked: set[str]) -> None:
        """The loaned nodes ``blocked`` (not open to placement) instead of those of the last call."""
        old = self._blocked
        if blocked != old:
            loaned, placeable = self._loaned, self._placeable
            for name in old - blocked:
                if name in loaned:
                    self._loan_moved(name, +1, True, only_open=True)
                    placeable.add(name)
            for name in blocked - old:
                if name in loaned:
                    self._loan_moved(name, -1, True, only_open=True)
                    placeable.discard(name)
            self._blocked = set(blocked)

    def loan_marks(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the listed spot jobs at table ``rows``: on a loaned node, on a loaned node open to placement
        (as of the last :meth:`spot_on_loans`)."""
        t = self._table
        return t.loan_n[rows] > 0, t.open_n[rows] > 0

    def _loan_moved(self, name: str, sign: int, counts_open: bool, only_open: bool = False) -> None:
        """Node ``name`` came on loan (+1) or left (-1) (``only_open``: was unblocked / blocked while on
        loan): the counts of the listed spot jobs there; ``counts_open``: it is (was) open to placement."""
        at = self.spot_at.get(name)
        if not at:
            return
        t, elsewhere = self._table, self.spot_elsewhere
        for key in at:
            jid, _, r = elsewhere[key]
            if not only_open:
                n = int(t.loan_n[r])
                t.loan_n[r] = n + sign
                if n == 0 or n + sign == 0:  # 0 -> 1 or 1 -> 0
                    _add(self.spot_loan_ids, jid, sign)
            if counts_open:
                n = int(t.open_n[r])
                t.open_n[r] = n + sign
                if n == 0 or n + sign == 0:
                    _add(self.spot_open_ids, jid, sign)

    def _on_loans(self, key: int, jid: str, others: tuple[str, ...], row: int, sign: int) -> None:
        """A listed spot job with GPUs on the nodes ``others`` (outside the training pool) came (+1) or
        left (-1): :attr:`spot_at` and the loan counts."""
        loaned, blocked, spot_at = self._loaned, self._blocked, self.spot_at
        n_loan = n_open = 0
        for n in others:
            at = spot_at.get(n)
            if sign > 0:
                if at is None:
                    spot_at[n] = {key: None}
                else:
                    at[key] = None
            else:
                assert at is not None
                del at[key]
                if not at:
                    del spot_at[n]
            if n in loaned:
                n_loan += 1
                if n not in blocked:
                    n_open += 1
        if sign > 0:
            t = self._table
            t.loan_n[row], t.open_n[row] = n_loan, n_open
        if n_loan:
            _add(self.spot_loan_ids, jid, sign)
        if n_open:
            _add(self.spot_open_ids, jid, sign)

    def hint(self, running: Sequence[Job], since: Sequence[Job], added: Sequence[Job], removed: Sequence[Job]
             ) -> None:
        """``running`` (the next snapshot's object) is ``since`` (the previous call's object) minus
        ``removed`` plus ``added``: the next :meth:`update` costs O(changes). Ignored unless both objects
        match (a few cheap checks fall back to the full comparison)."""
        self._hint = (running, since, added, removed)

    def hint_loans(self, loans: Sequence[Loan], since: Sequence[Loan], changed: Mapping[str, Loan | None]
                   ) -> None:
        """``loans`` (the next snapshot's object) is ``since`` (the previous call's object) but for the nodes
        ``changed`` (node -> its loan now, ``None``: none): the next :meth:`loan_map` costs O(changes).
        Ignored unless both objects match (and the count of loans checks out)."""
        self._loan_hint = (loans, since, changed)

    def loan_map(self, loans: Sequence[Loan]) -> dict[str, Loan] | None:
        """This call's ``loans`` by node (read only, valid for this call), with :attr:`loan_free`,
        :attr:`loan_ends` and :attr:`loaned_gpus` brought to them: from the loans that changed if
        :meth:`hint_loans` said which (then :attr:`loans_moved` says which nodes' loans came and went, for
        :meth:`loaned`), else from all. ``None`` if two loans name one node. Call :meth:`update` first (the
        free counts are of its ``used``)."""
        hint, self._loan_hint = self._loan_hint, None
        if hint is not None and hint[0] is loans and hint[1] is self._loans_seen and hint[1] is not None:
            of, free, ends, used, training = (self.loan_of, self.loan_free, self.loan_ends, self.used,
                                              self._node_gpus)
            came: list[str] = []
            went: list[str] = []
            for node, ln in hint[2].items():
                old = of.pop(node, None)
                if old is not None:
                    self.loaned_gpus -= old.gpus
                    ends.pop(node, None)
                    free.pop(node, None)
                    if ln is None:
                        went.append(node)
                elif ln is not None:
                    came.append(node)
                if ln is not None:
                    of[node] = ln
                    self.loaned_gpus += ln.gpus
                    if ln.until_s != math.inf:
                        ends[node] = ln.until_s
                    if node not in training:
                        free[node] = ln.gpus - used.get(node, 0)
            if len(of) == len(loans):
                self._loans_seen = loans
                self.loans_moved = (came, went)
                return of
        self._loans_seen = None
        self.loans_moved = None
        of = dict(zip(map(_node, loans), loans, strict=True))
        if len(of) != len(loans):
            return None
        used_get, training = self.used.get, self._node_gpus
        self.loan_of = of
        self.loan_free = {n: ln.gpus - used_get(n, 0) for n, ln in of.items() if n not in training}
        self.loan_ends = {n: ln.until_s for n, ln in of.items() if ln.until_s != math.inf}
        self.loaned_gpus = sum(map(_gpus, loans))
        self._loans_seen = loans
        return of

    def ckpt_moved(self, jobs: Iterable[Job], times: Sequence[float | None] | None = None) -> None:
        """``jobs`` whose ``last_ckpt_s`` moved in place since the last report (``times``: their new
        ``last_ckpt_s`` in the same order, if the caller has them at hand: not read from the jobs again).
        From the first report on the index keeps that column itself, so the caller must report every move
        before the next call."""
        self.ckpt_reported = True
        jobs = list(jobs)
        if not jobs:
            return
        # Each job's row (-1: not listed; a listed job is alive, so no other live job has its id), by maps:
        # a few hundred jobs move between two calls of a large pool.
        rows = np.fromiter(map(self.row_of.get, map(id, jobs), repeat(-1)), dtype=np.intp, count=len(jobs))
        listed = rows >= 0
        if listed.any():
            col = np.array(list(map(_last_ckpt_s, jobs)) if times is None else times, dtype=np.float64)
            self._table.ckpt[rows[listed]] = col[listed]  # (None -> NaN)
            self._spot_cols = None

    def update(self, running: Sequence[Job]) -> None:
        """Bring the sums to ``running`` (this call's running jobs). Call :meth:`nodes` first."""
        hint, self._hint = self._hint, None
        prev = self._jobs
        if hint is not None and hint[0] is running and hint[1] is self._running and hint[1] is not None:
            self._running = running
            added, removed = hint[2], hint[3]
            if (len(prev) - len(removed) + len(added) == len(running)
                    and all(prev.get(id(j)) is j for j in removed) and not any(id(j) in prev for j in added)):
                for j in removed:
                    del prev[id(j)]
                    self._account(j, -1)
                for j in added:
                    prev[id(j)] = j
                    self._account(j, +1)
                return
        cur = dict(zip(map(id, running), running, strict=True))
        if len(prev) > 2 * len(cur) + 64:  # mostly gone: start over (cheaper than removing one by one)
            self._reset_jobs()
            prev = self._jobs
        for k in prev.keys() - cur.keys():
            self._account(prev[k], -1)
        for k in cur.keys() - prev.keys():
            self._account(cur[k], +1)
        self._jobs = cur
        self._running = running

    def _account(self, j: Job, sign: int) -> None:
        used, drain, tfree, loan_free = self.used, self.draining, self.train_free, self.loan_free
        on_training = False
        others = []
        for node, g in j.placement.items():
            _add(used, node, sign * g)
            f = tfree.get(node)
            if f is not None:
                on_training = True
                f -= sign * g
                tfree[node] = f
                was = f + sign * g
                if (f > 0) != (was > 0):  # it opened or filled up: keep the open nodes in node order
                    p = self.pos[node]
                    at = self._open_pos
                    if f > 0:
                        i = bisect_left(at, p)
                        at[i:i] = (p,)
                        self.train_open[i:i] = (node,)
                    else:
                        i = bisect_left(at, p)
                        del at[i], self.train_open[i]
            else:
                others.append(node)
                lf = loan_free.get(node)
                if lf is not None:
                    loan_free[node] = lf - sign * g
        key = id(j)
        rel = j.releasing_gpus
        if rel:
            for node, g in j.releasing.items():
                _add(drain, node, sign * g)
        elif j.gpus < j.max_gpus:
            entry = (-j.priority, j.gpus / j.max_gpus, j.id)
            lst = self.grow_sorted.setdefault((int(j.kind != "dedicated"), j.tenant), [])
            if sign > 0:
                self.growable[key] = j
                i = bisect_right(lst, entry)
                lst[i:i] = (entry,)  # insort(), the tail moved by memmove
                self.grow_repeats += self.grow_job.setdefault(j.id, j) is not j
            else:
                del self.growable[key]
                del lst[bisect_left(lst, entry)]
                if self.grow_job.get(j.id) is j:
                    del self.grow_job[j.id]
                else:
                    self.grow_repeats -= 1
        t = j.tenant
        self.jobs_of[t] = self.jobs_of.get(t, 0) + sign
        if j.kind == "dedicated":
            self.ded_held[t] = self.ded_held.get(t, 0) + sign * j.gpus
            if not rel:
                prios = self.ded_prio.setdefault(t, {})
                n = prios.get(j.priority, 0) + sign
                if n:
                    prios[j.priority] = n
                else:
                    del prios[j.priority]
                if j.gpus > j.min_gpus:
                    self.ded_elastic[t] = self.ded_elastic.get(t, 0) + sign
                if sign > 0:
                    self.ded_jobs.setdefault(t, {})[key] = j
                else:
                    self.ded_jobs[t].pop(key, None)
        else:
            self.spot_held[t] = self.spot_held.get(t, 0) + sign * (j.gpus - rel)
            if not rel:
                if sign > 0:
                    self.spot_jobs[key] = j
                    if on_training:
                        self.spot_on_training.add(j.id)
                    self._spot_insert(j, on_training)
                    if others:
                        got = self.spot_elsewhere[key] = (j.id, tuple(others), self.row_of[key])
                        self._on_loans(key, *got, +1)
                else:
                    del self.spot_jobs[key]
                    if on_training:
                        self.spot_on_training.discard(j.id)
                    if key in self.spot_elsewhere:
                        self._on_loans(key, *self.spot_elsewhere.pop(key), -1)
                    self._spot_remove(j)

    def _spot_insert(self, j: Job, on_training: bool) -> None:
        i = bisect_right(self.spot_ids, j.id)  # after equal ids: the order they were added in
        if i and self.spot_ids[i - 1] == j.id:
            self.repeated_ids += 1
        self.spot_ids[i:i] = (j.id,)  # (slice assignment moves the tail by memmove, insert() by a loop)
        self.spot_sorted[i:i] = (j,)
        if not self._free:
            self._grow_table()
        r = self._free.pop()  # the job's row in the table, for as long as it is listed
        self.spot_rows.insert(i, r)
        self.row_of[id(j)] = r
        t = self._table
        try:
            t.priority[r] = j.priority
        except OverflowError:
            t.priority[r] = 0
            self._overflow[id(j)] = j
        t.tenant[r] = self.tenant_code.setdefault(j.tenant, len(self.tenant_code))
        t.gpus[r] = j.gpus
        t.started_s[r] = j.started_s if j.started_s is not None else math.nan
        t.on_training[r] = on_training
        t.elastic[r] = j.gpus > j.min_gpus
        t.ckpt[r] = j.last_ckpt_s if j.last_ckpt_s is not None else math.nan
        t.loan_n[r] = t.open_n[r] = 0  # (set by _on_loans for a job outside the training pool)
        g = self.group_code.get((j.priority, j.tenant))
        if g is None:
            g = self.group_code[(j.priority, j.tenant)] = len(self.group_key)
            self.group_key.append((j.priority, j.tenant))
        t.group[r] = g
        self._spot_cols = None

    def _spot_remove(self, j: Job) -> None:
        i = bisect_left(self.spot_ids, j.id)
        while self.spot_sorted[i] is not j:  # equal ids (not a valid snapshot, but kept consistent)
            i += 1
        self._free.append(self.spot_rows[i])
        del self.spot_ids[i], self.spot_sorted[i], self.spot_rows[i], self.row_of[id(j)]
        if self.repeated_ids and ((i and self.spot_ids[i - 1] == j.id)
                                  or (i < len(self.spot_ids) and self.spot_ids[i] == j.id)):
            self.repeated_ids -= 1
        self._overflow.pop(id(j), None)
        self._spot_cols = None

    def _grow_table(self) -> None:
        t = self._table
        n = t.gpus.size
        grow = max(256, n)
        self._table = _Table(*(np.concatenate([col, np.zeros(grow, dtype=col.dtype)]) for col in t))
        self._free = list(range(n + grow - 1, n - 1, -1))

    def spot_columns(self) -> SpotColumns | None:
        """The key columns of ``spot_sorted``, in its order (``None``: a priority beyond int64)."""
        if self._overflow:
            return None
        cols = self._spot_cols
        if cols is None:
            rows = np.frombuffer(self.spot_rows, dtype=np.intp).copy()  # (the copy lets the array grow again)
            t = self._table
            cols = self._spot_cols = SpotColumns(
                t.priority[rows], t.tenant[rows], t.gpus[rows], t.started_s[rows], t.on_training[rows],
                np.flatnonzero(t.elastic[rows]), rows, t.gpus.size,
                t.ckpt[rows] if self.ckpt_reported else None, t.group[rows])
        return cols


class SpotColumns(NamedTuple):
    """Per spot job of :attr:`RunningIndex.spot_sorted` (``None`` times as NaN): ``elastic``, the positions
    of those above their minimum; ``rows``, each one's table row; ``last_ckpt_s`` only while the caller
    reports its moves (else ``None``: read the jobs)."""

    priority: np.ndarray
    tenant: np.ndarray
    gpus: np.ndarray
    started_s: np.ndarray
    on_training: np.ndarray
    elastic: np.ndarray
    rows: np.ndarray
    table_rows: int
    last_ckpt_s: np.ndarray | None
    group: np.ndarray  # (priority, tenant) code (RunningIndex.group_key)


class _Table(NamedTuple):
    """The key table of :class:`RunningIndex`: one row per listed spot job (rows are reused)."""

    priority: np.ndarray
    tenant: np.ndarray
    gpus: np.ndarray
    started_s: np.ndarray
    on_training: np.ndarray
    elastic: np.ndarray  # above its minimum
    ckpt: np.ndarray  # last_ckpt_s (None as NaN), as of insertion or the caller's last report
    group: np.ndarray  # (priority, tenant) code
    loan_n: np.ndarray  # nodes on loan it has GPUs on (spot_on_loans)
    open_n: np.ndarray  # ... of those, not blocked


__all__ = ["RunningIndex", "SpotColumns"]


_last_ckpt_s = attrgetter("last_ckpt_s")
_node, _gpus = attrgetter("node"), attrgetter("gpus")


def _add(counts: dict[str, int], key: str, delta: int) -> None:
    """``counts[key] += delta``, dropping the key at zero (the sums hold only nonzero entries)."""
    v = counts.get(key, 0) + delta
    if v:
        counts[key] = v
    else:
        del counts[key]

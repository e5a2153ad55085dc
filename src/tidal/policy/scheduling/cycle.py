"""One scheduling call's working state: the snapshot indexed once (one pass over the running jobs and
one over the nodes), then kept true as decisions are issued through the ``issue_*`` methods."""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from operator import attrgetter

from tidal.model import Admit, Decision, Job, Loan, Preempt, Reason, ReturnGpus, Shrink, Snapshot, Waiting
from tidal.policy.scheduling.config import SchedulerConfig
from tidal.policy.scheduling.index import RunningIndex
from tidal.policy.scheduling.placement import View

_node, _gpus = attrgetter("node"), attrgetter("gpus")


class Cycle:
    """Indexes of one snapshot plus the decisions made so far in this call."""

    def __init__(self, snap: Snapshot, cfg: SchedulerConfig, index: RunningIndex | None = None) -> None:
        self.snap, self.cfg, self.now = snap, cfg, snap.now_s
        self.decisions: list[Decision] = []
        self.why: dict[str, Waiting] | None = None  # job id -> why it waits (only when asked)
        self.touched: set[str] = set()  # jobs that got a decision this call: not touched again
        self.tenants = {t.name: t for t in snap.tenants}
        self.index = index
        self._growable_src: dict[int, Job] | None = None  # the index's growable jobs
        self._loan_free: dict[str, int] | None = None  # the index's free GPUs per loaned node
        self._loan_ends: dict[str, float] | None = None  # the index's finite loan ends
        if index is not None and self._from_index(index):
            return
        self.loans: dict[str, Loan] = dict(zip(map(_node, snap.loans), snap.loans, strict=True))
        self.pool_of: dict[str, str] = {}  # node -> "training" | "loan" (serving nodes without a loan: none)
        self.max_node_gpus = 1
        self.training_gpus = 0
        for n in snap.nodes:
            if n.gpus > self.max_node_gpus:
                self.max_node_gpus = n.gpus
            if n.pool == "training":
                self.pool_of[n.name] = "training"
                self.training_gpus += n.gpus
            elif n.name in self.loans:
                self.pool_of[n.name] = "loan"

        # One pass over the running jobs.
        used: dict[str, int] = {}
        draining: dict[str, int] = {}
        self.ded_held = dict.fromkeys(self.tenants, 0)  # dedicated GPUs held (quota is checked on these)
        self.spot_held = dict.fromkeys(self.tenants, 0)  # spot GPUs held minus releasing (fair share)
        self.growable: list[Job] | None = []  # running jobs below their maximum (None: not listed yet)
        self.ded_low_priority: dict[str, int] = {}  # tenant -> lowest priority of its running dedicated jobs
        self.ded_elastic: set[str] = set()  # tenants with a dedicated job above its minimum
        for j in snap.running:
            for node, g in j.placement.items():
                used[node] = used.get(node, 0) + g
            if j.releasing_gpus:
                for node, g in j.releasing.items():
                    draining[node] = draining.get(node, 0) + g
            elif j.gpus < j.max_gpus:
                self.growable.append(j)
            if j.kind == "dedicated":
                t = j.tenant
                self.ded_held[t] += j.gpus
                if not j.releasing_gpus:
                    if j.priority < self.ded_low_priority.get(t, j.priority + 1):
                        self.ded_low_priority[t] = j.priority
                    if j.gpus > j.min_gpus:
                        self.ded_elastic.add(t)
            else:
                self.spot_held[j.tenant] += j.gpus - j.releasing_gpus
        self.used, self.draining0 = used, draining
        self._init_rest(snap, sum(map(_gpus, snap.loans)))

    def _init_rest(self, snap: Snapshot, loaned_gpus: int) -> None:
        self.loaned_gpus = loaned_gpus
        self.training = View("training", self.max_node_gpus)
        self.loan = View("loan", self.max_node_gpus)
        self.returned: dict[str, int] = {}  # loan node -> GPUs handed back this call
        self.reserved: dict[str, int] = {}  # loan node -> free GPUs kept for a reclaim
        self.claimed_draining: dict[str, int] = {}  # loan node -> draining GPUs counted toward a reclaim
        self.reclaim_victim_gpus = 0  # loaned GPUs that reclaim victims will release
        self.fair: dict[str, float] = {}
        self._victim_index: object | None = None  # victims.VictimIndex, built on the first search
        self.allowed_nodes: dict[tuple[str, ...], AbstractSet[str]] = {}  # view names -> placeable nodes

    def _from_index(self, index: RunningIndex) -> bool:
        """The walk of ``__init__`` from ``index``; ``False`` (nothing set) if a job's tenant is unknown."""
        snap = self.snap
        if not index.nodes(snap.nodes):
            return False
        index.update(snap.running)
        tenants = self.tenants
        if any(k and t not in tenants for t, k in index.jobs_of.items()):
            return False
        self.max_node_gpus, self.training_gpus = index.max_node_gpus, index.training_gpus
        # Read only after this: kept by the index across calls.
        loans = index.loan_map(snap.loans)
        moved = None
        if loans is None:  # (two loans name one node: not a valid snapshot, but decided as the walk does)
            self.loans = dict(zip(map(_node, snap.loans), snap.loans, strict=True))
            loaned_gpus = sum(map(_gpus, snap.loans))
        else:
            self.loans, self._loan_free, self._loan_ends = loans, index.loan_free, index.loan_ends
            loaned_gpus, moved = index.loaned_gpus, index.loans_moved
        self.pool_of, self._loan_order = index.loaned(self.loans.keys(), moved)
        self.ded_held = {t: index.ded_held.get(t, 0) for t in tenants}
        self.spot_held = {t: index.spot_held.get(t, 0) for t in tenants}
        self.growable = None  # listed by growable_jobs() only if the grow step runs (spare GPUs)
        self._growable_src = index.growable
        self.ded_low_priority = {t: min(p) for t, p in index.ded_prio.items() if p}
        self.ded_elastic = {t for t, k in index.ded_elastic.items() if k}
        self.used, self.draining0 = index.used, index.draining
        self._init_rest(snap, loaned_gpus)
        return True

    def blocked_loans(self) -> set[str]:
        """The loaned nodes whose loan ends within ``min_loan_left_s``: not offered for placement."""
        now, left = self.now, self.cfg.min_loan_left_s
        if self._loan_ends is not None:  # (the index's loans with a finite end: the others never are)
            return {n for n, until in self._loan_ends.items() if until - now < left}
        return {ln.node for ln in self.snap.loans if ln.until_s - now < left}

    def build_views(self, blocked_loans: set[str]) -> None:
        """Fill the training and loan views from the node list (O(nodes))."""
        used, drain, pool_of, loans = self.used, self.draining0, self.pool_of, self.loans
        tv, lv = self.training, self.loan
        if self.index is not None and self.used is self.index.used:
            self._build_views_from_plan(blocked_loans)
            return
        for n in self.snap.nodes:
            name = n.name
            pool = pool_of.get(name)
            if pool is None:
                continue
            if pool == "training":
                tv.add(name, n.gpus - used.get(name, 0), drain.get(name, 0))
            else:
                free = loans[name].gpus - used.get(name, 0)
                lv.add(name, free, drain.get(name, 0), name not in blocked_loans)

    def _build_views_from_plan(self, blocked_loans: set[str]) -> None:
        """``build_views`` from the index's per-node free counts (the same views), O(busy nodes + loans)."""
        index = self.index
        assert index is not None
        pos, drain, used_get, loans = index.pos, self.draining0, self.used.get, self.loans
        tv, lv = self.training, self.loan
        tv.free = dict(index.train_free)
        tb = tv.buckets
        total = 0
        tfree = index.train_free
        for name in index.train_open:  # (in node order)
            f = tv.free[name]
            tb[f][name] = None
            total += f
        tv.total += total
        for name in sorted((n for n in drain if n in tfree), key=pos.__getitem__):
            tv.draining[name] = drain[name]
        # View.add for every loaned node in node order, column by column (the order kept by the index)
        names = self._loan_order
        if self._loan_free is not None:  # kept by the index
            free_of = list(map(self._loan_free.__getitem__, names))
        else:
            free_of = [loans[n].gpus - used_get(n, 0) for n in names]
        lv.free = dict(zip(names, free_of, strict=True))
        lfree = lv.free
        for name in sorted((n for n in drain if n in lfree), key=pos.__getitem__):
            lv.draining[name] = drain[name]  # index.draining holds no zeros
        lv.blocked = {n for n in blocked_loans if n in lfree}
        lb, blocked, total = lv.buckets, lv.blocked, 0
        for name, free in zip(names, free_of, strict=True):
            if free > 0 and name not in blocked:
                lb[free][name] = None
                total += free
        lv.total += total

    def growable_jobs(self) -> list[Job]:
        """Running jobs not releasing and below their maximum (in running order without the index)."""
        if self.growable is None:
            src = self._growable_src
            self.growable = list(src.values()) if src is not None else [
                j for j in self.snap.running if not j.releasing_gpus and j.gpus < j.max_gpus]
        return self.growable

    def compute_fair(self, pending_spot_tenants: set[str]) -> None:
        """Fair share per active tenant (spot jobs running or waiting), by weight, of spot capacity: training
        GPUs not held by dedicated jobs plus loaned GPUs not promised back."""
        kept = sum(self.reserved.values()) + sum(self.returned.values()) + self.reclaim_victim_gpus
        kept += sum(self.claimed_draining.values())
        spot_capacity = self.training_gpus - sum(self.ded_held.values()) + self.loaned_gpus - kept
        active = [t for t in self.tenants if self.spot_held[t] > 0 or t in pending_spot_tenants]
        weights = sum(self.tenants[t].weight for t in active)
        for t in active:
            self.fair[t] = max(spot_capacity, 0) * self.tenants[t].weight / weights

    def share(self, tenant: str, extra_gpus: int = 0) -> float:
        """Spot GPUs held (plus ``extra_gpus``) over the tenant's fair share of spot capacity."""
        held = self.spot_held[tenant] + extra_gpus
        if held <= 0:
            return 0.0
        fair = self.fair.get(tenant, 0.0)
        return held / fair if fair > 0 else math.inf

    def views_for(self, job: Job) -> list[list[View]]:
        """The pools a job may be placed on, as placement attempts in order of preference."""
        if job.kind == "dedicated":
            return [[self.training]]
        # Spot: loaned GPUs first (keeps training GPUs for dedicated work), then idle training GPUs,
        # then a gang spanning both.
        return [[self.loan], [self.training], [self.loan, self.training]]

    def quota_room(self, tenant: str) -> int:
        return self.tenants[tenant].quota_gpus - self.ded_held[tenant]

    def quota_can_free(self, job: Job) -> bool:
        """Could ``job``'s tenant's own dedicated jobs make quota room for it (lower priority, or elastic)?"""
        t = job.tenant
        return t in self.ded_elastic or self.ded_low_priority.get(t, job.priority) < job.priority

    def wait(self, job: Job, reason: str, until_s: float | None = None) -> None:
        """Note why ``job`` did not start (or grow) in this call; the first reason found wins."""
        if self.why is not None and job.id not in self.why:
            self.why[job.id] = Waiting(reason, until_s)

    def free_for(self, job: Job) -> int:
        """Free GPUs in the pools ``job`` may use (training; spot also loaned serving GPUs)."""
        return self.training.total + (self.loan.total if job.kind == "spot" else 0)

    def issue_return(self, node: str, gpus: int) -> None:
        self.loan.take(node, gpus)
        self.returned[node] = self.returned.get(node, 0) + gpus
        self.decisions.append(ReturnGpus(node, gpus))

    def issue_admit(self, job: Job, placement: dict[str, int]) -> None:
        self.touched.add(job.id)
        self._count(job, sum(placement.values()))
        self.decisions.append(Admit(job.id, placement))

    def issue_shrink(self, job: Job, release: Mapping[str, int], reason: Reason, by_s: float,
                     for_job: str | None, claimed: Mapping[str, int]) -> None:
        """``claimed``: the released GPUs the need being served takes; the rest drain to anyone."""
        self.touched.add(job.id)
        gpus = sum(release.values())
        if job.kind == "spot":
            self.spot_held[job.tenant] -= gpus
        self._drain_unclaimed(release, claimed)
        self.decisions.append(Shrink(job.id, job.gpus - gpus, dict(release), reason, by_s, for_job))

    def issue_preempt(self, job: Job, reason: Reason, by_s: float, for_job: str | None,
                      claimed: Mapping[str, int]) -> None:
        self.touched.add(job.id)
        if job.kind == "spot":
            self.spot_held[job.tenant] -= job.gpus
        self._drain_unclaimed(job.placement, claimed)
        self.decisions.append(Preempt(job.id, reason, by_s, for_job))

    def _count(self, job: Job, gpus: int) -> None:
        if job.kind == "dedicated":
            self.ded_held[job.tenant] += gpus
        else:
            self.spot_held[job.tenant] += gpus

    def _drain_unclaimed(self, release: Mapping[str, int], claimed: Mapping[str, int]) -> None:
        for node, g in release.items():
            left = g - claimed.get(node, 0)
            if left > 0:
                pool = self.pool_of.get(node)
                if pool == "training":
                    self.training.add_draining(node, left)
                elif pool == "loan":
                    self.loan.add_draining(node, left)

"""The event loop: a virtual clock, one heap of events, the policies called as the control plane calls them.

Events at one instant are handled in the order of their kinds (``RELEASE`` ... ``SCHED``); then
``schedule()`` runs if a tick or a reclaim notice came, if loaned GPUs came free while a reclaim is due,
or if anything changed ``sched_period_s`` after the last call (docs/simulator.md, "How it works").
One ``SeedSequence(config.seed)`` spawns the failure and backlog streams: runs are reproducible.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.model import Job, Loan, Tenant, check_snapshot
from tidal.policy.ledger import for_takers
from tidal.policy.loan import LoanContext
from tidal.policy.scheduler import RunningIndex, schedule
from tidal.sim.config import SimConfig
from tidal.sim.jobs import BacklogSource, JobSpec, SpotBacklog
from tidal.sim.metrics import JobTotals, Meter, job_totals, summarize
from tidal.sim.policies import PolicySpec, build, horizon_steps
from tidal.sim.world import FAIL, FINISH, RELEASE, World

WARM, SUBMIT, SCORE, TICK, WAKE, SCHED = range(3, 9)
TIMELINE_FIELDS = ("t_s", "demand_gpus", "upper_gpus", "lendable_gpus", "lent_gpus", "warming_gpus",
                   "training_on_loans_gpus", "training_gpus")


@dataclass
class SimResult:
    """One run: its ``metrics`` (see :mod:`tidal.sim.metrics`) and per-step ``timeline`` arrays."""

    policy: PolicySpec
    metrics: dict[str, Any]
    timeline: dict[str, np.ndarray] = field(default_factory=dict)


def make_tenants(jobs: list[JobSpec], backlog: SpotBacklog | None, training_gpus: int,
                 tenants: list[Tenant] | None = None) -> list[Tenant]:
    """The given tenants, plus one (weight 1) per tenant a job names; those with dedicated jobs split the
    training pool evenly; backlog tenants get no quota."""
    known = {t.name: t for t in tenants or []}
    names = sorted({j.tenant for j in jobs} - set(known))
    ded = sorted({j.tenant for j in jobs if j.kind == "dedicated"} - set(known))
    quota = training_gpus // len(ded) if ded else 0
    out = list(known.values())
    out += [Tenant(n, quota if n in ded else 0) for n in names]
    if backlog is not None:
        out += [Tenant(f"spot{i}") for i in range(backlog.tenants) if f"spot{i}" not in known and
                f"spot{i}" not in names]
    return out


class Engine:
    """One run of one policy. ``check``: verify the world after every scheduling call (tests; slow)."""

    def __init__(self, demand: np.ndarray, step_s: float, policy: PolicySpec, config: SimConfig,
                 jobs: list[JobSpec], backlog: SpotBacklog | None, tenants: list[Tenant] | None = None,
                 check: bool = False, night_hours: float = 8.0, clients: np.ndarray | None = None) -> None:
        self.cfg, self.step, self.spec, self.check = config, step_s, policy, check
        self.n_steps = math.ceil(config.end_s / step_s - 1e-9)
        self.policy = build(policy, config, step_s, np.asarray(demand[: self.n_steps]),
                            night_hours=night_hours)
        self.h_steps = horizon_steps(self.policy, step_s) if self.policy is not None else 1
        need = self.n_steps + self.h_steps
        short = len(demand) < need
        self.demand = np.resize(np.asarray(demand, dtype=float), need) if short else np.asarray(demand)
        self.clients = None if clients is None else np.resize(clients, (need, clients.shape[1]))
        self.pstate = self.policy.initial_state() if self.policy is not None else None
        self.sched_index = RunningIndex()  # the scheduler's incremental per-node sums (same decisions)
        self.last_running: Sequence[Job] = ()  # the running jobs the index saw last (the object)
        self.last_loans: Sequence[Loan] = ()  # ... and the loans
        ss = np.random.SeedSequence(config.seed)
        fail_seq, backlog_seq = ss.spawn(2)
        self.heap: list[tuple] = []
        self.seq = 0
        self.jobs = [j for j in jobs if j.submit_s < config.end_s]
        self.tenants = make_tenants(self.jobs, backlog, config.training_gpus, tenants)
        self.world = World(config, self.tenants, self._push, np.random.default_rng(fail_seq))
        self.source = (BacklogSource(backlog, config.gpus_per_node, np.random.default_rng(backlog_seq),
                                     max_gpus=config.serving_gpus + config.training_gpus)
                       if backlog is not None else None)
        pending = backlog.pending_gpus if backlog is not None else None
        self.backlog_target = config.serving_gpus + config.training_gpus if pending is None else pending
        self.meter = Meter(config.serving_gpus, config.score_from_s)
        self.next_job = 0
        self.dirty = False
        self.sched_pending = False
        self.last_sched = -math.inf
        self.next_tick_s = 0.0
        self.decision_ms: list[float] = []
        self.decision_wall_ms: list[float] = []
        self.pending_per_call: list[int] = []
        self.plan_ms: list[float] = []
        self.max_pending = 0
        self.timeline: dict[str, list[float]] = {k: [] for k in TIMELINE_FIELDS}
        self.start_totals: JobTotals | None = None
        self.start_counts: dict[str, int] = {}

    def _push(self, t: float, kind: int, a: Any = None, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, a, b))

    def run(self) -> SimResult:
        # A young-generation collection every 50,000 net allocations, not Python's default 700: the run
        # makes few reference cycles, and at 700 the collections alone took ~4 % of a month at scale.
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], 50_000), *threshold[1:])
        try:
            return self._run()
        finally:
            gc.set_threshold(*threshold)

    def _run(self) -> SimResult:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        cfg, w = self.cfg, self.world
        end = cfg.end_s
        self._push(0.0, TICK, 0)
        if cfg.score_from_s > 0:
            self._push(cfg.score_from_s, SCORE)
        if self.jobs:
            self._push(self.jobs[0].submit_s, SUBMIT)
        heap = self.heap
        while heap and heap[0][0] < end:
            t = heap[0][0]
            self.meter.advance(t, w.serving.capacity, w.serving.lent, w.held_serving, w.held_total)
            urgent = False
            while heap and heap[0][0] == t:
                _, kind, _, a, b = heapq.heappop(heap)
                if kind in (RELEASE, FINISH):
                    freed = w.release(a, t) if kind == RELEASE else w.finish(a, b, t)
                    if freed is not None:
                        self.dirty = True
                        urgent = urgent or (freed > 0 and w.serving.due_reclaim(t))
                elif kind == FAIL:
                    w.fail(a, b, t)
                elif kind == WARM:
                    w.serving.warm_done(a, t)
                elif kind == SUBMIT:
                    self._submit(t)
                elif kind == SCORE:
                    self.start_totals = job_totals(w.jobs.values(), t)
                    self.start_counts = dict(w.counts)
                elif kind == TICK:
                    self._tick(t, a)
                    urgent = True
                elif kind == WAKE:
                    urgent = True
                elif kind == SCHED:
                    self.sched_pending = False
            if urgent or (self.dirty and t >= self.last_sched + cfg.sched_period_s):
                self._schedule(t)
            elif self.dirty and not self.sched_pending and (
                    self.last_sched + cfg.sched_period_s < self.next_tick_s):
                self._push(self.last_sched + cfg.sched_period_s, SCHED)  # (else the next tick runs it)
                self.sched_pending = True
        self.meter.advance(end, w.serving.capacity, w.serving.lent, w.held_serving, w.held_total)
        res = self._result(end, time.perf_counter() - wall0)
        res.metrics["cpu_s"] = time.process_time() - cpu0
        return res

    def _submit(self, t: float) -> None:
        jobs = self.jobs
        while self.next_job < len(jobs) and jobs[self.next_job].submit_s <= t:
            self.world.submit(jobs[self.next_job], t)
            self.next_job += 1
        if self.next_job < len(jobs):
            self._push(jobs[self.next_job].submit_s, SUBMIT)
        self.dirty = True

    def _tick(self, t: float, i: int) -> None:
        w, n = self.world, self.cfg.serving_gpus
        d = float(self.demand[i])
        self.meter.demand = d
        upper = math.nan
        if self.policy is not None:
            fut = self.demand[i + 1: i + 1 + self.h_steps] if self.spec.name == "oracle" else None
            ctx = LoanContext(now_s=t, serving_gpus=n, demand_gpus=d, lent_gpus=w.serving.lent,
                              future_demand_gpus=fut,
                              client_gpus=None if self.clients is None else self.clients[i])
            t0 = time.perf_counter()
            plan, self.pstate = self.policy(ctx, self.pstate)
            self.plan_ms.append((time.perf_counter() - t0) * 1e3)
            if self.cfg.lend_to_takers:
                plan = for_takers(plan, w.serving, w.used, w.spot_wanted())
            for notice in w.serving.apply_plan(plan, t, w.used):
                if notice < t + self.step:
                    self._push(notice, WAKE)
            if self.cfg.record_timeline:  # the bound within the lead time, for the timeline only
                inside = plan.times_s <= t + plan.lead_time_s + 1e-9
                upper = float(np.max(plan.upper_gpus[inside])) if inside.any() else float(plan.upper_gpus[0])
        if self.source is not None:
            src = self.source
            for size in src.sizes:
                for _ in range(src.b.pending_per_size - w.pending_synthetic_by_size.get(size, 0)):
                    w.submit(src.draw(t, size), t)
            while w.pending_synthetic_gpus < self.backlog_target:
                w.submit(src.draw(t), t)
            self.dirty = True
        if self.cfg.record_timeline:
            tl = self.timeline
            s = w.serving
            row = (t, d, upper, s.lendable, s.lent, s.warming, w.held_serving, w.held_total)
            for k, v in zip(TIMELINE_FIELDS, row, strict=True):
                tl[k].append(v)
        if i + 1 < self.n_steps:
            self.next_tick_s = t + self.step
            self._push(self.next_tick_s, TICK, i + 1)
        else:
            self.next_tick_s = math.inf

    def _schedule(self, t: float) -> None:
        w = self.world
        self.sched_index.ckpt_moved(*w.refresh_checkpoints(t))  # the index keeps the checkpoint column
        snap = w.snapshot(t)
        added, removed = w.running.take_changes()  # what the index would otherwise find by comparing all
        self.sched_index.hint(snap.running, self.last_running, added, removed)
        self.last_running = snap.running
        self.sched_index.hint_loans(snap.loans, self.last_loans, w.serving.take_loan_changes())  # (the same)
        self.last_loans = snap.loans
        pending = sum(len(q) for q in snap.queues.values())
        self.max_pending = max(self.max_pending, pending)
        self.pending_per_call.append(pending)
        gc_on = gc.isenabled()
        gc.disable()  # as timeit does: a collection of the simulator's heap is not the decision's latency
        c0, t0 = time.thread_time(), time.perf_counter()
        decisions = schedule(snap, self.cfg.scheduler, self.sched_index)
        t1, c1 = time.perf_counter(), time.thread_time()
        if gc_on:
            gc.enable()
        # CPU time of the call (on a shared machine the wall clock also counts other processes) and wall time
        self.decision_ms.append((c1 - c0) * 1e3)
        self.decision_wall_ms.append((t1 - t0) * 1e3)
        for ready, node in w.apply(decisions, t):
            self._push(ready, WARM, node)
        w.apply(w.plan_intervals(t), t)
        self.last_sched = t
        self.dirty = False
        if self.check:
            self.check_invariants(t)

    def check_invariants(self, t: float) -> None:
        """Raise ``AssertionError`` if the world is inconsistent (see ``tests/test_sim_*.py``)."""
        w = self.world
        try:
            check_snapshot(w.snapshot(t))
        except ValueError as e:
            raise AssertionError(f"t={t:g}: {e}") from None
        s = w.serving
        assert 0 <= s.lent <= s.total, f"t={t:g}: lent {s.lent} of {s.total}"
        assert s.warming >= 0 and s.lent + s.warming <= s.total, f"t={t:g}: lent {s.lent} + {s.warming}"
        gpus = {n.name: n.gpus for n in w.nodes}
        for node, used in w.used.items():
            cap = s.lent_on(node) if node in w.serving_nodes else gpus[node]
            assert 0 <= used <= cap, f"t={t:g}: node {node} has {used} GPUs held, {cap} available"

    def _result(self, end: float, wall_s: float) -> SimResult:
        w = self.world
        start = self.start_totals or job_totals((), 0.0)
        counts = {k: v - self.start_counts.get(k, 0) for k, v in w.counts.items()}
        metrics = summarize(
            meter=self.meter, start=start, end=job_totals(w.jobs.values(), end), jobs=list(w.jobs.values()),
            end_s=end, score_from_s=self.cfg.score_from_s, serving_gpus=self.cfg.serving_gpus,
            training_gpus=self.cfg.training_gpus, weights={t.name: t.weight for t in self.tenants},
            counts=counts, decision_ms=self.decision_ms, plan_ms=self.plan_ms, wall_s=wall_s)
        metrics["max_pending_jobs"] = self.max_pending
        wall_ms = self.decision_wall_ms
        metrics["decision_wall_p99_ms"] = float(np.percentile(wall_ms, 99)) if wall_ms else math.nan
        metrics["schedule_cpu_s"] = sum(self.decision_ms) / 1e3
        if self.spec.name == "tidal" and self.pstate is not None:
            metrics["tidal_final_z"] = float(self.pstate.z)
        timeline = {k: np.asarray(v, dtype=float) for k, v in self.timeline.items()}
        return SimResult(self.spec, metrics, timeline)


def simulate(demand: np.ndarray, *, step_s: float, policy: PolicySpec, config: SimConfig,
             jobs: list[JobSpec] | None = None, backlog: SpotBacklog | None = None,
             tenants: list[Tenant] | None = None, check: bool = False, night_hours: float = 8.0,
             clients: np.ndarray | None = None) -> SimResult:
    """Run one policy over ``demand`` (GPUs per ``step_s`` from time 0; NaN = unknown; repeats if
    shorter than the run); ``clients``: the same per client (steps x clients, the tail last), if known."""
    engine = Engine(demand, step_s, policy, config, list(jobs or []), backlog, tenants, check, night_hours,
                    clients)
    return engine.run()

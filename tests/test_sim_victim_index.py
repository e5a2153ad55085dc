"""The scheduler's incremental index as the simulator drives it: victim keys kept across calls.

The simulator keeps one :class:`~tidal.policy.scheduling.index.RunningIndex` for a whole run and moves
``Job.last_ckpt_s`` in place between calls (``World.refresh_checkpoints``). The index keeps the spot
jobs sorted by id with their fixed key columns, so a victim search reads only the checkpoint times
anew; the orders and the decisions must be exactly those of the full walk.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sched_fixtures import apply, nodes, settle
from test_scheduler import FAST, worlds
from tidal.model import Job, Loan, Reclaim, Snapshot, Tenant
from tidal.policy.scheduler import RunningIndex, SchedulerConfig, schedule
from tidal.policy.scheduling import targets
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.preemption import GangNeed
from tidal.policy.scheduling.targets import WALK_BLOCK, _spot_pre
from tidal.policy.scheduling.victims import VictimIndex, stable_argsort

CKPT = st.none() | st.sampled_from([-3000.0, -900.0, -400.0, -100.0, 0.0])


def _victim_orders(s: Snapshot, index: RunningIndex | None) -> tuple:
    c = Cycle(s, SchedulerConfig(), index)
    c.build_views({"s1"})  # a loan ending soon: closed to placement
    c.compute_fair({j.tenant for j in s.running if j.kind == "spot"})
    v = VictimIndex(c)
    ids = (
        [j.id for j in v.spot_pre],
        v.protected,
        [j.id for j in v.spot_shrink],
        [j.id for j in v.spot_pre_open],
    )
    groups = {(p, t): (ranks.tolist(), fewest) for p, t, ranks, fewest in v.open_groups()}
    by_code = v.open_group_codes()
    if by_code is not None:  # the same groups, by the index's codes
        codes, listed, _ = by_code
        assert {(p, t): (np.flatnonzero(codes == k).tolist(), fewest) for p, t, k, fewest in listed} == groups
    # The preemption candidates of pending spot jobs of every tenant, priority and size (one victim
    # already touched in this call): the group mask and each job's checks, as columns or one by one.
    c.touched.add(min((j.id for j in s.running), default=""))
    pre = {(t, p, g): [(j.id, why) for j, why, _ in _spot_pre_of(c, Job("new", f"u{t}", "spot", priority=p,
                                                                      min_gpus=g), p)]
           for t in range(3) for p in range(3) for g in (1, 2, 3, 8)}
    return (ids, groups, [j.id for j in v.spot_pre_any_loan()], sorted(v.on_training), sorted(v.on_loan),
            sorted(v.on_any_loan), {t: [j.id for j in d] for t, d in v.dedicated.items()}, pre)


def _spot_pre_of(c: Cycle, job: Job, e: int):
    """A pending spot job's preemption candidates as the search reads them: by the index's columns where
    the cycle has them, else one by one."""
    cols = targets._spot_pre_cols(c, job, e)
    return _spot_pre(c, job, e) if cols is None else targets._pre_from_cols(c, cols)


def _kept_ckpt_is_the_jobs(idx: RunningIndex) -> None:
    """The index's own ``last_ckpt_s`` column (kept from the caller's reports) is the jobs' field."""
    cols = idx.spot_columns()
    assert cols is not None and cols.last_ckpt_s is not None
    want = np.array([j.last_ckpt_s for j in idx.spot_sorted], dtype=np.float64)
    np.testing.assert_array_equal(cols.last_ckpt_s, want)


@FAST
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([1, 2, 4]), st.integers(0, 1), st.booleans(),
                          st.sampled_from([None, -2000.0, -500.0, -100.0]), CKPT, st.integers(0, 99)),
                min_size=1, max_size=14),
       st.lists(st.tuples(st.integers(0, 13), CKPT), max_size=6), st.integers(0, 13))
def test_kept_victim_orders_equal_the_walk_as_jobs_come_go_and_checkpoint(specs, moves, gone):
    """Orders from the kept columns (ids inserted out of order, ties in every key but the id) equal
    the full walk's, after checkpoints move in place and after jobs leave and new ones arrive; also
    with the checkpoint column kept by the index from the caller's reports (``ckpt_moved``)."""
    def job(k: int, t: int, g: int, p: int, elastic: bool, started, ckpt, name: int) -> Job:
        on = {f"t{k}": g}
        if k % 3 == 0:  # some on a loaned node only (s1's loan ends soon: closed), some on both
            on = {f"s{k % 2}": min(g, 2)} if k % 2 == 0 or g == 1 else {f"t{k}": g - 1, f"s{k % 2}": 1}
        size = sum(on.values())
        return Job(
            f"j{name:02d}-{k}",
            f"u{t}",
            "spot",
            priority=p,
            min_gpus=1 if elastic else size,
            max_gpus=8,
            placement=on,
            started_s=started,
            last_ckpt_s=ckpt,
        )

    jobs = [job(k, *spec) for k, spec in enumerate(specs)]
    pool = nodes((8,) * 16, (8, 8))
    loans = [Loan("s0", 8), Loan("s1", 8, until_s=300.0)]
    ts = [Tenant(f"u{i}", 0, 1.0 + i % 2) for i in range(3)]
    idx, rep = RunningIndex(), RunningIndex()
    rep.ckpt_moved([])  # from now on it is told of every move
    s = Snapshot.build(0.0, pool, ts, jobs, loans)
    assert _victim_orders(s, idx) == _victim_orders(s, None) == _victim_orders(s, rep)
    _kept_ckpt_is_the_jobs(rep)
    for k, ck in moves:  # the simulator's in-place refresh
        if k < len(jobs):
            object.__setattr__(jobs[k], "last_ckpt_s", ck)
    told = [jobs[k] for k, _ in moves if k < len(jobs)] + [jobs[0]]  # repeats and unmoved: harmless
    half = len(told) // 2  # told with their times (as the simulator does) and without
    rep.ckpt_moved(told[:half], [j.last_ckpt_s for j in told[:half]])
    rep.ckpt_moved(told[half:])
    assert _victim_orders(s, idx) == _victim_orders(s, None) == _victim_orders(s, rep)
    _kept_ckpt_is_the_jobs(rep)
    if gone < len(jobs):  # one job leaves, one changes (a new object), two arrive
        jobs = jobs[:gone] + jobs[gone + 1:]
        if jobs:
            jobs[0] = replace(jobs[0], priority=jobs[0].priority + 1)
        jobs += [job(14, 0, 2, 0, True, -1000.0, None, 50), job(15, 1, 1, 1, False, None, -200.0, 1)]
    s = Snapshot.build(100.0, pool, ts, jobs, loans)
    assert _victim_orders(s, idx) == _victim_orders(s, None) == _victim_orders(s, rep)
    _kept_ckpt_is_the_jobs(rep)


@FAST
@given(worlds(), st.permutations(range(10)),
       st.lists(st.tuples(st.booleans(), st.integers(0, 16), st.booleans(), st.lists(CKPT, max_size=10)),
                min_size=1, max_size=10), st.booleans())
def test_index_gives_the_same_decisions_with_checkpoints_moved_in_place(s, perm, script, report):
    """``schedule(s, index=...)`` kept across calls decides what the full walk decides while the
    caller moves ``last_ckpt_s`` of running jobs in place between calls (ids not in arrival order),
    reading the moved times from the jobs or, ``report``, keeping them from ``ckpt_moved``."""
    renamed = [replace(j, id=f"x{perm[int(j.id[1:])]}") for j in s.jobs()]
    s = Snapshot.build(s.now_s, s.nodes, s.tenants, renamed, s.loans, s.reclaims)
    idx = RunningIndex()
    for drain, reclaim_gpus, now_due, ckpts in script:
        if reclaim_gpus and s.loans:
            r = Reclaim(min(reclaim_gpus, sum(ln.gpus for ln in s.loans)), by_s=s.now_s + 300,
                        notice_s=None if now_due else s.now_s + 600)
            s = Snapshot.build(s.now_s, s.nodes, s.tenants, s.jobs(), s.loans, (*s.reclaims, r))
        for j, ck in zip(s.running, ckpts, strict=False):
            object.__setattr__(j, "last_ckpt_s", None if ck is None else s.now_s + ck)
        if report:
            idx.ckpt_moved(s.running[:len(ckpts)])
        decisions = schedule(s, index=idx)
        assert decisions == schedule(s)
        s = apply(s, decisions)
        s = settle(s, s.now_s + 700) if drain else Snapshot.build(s.now_s + 300, s.nodes, s.tenants, s.jobs(),
                                                                   s.loans, s.reclaims)


def test_repeated_ids_are_counted_as_jobs_come_and_go():
    """Two listed spot jobs with one id (not a valid snapshot) turn off the by-row loan filter."""
    a, b, other = (Job(jid, "u0", "spot", min_gpus=1, max_gpus=1, placement={n: 1})
                   for jid, n in (("x", "t0"), ("x", "t1"), ("y", "t2")))
    idx = RunningIndex()
    assert idx.nodes(tuple(nodes((8, 8, 8))))
    idx.update([a, other])
    assert idx.repeated_ids == 0
    idx.update([a, b, other])
    assert idx.repeated_ids == 1
    idx.update([b, other])
    assert idx.repeated_ids == 0


@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, 2.0, 1e9, math.inf, -math.inf, math.nan]) | st.floats(),
                max_size=300))
def test_stable_argsort_is_numpys_stable_argsort(keys):
    """The victim order's sort of work lost (ranks by a quick sort, then a radix sort of the ranks) is
    ``np.argsort(kind="stable")``: ties (many), signed zeros, infinities and NaN in index order."""
    a = np.array(keys, dtype=np.float64)
    assert stable_argsort(a).tolist() == np.argsort(a, kind="stable").tolist()


def test_stable_argsort_beyond_int16_ranks():
    a = np.random.default_rng(0).integers(0, 40_000, 40_000).astype(np.float64)
    assert stable_argsort(a).tolist() == np.argsort(a, kind="stable").tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([24, 96]), st.sampled_from([1, 3, WALK_BLOCK]))
def test_a_gangs_node_walk_by_columns_is_the_walk_job_by_job(seed, n_train, block):
    """A pending spot gang (whole nodes) on a full pool of small spot jobs: the walk that picks the nodes
    to clear reads the candidates' positions in the index's columns, by blocks (hundreds of jobs to clear
    a node or two, some on two or three nodes, some elastic, some protected, some on dedicated jobs'
    nodes, some already touched); the nodes and candidates are the generic walk's, and the decisions,
    in one call and in the next one with the index kept, whatever the blocks' size."""
    rng = random.Random(seed)
    targets.WALK_BLOCK = block
    pool = nodes((8,) * n_train, (8, 8))
    ts = [Tenant("u0", 8 * n_train // 4, 1.0), Tenant("u1", 0, 2.0), Tenant("u2", 0, 1.0)]
    free = {f"t{i}": 8 for i in range(n_train)} | {"s0": 8, "s1": 8}
    names = list(free)
    jobs: list[Job] = []
    k = 0
    while sum(free.values()) > 6:
        k += 1
        tenant = rng.choice(["u0", "u1", "u2", "u1"])
        kind = "dedicated" if tenant == "u0" and rng.random() < 0.3 else "spot"
        spread = rng.choice([1] * 8 + [2, 3])
        at = rng.sample([n for n in names if free[n]], min(spread, sum(1 for n in names if free[n])))
        place = {n: min(free[n], rng.choice([1, 1, 2, 3])) for n in at}
        for n, g in place.items():
            free[n] -= g
        size = sum(place.values())
        jobs.append(Job(f"r{k:04d}", tenant, kind, priority=rng.choice([0, 0, 1]),
                        min_gpus=rng.choice([size, size, 1]), max_gpus=size, placement=place,
                        started_s=-rng.choice([100.0, 2000.0, 5000.0]),
                        last_ckpt_s=rng.choice([None, -50.0, -1500.0])))
    for i in range(6):
        jobs.append(Job(f"p{i}", rng.choice(["u1", "u2"]), "spot", priority=rng.choice([1, 2, 2]),
                        min_gpus=8 * rng.choice([1, 2, 4]), gpus_per_node=8, submit_s=-10.0 * i))
    loans = [Loan("s0", 8), Loan("s1", 8, until_s=rng.choice([200.0, math.inf]))]
    s = Snapshot.build(0.0, pool, ts, jobs, loans)
    idx = RunningIndex()
    try:
        for _ in range(2):
            # the walk alone, some candidates already touched in this call (victims of an earlier job)
            c = Cycle(s, SchedulerConfig(), idx)
            c.build_views(c.blocked_loans())
            c.compute_fair({j.tenant for j in s.running if j.kind == "spot"})
            c.touched.update(j.id for j in s.running if rng.random() < 0.2)
            for job in s.pending():
                views = c.views_for(job)[-1]
                need = GangNeed(views, targets._allowed(c, views), job.min_gpus, job.gpus_per_node)
                if not need.fits():
                    got = targets._candidates(c, job, 0)
                    assert got is not None and isinstance(got[1], targets._PreCols)
                    shrink, cols = got
                    assert targets._focus_cols(c, need, shrink, cols) == targets._focus_nodes(
                        need, shrink, targets._pre_from_cols(c, cols))
            decisions = schedule(s, index=idx)
            assert decisions == schedule(s)
            s = settle(apply(s, decisions), s.now_s + 400)
    finally:
        targets.WALK_BLOCK = WALK_BLOCK

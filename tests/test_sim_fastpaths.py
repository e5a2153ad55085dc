"""Fast paths that must give exactly what the plain code gives (the scale benchmark's speed-ups).

* ``World``'s ``job_with``: ``dataclasses.replace`` for the store's changes of a job's state;
* the forecast's scalar slot, box kernel with every slot seen, row push and integer clip;
* ``World.refresh_checkpoints`` naming the jobs it moved (the index keeps their checkpoint times);
* the failure draws taken in blocks: ``Exponentials.scaled`` is ``rng.exponential(scale)`` draw by draw;
* a snapshot's running jobs read through from the store: what the tuple of them would hold.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tidal.model import Admit, Job, Preempt, Tenant
from tidal.policy import forecast as F
from tidal.sim.config import make_config
from tidal.sim.jobs import JobSpec
from tidal.sim.world import Exponentials, World, job_with

BASE = Job(
    "j1",
    "t1",
    "spot",
    priority=2,
    min_gpus=8,
    max_gpus=32,
    multiple_of=4,
    gpus_per_node=8,
    submit_s=5.0,
    ckpt_stall_s=12.0,
)
RUNNING = dataclasses.replace(BASE, placement={"n1": 8, "n2": 8}, started_s=100.0)

CHANGES = [
    (BASE, {"nominated_s": 50.0}),
    (BASE, {"placement": {"n1": 8}, "started_s": 60.0, "nominated_s": None}),
    (RUNNING, {"placement": {"n1": 8, "n2": 8, "n3": 8}, "last_grown_s": 200.0}),
    (RUNNING, {"releasing": {"n2": 8}, "last_shrunk_s": 300.0}),
    (RUNNING, {"releasing": {"n1": 8, "n2": 8}, "last_preempted_s": 300.0}),
    (dataclasses.replace(RUNNING, releasing={"n2": 8}), {"placement": {"n1": 8}, "releasing": {}}),
    (RUNNING, {"placement": {}, "releasing": {}, "started_s": None}),
]


@pytest.mark.parametrize(("job", "changes"), CHANGES)
def test_job_with_is_replace(job: Job, changes: dict) -> None:
    got, want = job_with(job, **changes), dataclasses.replace(job, **changes)
    for f in dataclasses.fields(Job):  # the derived fields (gpus, ...) are compare=False: check all
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert got is not job and job == dataclasses.replace(job)  # the original is untouched


def test_job_with_rejects_releasing_more_than_held() -> None:
    with pytest.raises(ValueError, match=r"releasing\['n2'\]=16"):
        job_with(RUNNING, releasing={"n2": 16})
    with pytest.raises(ValueError, match=r"releasing\['n9'\]"):
        job_with(RUNNING, placement={"n1": 8}, releasing={"n9": 8})


def test_scalar_slot_is_slot_of() -> None:
    cfg = F.ForecastConfig(step_s=600.0)
    rng = np.random.default_rng(3)
    times = np.concatenate(
        [np.arange(0, 3 * 86400, 300.0), rng.uniform(0, 1e7, 2000), [86399.999, 1e9 + 0.5]]
    )
    for t in times.tolist():
        assert F._slot(cfg, t) == int(F.slot_of(cfg, t)), t


def _box_masked(values: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    seen = (counts > 0).astype(float)[idx]
    den = seen.sum(axis=1)
    known = (counts > 0) & (den > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.where(known, (values[idx] * seen).sum(axis=1) / den, np.nan),
                np.where(known, (counts[idx] * seen).sum(axis=1) / den, 0.0))


@pytest.mark.parametrize("kernel", ["kernel_profile", "kernel_error"])
def test_box_with_every_slot_seen_is_the_masked_sum(kernel: str) -> None:
    cfg = F.ForecastConfig(step_s=600.0)
    idx = F._consts(cfg)[kernel]
    rng = np.random.default_rng(7)
    for _ in range(20):
        values = rng.lognormal(5.0, 2.0, cfg.slots)
        counts = rng.integers(1, 40, cfg.slots).astype(float)
        got, want = F._box(values, counts, idx), _box_masked(values, counts, idx)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    counts[5] = 0.0  # a slot not seen yet: the masked path
    got, want = F._box(values, counts, idx), _box_masked(values, counts, idx)
    assert np.array_equal(got[0], want[0], equal_nan=True) and np.array_equal(got[1], want[1])


def test_push_row_and_clip_are_vstack_and_clip() -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(6, 6))
    for row in (rng.normal(size=6), np.arange(6)):
        assert np.array_equal(F._push_row(row, rows), np.vstack([np.asarray(row, float)[None, :], rows[:-1]]))
    a = rng.integers(-5, 700, 50)
    assert np.array_equal(F._clip_int(a, 599), np.clip(a, 0, 599))


def test_refresh_checkpoints_returns_exactly_the_jobs_it_moved() -> None:
    """``World.refresh_checkpoints`` hands back the ``Job`` objects whose ``last_ckpt_s`` it moved in place
    (what the scheduler's ``RunningIndex.ckpt_moved`` is told): every moved one, the store's object, with
    its new time."""
    cfg = make_config(serving_gpus=8, training_gpus=16, days=1, restart_s=100.0)
    w = World(cfg, [Tenant("a", quota_gpus=16)], lambda *e: None, np.random.default_rng(0))
    for jid in ("j1", "j2"):
        w.submit(JobSpec(jid, "a", "spot", 0, 2, 4, 1e9, 0.0), 0.0)
    w.apply([Admit("j1", {"t0000": 4}), Admit("j2", {"t0001": 4})], 0.0)
    seen = 0
    for t in np.arange(0.0, 20000.0, 250.0):
        before = {jid: w.jobs[jid].job.last_ckpt_s for jid in ("j1", "j2")}
        moved, times = w.refresh_checkpoints(float(t))
        changed = {jid for jid in before if w.jobs[jid].job.last_ckpt_s != before[jid]}
        assert {j.id for j in moved} >= changed
        assert all(j is w.jobs[j.id].job for j in moved)
        assert times == [j.last_ckpt_s for j in moved]
        seen += len(changed)
    assert seen >= 4  # checkpoints did move, more than once each


@pytest.mark.parametrize("block", [1, 7, 4096])
def test_block_draws_are_the_one_by_one_draws(block: int) -> None:
    scales = np.random.default_rng(1).lognormal(8.0, 4.0, 3000).tolist()
    one_by_one = np.random.default_rng(5)
    blocks = Exponentials(np.random.default_rng(5), block)
    for scale in scales:
        assert blocks.scaled(scale) == float(one_by_one.exponential(scale))


def test_snapshot_reads_the_running_jobs_as_their_tuple() -> None:
    """``World.snapshot(t).running`` (read through, not copied) holds what ``tuple(running.values())``
    would, by length, iteration, index and slice, as jobs start, change and leave."""
    cfg = make_config(serving_gpus=8, training_gpus=24, days=1, restart_s=100.0)
    w = World(cfg, [Tenant("a", quota_gpus=24)], lambda *e: None, np.random.default_rng(0))
    for jid in ("j1", "j2", "j3"):
        w.submit(JobSpec(jid, "a", "spot", 0, 2, 4, 1e9, 0.0), 0.0)
    steps = [[Admit("j1", {"t0000": 4}), Admit("j2", {"t0001": 4})], [Admit("j3", {"t0002": 2})],
             [Preempt("j2", "priority", 500.0)]]
    for k, decisions in enumerate(steps):
        w.apply(decisions, 100.0 * k)
        live, want = w.snapshot(100.0 * k).running, tuple(w.running.values())
        assert len(live) == len(want) and tuple(live) == want and list(reversed(live)) == list(reversed(want))
        every = range(-len(want), len(want))
        assert [live[i] for i in every] == [want[i] for i in every]
        assert live[1:] == want[1:] and (want[0] in live)
    w.release("j2", 500.0)
    assert tuple(w.snapshot(500.0).running) == tuple(w.running.values()) and len(w.running) == 2

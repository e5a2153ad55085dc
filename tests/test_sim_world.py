"""The simulator's job model: closed-form progress and checkpoints, the state table, decisions applied."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tidal.model import Admit, Preempt, Shrink, Tenant
from tidal.sim.config import make_config
from tidal.sim.jobs import JobSpec
from tidal.sim.progress import DurableTable, Segment, durable_times_and_next
from tidal.sim.world import (
    DONE,
    PENDING,
    RUNNING,
    SHRINKING,
    STOPPING,
    TRANSITIONS,
    IllegalTransition,
    SimJob,
    World,
    transition,
)

# --- progress: one job's timeline in closed form ------------------------------------------------------


def seg(**kw) -> Segment:
    args = {"t0": 100.0, "p0": 0.0, "rate": 8.0, "tau_s": 1000.0, "stall_s": 10.0, "lag_s": 0.0, "dur_p": 0.0,
            "dur_ct": 0.0}
    args.update(kw)
    return Segment(**args)


def test_progress_trains_between_stalls():
    s = seg()
    assert s.at(100.0) == 0.0 and s.at(50.0) == 0.0  # restoring until t0
    assert s.at(1090.0) == pytest.approx(8 * 990)  # trained tau - stall, then stalls
    assert s.at(1100.0) == pytest.approx(8 * 990)
    assert s.at(1600.0) == pytest.approx(8 * (990 + 500))
    t = s.finish_s(8 * 1500)
    assert s.at(t) == pytest.approx(8 * 1500) and t == pytest.approx(100 + 1000 + 510)


def test_sync_checkpoint_is_durable_when_the_stall_ends_concurrent_one_persist_later():
    sync = seg()
    assert sync.durable(1099.0)[0] == 0.0
    p, ct = sync.durable(1100.0)
    assert p == pytest.approx(8 * 990) and ct == pytest.approx(1090.0)
    conc = seg(lag_s=300.0)
    assert conc.durable(1399.0)[0] == 0.0 and conc.durable(1400.0)[0] == pytest.approx(8 * 990)
    assert conc.in_flight(1200.0) == pytest.approx((1400.0, 8 * 990, 1090.0))
    assert conc.next_durable_s(1200.0) == pytest.approx(1400.0)


def test_stop_freezes_progress_and_no_capture_starts_after_it():
    s = seg(stop_s=1500.0)
    assert s.at(5000.0) == s.at(1500.0) == pytest.approx(8 * (990 + 400))
    assert s.finish_s(8 * 5000) == math.inf
    assert s.durable(9999.0)[0] == pytest.approx(8 * 990)  # only the capture that started before the stop


def test_rebase_after_a_failure_drops_the_write_in_flight():
    s = seg(lag_s=300.0)
    keep, _ = s.durable(1200.0)
    assert keep == 0.0
    r = s.rebased(1200.0, p0=keep, start_s=1500.0, rate=8.0, tau_s=1000.0)
    assert r.durable(5000.0)[0] >= 0.0 and r.pend_t == math.inf and r.at(1500.0) == 0.0


# --- the state table ----------------------------------------------------------------------------------


def _job(world: World, jid: str = "j1", min_gpus: int = 2, max_gpus: int = 4, kind: str = "spot") -> SimJob:
    world.submit(JobSpec(jid, "a", kind, 0, min_gpus, max_gpus, 1e9, 0.0), 0.0)
    return world.jobs[jid]


def _world(**kw) -> tuple[World, list]:
    events: list = []
    cfg = make_config(serving_gpus=8, training_gpus=8, days=1, **kw)
    w = World(cfg, [Tenant("a", quota_gpus=8)], lambda *e: events.append(e), np.random.default_rng(0))
    return w, events


def test_every_transition_in_the_table_and_nothing_else():
    w, _ = _world()
    j = _job(w)
    assert j.state == PENDING
    states = {s for s, _ in TRANSITIONS} | set(TRANSITIONS.values())
    events = {e for _, e in TRANSITIONS}
    for s in states:
        for e in events:
            j.state = s
            if (s, e) in TRANSITIONS:
                transition(j, e)
                assert j.state == TRANSITIONS[(s, e)]
            else:
                with pytest.raises(IllegalTransition):
                    transition(j, e)
    assert (DONE, "admit") not in TRANSITIONS and (STOPPING, "preempt") not in TRANSITIONS


def test_illegal_decisions_raise():
    w, _ = _world()
    j = _job(w)
    with pytest.raises(IllegalTransition):  # a pending job cannot be preempted
        w.apply([Preempt("j1", "priority", 100.0)], 0.0)
    w.apply([Admit("j1", {"t0000": 4})], 0.0)
    assert j.state == RUNNING
    with pytest.raises(IllegalTransition):  # nor admitted twice
        w.apply([Admit("j1", {"t0000": 4})], 10.0)
    w.apply([Shrink("j1", 2, {"t0000": 2}, "demand", 200.0)], 10.0)
    assert j.state == SHRINKING
    with pytest.raises(IllegalTransition):  # a releasing job is never acted on again
        w.apply([Preempt("j1", "priority", 300.0)], 20.0)


def test_shrink_then_release_keeps_the_work_preempt_requeues():
    w, events = _world(restart_s=100.0)
    j = _job(w)
    w.apply([Admit("j1", {"t0000": 4})], 0.0)
    assert w.used["t0000"] == 4 and j.seg.t0 == 100.0
    w.apply([Shrink("j1", 2, {"t0000": 2}, "reclaim", 1000.0)], 500.0)
    assert any(e[1] == 0 and e[0] == 1000.0 for e in events)  # RELEASE at by_s
    p_stop = j.seg.at(1000.0 - w.stall)
    assert w.release("j1", 1000.0) == 0  # freed no serving GPUs
    assert j.state == RUNNING and j.job.gpus == 2 and w.used["t0000"] == 2
    assert j.seg.p0 == pytest.approx(p_stop) and j.seg.t0 == 1100.0 and j.lost_gpu_s == 0.0
    w.apply([Preempt("j1", "priority", 1142.0)], 1140.0)  # 2 s: too short for the 5 s final checkpoint
    assert j.state == STOPPING and not j.rel_ok
    durable = j.seg.durable(1142.0)[0]
    assert w.release("j1", 1142.0) is not None
    assert j.state == PENDING and j.job.gpus == 0 and w.used["t0000"] == 0
    assert j.kept_p == pytest.approx(durable) and j.lost_gpu_s > 0
    assert w.queues[("a", "spot", 0)][0].id == "j1"


def test_restart_full_makes_jobs_rigid():
    w, _ = _world(resize="restart-full")
    j = _job(w, min_gpus=2, max_gpus=8)
    assert j.job.min_gpus == j.job.max_gpus == 2


def test_durable_table_answers_exactly_what_each_segment_does():
    """The vectorised refresh (``DurableTable``) gives bit for bit the capture times and next times of
    ``Segment.durable`` and ``Segment.next_durable_s``, rows due only when their answer may have changed."""
    rng = np.random.default_rng(5)
    segs = {}
    for i in range(300):
        lag = float(rng.choice([0.0, 5.0, 300.0]))
        stop = float(rng.choice([math.inf, rng.uniform(0, 9000)]))
        pend = None if rng.random() < 0.5 else (float(rng.uniform(0, 3000)), float(rng.uniform(0, 900)),
                                                 float(rng.uniform(0, 800)))
        segs[f"j{i}"] = seg(
            t0=float(rng.uniform(0, 2000)),
            p0=float(rng.uniform(0, 500)),
            rate=float(rng.choice([1.0, 8.0, 64.0**0.9])),
            tau_s=float(rng.uniform(30, 3600)),
            stall_s=float(rng.choice([5.0, 10.0, 60.0])),
            lag_s=lag,
            stop_s=stop,
            dur_p=float(rng.uniform(0, 400)),
            dur_ct=float(rng.uniform(0, 100)),
            pend=pend,
        )
    end = 8000.0
    table = DurableTable(end)
    last = {k: math.nan for k in segs}
    for k, s in segs.items():
        table.set(k, s, s.next_durable_s(0.0))
    for k in list(segs)[::7]:  # some leave (a finished job) and one comes back with a new segment
        table.drop(k)
        del segs[k]
    segs["j0"] = seg(t0=50.0, tau_s=700.0, lag_s=300.0)
    table.set("j0", segs["j0"], segs["j0"].next_durable_s(0.0))
    rows = np.array(
        [
            [
                s.t0,
                s.p0,
                s.rate,
                s.tau,
                s.stall,
                s.lag,
                s.stop,
                s.dur_p,
                s.dur_ct,
                s.pend_t,
                s.pend_p,
                s.pend_ct,
            ]
            for s in segs.values()
        ]
    )
    for t in np.sort(rng.uniform(0, end, 60)).tolist():
        ct, nxt = durable_times_and_next(rows.T, t)
        for (k, s), c, n in zip(segs.items(), ct.tolist(), nxt.tolist(), strict=True):
            assert (c, n) == (s.durable(t)[1], s.next_durable_s(t)), (k, t)
        keys, cts = table.refresh(t)
        assert len(set(keys)) == len(keys) and set(keys) <= set(segs)
        for k, c in zip(keys, cts, strict=True):
            assert c == segs[k].durable(t)[1]
            last[k] = c
        for k, s in segs.items():  # a row not refreshed has not changed since it was
            if k not in keys and not math.isnan(last[k]):
                assert last[k] == s.durable(t)[1], (k, t)

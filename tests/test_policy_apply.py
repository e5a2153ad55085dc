"""tidal.policy.apply: the store's side of each decision, once; the simulator's World agrees with it."""

from __future__ import annotations

import numpy as np
import pytest

from sched_fixtures import nodes, pend, run, snap, tenants
from tidal.model import (
    Admit,
    Grow,
    Job,
    Loan,
    Preempt,
    Reclaim,
    ReturnGpus,
    SetCkptInterval,
    Shrink,
    Tenant,
    check_snapshot,
)
from tidal.policy.apply import IllegalDecision, apply
from tidal.sim.config import make_config
from tidal.sim.jobs import JobSpec
from tidal.sim.world import World

NOW = 1000.0


def jobs_of(s) -> dict:
    return {j.id: j for j in s.jobs()}


def test_each_decision():
    s = snap(NOW, nodes((8, 8), serving=(8,)), tenants(("a", 0)),
             [run("r", {"t0": 8}, max=16), run("v", {"t1": 4, "s0": 4}), pend("p", min=4), pend("w", min=4)],
             loans=[Loan("s0", 8, until_s=9e9, reclaim_risk_per_hour=0.5)],
             reclaims=[Reclaim(3, by_s=NOW + 900), Reclaim(2, by_s=NOW + 300)])
    out = apply(s, [Grow("r", 12, {"t1": 4}), Shrink("v", 4, {"s0": 4}, "reclaim", NOW + 120, for_job="w"),
                    SetCkptInterval("r", 60.0), ReturnGpus("s0", 4)])
    check_snapshot(out)
    j = jobs_of(out)
    assert (
        j["r"].placement == {"t0": 8, "t1": 4} and j["r"].last_grown_s == NOW and j["r"].ckpt_interval_s == 60
    )
    assert (
        j["v"].placement == {"t1": 4, "s0": 4}
        and j["v"].releasing == {"s0": 4}
        and j["v"].last_shrunk_s == NOW
    )
    assert j["w"].nominated_s == NOW and j["p"].nominated_s is None
    assert [[j.id for j in q] for q in out.queues.values()] == [["w", "p"]]  # nominated first
    assert out.loans == (Loan("s0", 4, until_s=9e9, reclaim_risk_per_hour=0.5),)
    assert out.reclaims == (Reclaim(1, by_s=NOW + 900),)  # the earliest reclaim is served first
    assert jobs_of(s)["r"].placement == {"t0": 8} and s.loans[0].gpus == 8  # the input is left alone

    out = apply(out, [Preempt("r", "priority", NOW + 30, for_job="p")])
    j = jobs_of(out)
    assert (
        j["r"].releasing == j["r"].placement and j["r"].last_preempted_s == NOW and j["p"].nominated_s == NOW
    )


def test_admit_clears_the_nomination():
    s = snap(NOW, nodes((8,)), tenants(("a", 0)), [pend("p", min=4, nominated_s=5.0)])
    j = jobs_of(apply(s, [Admit("p", {"t0": 4})]))["p"]
    assert j.placement == {"t0": 4} and j.started_s == NOW and j.nominated_s is None


@pytest.mark.parametrize("decision, match", [
    (Admit("r", {"t1": 4}), "already holds"),
    (Grow("r", 16, {"t1": 4}), "would hold 12"),
    (Shrink("x", 4, {"t0": 4}, "demand", NOW), "releasing 8"),
    (Preempt("x", "priority", NOW), "releasing 8"),
    (Shrink("r", 6, {"t0": 4}, "demand", NOW), "holds 8"),
    (ReturnGpus("s0", 2), "1 held by jobs"),
    (SetCkptInterval("p", 60.0), "not running"),
    (Admit("nobody", {"t1": 4}), "no job 'nobody'"),
])
def test_illegal_decisions_raise(decision, match):
    stopping = Job("x", "a", min_gpus=8, placement={"t1": 7, "s0": 1}, releasing={"t1": 7, "s0": 1})
    s = snap(
        NOW,
        nodes((8, 8), serving=(2,)),
        tenants(("a", 0)),
        [run("r", {"t0": 8}, max=16), stopping, pend("p")],
        loans=[Loan("s0", 2)],
    )
    with pytest.raises(IllegalDecision, match=match):
        apply(s, [decision])


def test_the_simulator_applies_the_same():
    """The World keeps queues and timelines of its own but changes each Job as apply does."""
    w = World(make_config(serving_gpus=8, training_gpus=16, days=1), [Tenant("a", quota_gpus=16)],
              lambda *e: None, np.random.default_rng(0))
    for jid, mn, mx in (("a", 4, 8), ("b", 4, 4), ("c", 8, 8)):
        w.submit(JobSpec(jid, "a", "spot", 0, mn, mx, 1e9, 0.0), 0.0)
    steps = [(0.0, [Admit("a", {"t0000": 4}), Admit("b", {"t0001": 4})]),
             (50.0, [Grow("a", 8, {"t0000": 4}), SetCkptInterval("b", 77.0)]),
             (100.0, [Shrink("a", 4, {"t0000": 4}, "demand", 400.0, for_job="c"),
                      Preempt("b", "priority", 400.0, for_job="c")])]
    for now, decisions in steps:
        want = jobs_of(apply(w.snapshot(now), decisions))
        w.apply(decisions, now)
        got = {jid: sj.job for jid, sj in w.jobs.items()}
        for jid in want:
            assert got[jid] == want[jid], jid


def test_lowered_keeps_every_field_of_a_reclaim():
    """``lowered`` makes the Reclaim it keeps directly (not by ``dataclasses.replace``): every other field
    must come through, and a new field of Reclaim must be added there."""
    from dataclasses import fields, replace

    from tidal.policy.apply import lowered

    r = Reclaim(5, by_s=NOW + 900, notice_s=NOW + 600, deadline_s=NOW + 1500)
    assert [f.name for f in fields(Reclaim)] == ["gpus", "by_s", "notice_s", "deadline_s"]
    assert lowered([Reclaim(2, by_s=NOW + 1000), r], 3) == [replace(r, gpus=2), Reclaim(2, by_s=NOW + 1000)]


def test_loan_and_reclaim_checks_name_the_field():
    with pytest.raises(ValueError, match="gpus must be >= 1, got 0"):
        Loan("s0", 0)
    with pytest.raises(ValueError, match="reclaim_risk_per_hour must be >= 0"):
        Loan("s0", 1, reclaim_risk_per_hour=-1.0)
    with pytest.raises(ValueError, match="reclaim_risk_per_hour must be >= 0"):
        Loan("s0", 1, reclaim_risk_per_hour=float("nan"))
    with pytest.raises(ValueError, match="gpus must be >= 1, got 0"):
        Reclaim(0, by_s=NOW)

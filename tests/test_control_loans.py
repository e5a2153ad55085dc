"""Live lending in the reconcile loop (tidal.control.loans) with the fake executor and a fake clock.

A replayed day of the shipped daily profile lends serving GPUs to elastic spot jobs and takes them
back. After every step: no GPU is held by a job on a serving node beyond what the ledger lends there,
the serving adapter has released exactly what the ledger lends (plus restores it still owes), and the
ledger's GPUs add up. A SIGKILL of the plane is a new controller on the same store mid-day.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

import tidal.serving
from control_fakes import FakeClock, FakeExecutor, new_store, submit
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.loans import DOC_KEY, LiveLoans
from tidal.control.states import HELD, State
from tidal.policy.loan import LoanTiming
from tidal.serving.adapters import AdapterError, ReplayAdapter
from tidal.serving.sources import TraceReplay
from tidal.serving.traces import load_trace

PROFILE = Path(tidal.serving.__file__).parent / "data" / "daily-profile.csv"
NODES = {"serve-0": 2, "serve-1": 2, "serve-2": 2, "serve-3": 2}
TIMING = LoanTiming(notice_s=4, final_checkpoint_s=4, release_s=1, warmup_s=4, restart_cost_s=4)
SPEEDUP = 300.0  # a day in 288 s
DAY = 86400.0


def _loans(fail=None, origin_s: float | None = None, start_h: float = 0.0,
           clients: bool = False) -> tuple[LiveLoans, ReplayAdapter]:
    trace = load_trace(PROFILE)
    start = 3 * DAY + start_h * 3600
    split = np.stack([0.4 * trace.load, 0.6 * trace.load], axis=1) if clients else None  # a client, the tail
    adapter = ReplayAdapter(TraceReplay(trace, sum(NODES.values()), start_s=0.0, clients=split), NODES,
                            speedup=SPEEDUP, start_s=start, origin_s=origin_s, fail=fail)
    loans = LiveLoans(adapter, TIMING, step_s=600.0, warm_history=adapter.history(start, 600.0))
    return loans, adapter


def _plane(tmp_path, clock, ex, store, fail=None, start_h: float = 0.0, clients: bool = False):
    loans, adapter = _loans(fail, origin_s=clock.t, start_h=start_h, clients=clients)
    cfg = ControlConfig()
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler,
                                                                 min_loan_left_s=TIMING.min_loan_window_s))
    return Controller(store, ex, cfg, loans=loans), adapter


def _check(ctl: Controller, adapter: ReplayAdapter) -> None:
    led = ctl.loans.ledger
    held: dict[str, int] = {}
    for j in ctl.store.jobs(states=HELD):
        for n, g in j.placement.items():
            held[n] = held.get(n, 0) + g
            assert j.kind == "spot" or n not in NODES, f"dedicated job {j.id} placed on serving node {n}"
    owed = ctl.loans.pending_restores
    for node, cap in NODES.items():
        assert held.get(node, 0) <= led.lent_on(node), (
            f"{node}: jobs hold {held.get(node)} of {led.lent_on(node)} lent"
        )
        assert adapter.released()[node] == led.lent_on(node) + owed.get(node, 0), node
        warming = sum(g for _, g in led.warming_ready_s(node))
        assert led.lent_on(node) + warming <= cap
    assert led.lent + led.warming + led.capacity == sum(NODES.values())


def _drive(ctl, ex, clock, rng, steps, adapter, stop_delay=1):
    """Step the plane; ranks beat, and exit 75 ``stop_delay`` steps after a notice."""
    told: dict[str, int] = {}
    for _ in range(steps):
        now = clock.advance(0.5)
        for jid, fj in list(ex.jobs.items()):
            if all(c is None for c in fj.codes):
                ex.beat(jid, now, int(now))
        for call in ex.calls:
            if call[0] == "stop" and call[1] in ex.jobs and call[1] not in told:
                told[call[1]] = stop_delay + rng.randint(0, 2)
        for jid in list(told):
            told[jid] -= 1
            if told[jid] <= 0:
                if jid in ex.jobs and any(c is None for c in ex.jobs[jid].codes):
                    ex.exit(jid, 75)
                del told[jid]
        ex.calls = [c for c in ex.calls if c[0] != "stop" or c[1] in told]
        ctl.step(now)
        _check(ctl, adapter)
        assert ctl.loans.stats["double_counted_steps"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("clients", [False, True])
def test_a_replayed_day_lends_reclaims_and_never_double_counts(tmp_path, clients):
    """Also with the demand per client: the policy's client model reads every step of it."""
    store = new_store(tmp_path, ("a", 0, 1.0), ("d", 2, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=2, serving=NODES)
    ctl, adapter = _plane(tmp_path, clock, ex, store, clients=clients)
    for i in range(3):
        submit(store, "a", clock.t, name=f"s{i}", kind="spot", gpus={"min": 1, "max": 4}, max_restarts=50)
    for i in range(2):  # dedicated jobs: never on a loan, whatever is lent
        submit(
            store, "d", clock.t, name=f"d{i}", kind="dedicated", gpus={"min": 1, "max": 2}, max_restarts=50
        )
    _drive(ctl, ex, clock, random.Random(1), int(DAY / SPEEDUP / 0.5), adapter)
    st = ctl.loans.stats
    assert st["lent_total_gpus"] > 0 and st["returned_gpus"] > 0, st
    assert st["reclaims_missed"] == 0 and min(ctl.loans.margins) >= 0, (st, ctl.loans.margins)
    assert st["used_gpu_s"] > 0
    kinds = {e.kind for e in store.events(limit=100000)}
    assert {"loan", "return"} <= kinds, kinds
    on_serving = [e for e in store.events(limit=100000) if e.kind == "launch"]
    assert on_serving
    seen = ctl.loans.state.clients
    assert (seen is not None and seen.n_obs > 100) == clients


@pytest.mark.slow
def test_a_restarted_plane_continues_the_same_loans_and_forecast(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=NODES)
    ctl, adapter = _plane(tmp_path, clock, ex, store)
    for i in range(3):
        submit(store, "a", clock.t, name=f"s{i}", kind="spot", gpus={"min": 1, "max": 4}, max_restarts=50)
    rng = random.Random(2)
    _drive(ctl, ex, clock, rng, 200, adapter)
    before = ctl.loans.dump()
    # SIGKILL: nothing in memory survives; the workers do (the executor re-adopts them)
    ex2 = FakeExecutor(gpus=1, serving=NODES)
    ex2.survivors = dict(ex.jobs)
    loans2, adapter2 = _loans()
    ctl2 = Controller(store, ex2, ctl.config, loans=loans2)
    assert loans2.ledger.to_state() == before["ledger"]
    assert adapter2.origin_s == adapter.origin_s and adapter2.released() == adapter.released()
    assert loans2.state.forecast.n_obs == ctl.loans.state.forecast.n_obs
    assert loans2.next_grid == ctl.loans.next_grid
    ctl2.recover(clock.t)
    _check(ctl2, adapter2)
    _drive(ctl2, ex2, clock, rng, 300, adapter2)
    assert ctl2.loans.stats["reclaims_missed"] == 0


@pytest.mark.slow
def test_a_refused_release_lends_nothing_and_a_refused_restore_is_retried(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=NODES)
    broken = {"release": True, "restore": True}
    ctl, adapter = _plane(tmp_path, clock, ex, store, fail=lambda action, node: broken[action])
    submit(store, "a", clock.t, name="s", kind="spot", gpus={"min": 1, "max": 4}, max_restarts=50)
    rng = random.Random(3)
    _drive(ctl, ex, clock, rng, 120, adapter)
    assert ctl.loans.ledger.lent == 0 and ctl.loans.stats["release_failures"] > 0
    assert not any(n in j.placement for j in store.jobs(states=HELD) for n in NODES)
    broken["release"] = False
    _drive(ctl, ex, clock, rng, 500, adapter)  # lends; the day's rise brings reclaims; restores fail
    st = ctl.loans.stats
    assert st["lent_total_gpus"] > 0 and st["returned_gpus"] > 0 and st["restore_failures"] > 0, st
    assert ctl.loans.pending_restores
    broken["restore"] = False
    _drive(ctl, ex, clock, rng, 4, adapter)
    assert not ctl.loans.pending_restores
    kinds = [e.kind for e in store.events(limit=100000)]
    assert "serving_action_failed" in kinds and "serving_restored" in kinds


def test_unknown_demand_lends_nothing_new(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=NODES)
    ctl, adapter = _plane(tmp_path, clock, ex, store)
    adapter.demand_gpus = lambda now_s: math.nan  # a metrics outage from the first step
    _drive(ctl, ex, clock, random.Random(4), 100, adapter)
    assert ctl.loans.ledger.lent == 0 and ctl.loans.stats["unknown_demand_steps"] > 0


def test_nonsense_demand_reads_as_unknown(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=NODES)
    ctl, adapter = _plane(tmp_path, clock, ex, store)
    adapter.demand_gpus = lambda now_s: -5.0
    _drive(ctl, ex, clock, random.Random(5), 40, adapter)
    assert ctl.loans.ledger.lent == 0 and ctl.loans.stats["unknown_demand_steps"] > 0


def test_the_executor_and_the_adapter_must_agree_on_serving_nodes(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    loans, _ = _loans()
    with pytest.raises(ValueError, match="serving nodes"):
        Controller(store, FakeExecutor(gpus=1, serving={"serve-0": 2}), loans=loans)


def test_adapter_refuses_impossible_moves():
    trace = load_trace(PROFILE)
    a = ReplayAdapter(TraceReplay(trace, 8, start_s=0.0), NODES)
    with pytest.raises(AdapterError, match="unknown serving node"):
        a.release("nope", 1, 1, 0.0)
    with pytest.raises(AdapterError, match="serve-0"):
        a.release("serve-0", 1, 3, 0.0)
    assert State.RUNNING  # the states module is importable with the loans module (no cycle)


def test_serving_keeps_the_gpus_no_spot_job_would_use(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=NODES)
    ctl, adapter = _plane(tmp_path, clock, ex, store)
    rng = random.Random(6)
    _drive(ctl, ex, clock, rng, 50, adapter)  # into the night (the plan lends from ~00:20): no spot job
    assert ctl.loans.ledger.lent == 0 and ctl.loans.view()["lendable_gpus"] == 0
    submit(store, "a", clock.t, name="s", kind="spot", gpus={"min": 1, "max": 3}, max_restarts=50)
    _drive(ctl, ex, clock, rng, 40, adapter)
    # one GPU on the training slot, at most two more on loans
    assert 0 < ctl.loans.ledger.lent <= 2, ctl.loans.ledger.lent


@pytest.mark.parametrize("damage", [
    lambda d: d.pop("ledger"),
    lambda d: d.update(policy={"__dc__": "ForecastState"}),
    lambda d: d.update(policy=[1, 2]),
    lambda d: d["ledger"].update(loans=[["serve-0", "two", None]]),
    lambda d: d.update(next_grid="soon"),
    lambda d: d.update(version=9),
    lambda d: d.update(releasing={"serve-0": 9}),  # more in flight than is lent there
    lambda d: d.update(restoring={"serve-0": "x"}),
    lambda d: d.update(gone={"serve-9": {"since_s": 1.0}}),  # not a serving node
    lambda d: d.update(gone={"serve-0": {"since_s": 1.0}}),  # lost and in the pool at once
    lambda d: d.update(returning={"serve-1": {"gpus": 7, "ready_s": 1.0}}),  # more GPUs than it has
])
@pytest.mark.slow
def test_a_damaged_serving_document_is_one_clear_error_and_changes_nothing(tmp_path, damage):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=NODES)
    ctl, adapter = _plane(tmp_path, clock, ex, store)
    _drive(ctl, ex, clock, random.Random(7), 4, adapter)
    doc = store.get_doc("serving")
    damage(doc)
    store.put_doc("serving", doc, clock.t)
    loans, _ = _loans()
    before = loans.dump()
    with pytest.raises(ValueError, match="serving document .* is damaged") as e:
        Controller(store, FakeExecutor(gpus=1, serving=NODES), ctl.config, loans=loans)
    assert "\n" not in str(e.value)
    assert loans.dump()["ledger"] == before["ledger"]


def test_a_loan_step_rebuilt_from_the_store_every_step_acts_as_one_that_never_stopped(tmp_path):
    """Everything the loan step needs is the stored document plus what it observes: a plane whose loan
    step is a new object loaded from the store before every step (a new adapter too) lends, reclaims
    and records exactly what a plane that kept one object all along does."""
    logs = []
    for rebuild in (False, True):
        (tmp_path / str(rebuild)).mkdir()
        store = new_store(tmp_path / str(rebuild), ("a", 0, 1.0), ("d", 2, 1.0))
        clock = FakeClock()
        ex = FakeExecutor(gpus=2, serving=NODES)
        ctl, adapter = _plane(tmp_path, clock, ex, store, start_h=4.0)  # the night's end and the rise
        for i in range(3):
            submit(store, "a", clock.t, name=f"s{i}", kind="spot", gpus={"min": 1, "max": 4}, max_restarts=50)
        submit(store, "d", clock.t, name="d0", kind="dedicated", gpus={"min": 1, "max": 2}, max_restarts=50)
        rng = random.Random(7)
        for _ in range(int(DAY / 4 / SPEEDUP / 0.5 / 20)):  # 04:00 to 10:00
            doc = store.get_doc(DOC_KEY)
            if rebuild and doc is not None:
                ctl.loans, adapter = _loans(start_h=4.0)
                ctl.loans.load(doc)
            _drive(ctl, ex, clock, rng, 20, adapter)
        events = [(e.kind, e.message) for e in store.events(limit=100000)]
        logs.append((events, ctl.loans.dump()["ledger"], ctl.loans.stats))
        store.close()
    assert logs[0][0] == logs[1][0]
    assert logs[0][1] == logs[1][1] and logs[0][2] == logs[1][2]
    assert {"loan", "return", "reclaim"} <= {k for k, _ in logs[0][0]}


@pytest.mark.slow
@pytest.mark.parametrize(("path", "value"), [
    (("stats", "lent_gpu_s"), {}), (("last_s",), {}), (("margins",), ["x"]),
    (("policy", "forecast", "level_gpus"), None), (("policy", "forecast", "profile_gpus"), 3),
    (("policy", "forecast", "n_obs"), "x"), (("policy", "forecast", "ctx_hist"), 0),
    (("policy", "shortfall_gpu_s"), None), (("ledger", "reclaims"), [[1]]),
])
def test_a_damaged_loan_document_is_refused_at_load_not_at_every_step(path, value):
    """A stored document with a wrong type inside (a flipped byte that still parses) loaded, then made
    every reconcile step fail: it is refused at start, naming the document, and nothing is changed."""
    loans, _ = _loans(origin_s=0.0)
    for i in range(300):
        loans.tick(i * 2.0, {}, None)
    doc = json.loads(json.dumps(loans.dump()))
    where = doc
    for k in path[:-1]:
        where = where[k]
    where[path[-1]] = value
    fresh, _ = _loans(origin_s=0.0)
    before = fresh.dump()
    with pytest.raises(ValueError, match="serving document .* is damaged"):
        fresh.load(doc)
    assert fresh.dump() == before

"""A serving node lost while it lends, and back (tidal.control.serving_nodes), in the reconcile loop with the
fake executor, a fake clock and the replay adapter (with a ``ready`` of the test's, at our seam).

After every step the pools add up over the nodes in the pool (a lost node is in neither), no job holds a
serving GPU beyond what is lent there, and the adapter's count per node is what the ledger lends there
plus restores owed plus the GPUs a node lacks. Attacks: the node lost with a spot job on it, during its
warm-up, twice in a row, back with fewer GPUs, a plane killed between the loss and the return.
"""

from __future__ import annotations

import dataclasses
import random

from control_fakes import FakeClock, FakeExecutor, new_store, submit
from test_control_loans import NODES, PROFILE, SPEEDUP, TIMING
from tidal.control import metrics
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.loans import LiveLoans
from tidal.control.states import HELD
from tidal.serving.adapters import ReplayAdapter
from tidal.serving.sources import TraceReplay
from tidal.serving.traces import load_trace

DAY = 86400.0


class ReadyReplay(ReplayAdapter):
    """The replay adapter with a ``ready(node)`` the test sets (a ReadyAdapter: Serve's replicas)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.not_ready: set[str] = set()

    def ready(self, node: str) -> bool:
        return node not in self.not_ready


def _plane(clock, ex, store) -> tuple[Controller, ReadyReplay]:
    trace = load_trace(PROFILE)
    adapter = ReadyReplay(TraceReplay(trace, sum(NODES.values()), start_s=0.0), NODES, speedup=SPEEDUP,
                          start_s=3 * DAY, origin_s=clock.t)
    loans = LiveLoans(adapter, TIMING, step_s=600.0, warm_history=adapter.history(3 * DAY, 600.0))
    cfg = ControlConfig()
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler,
                                                                 min_loan_left_s=TIMING.min_loan_window_s))
    return Controller(store, ex, cfg, loans=loans), adapter


def _check(ctl: Controller, adapter: ReplayAdapter) -> None:
    lo = ctl.loans
    led = lo.ledger
    held: dict[str, int] = {}
    for j in ctl.store.jobs(states=HELD):
        for n, g in j.placement.items():
            held[n] = held.get(n, 0) + g
    for node in led.cap:
        assert held.get(node, 0) <= led.lent_on(node), node
        lacks = NODES[node] - led.cap[node]
        assert adapter.released()[node] == led.lent_on(node) + lo.pending_restores.get(node, 0) + lacks, node
        assert led.lent_on(node) + sum(g for _, g in led.warming_ready_s(node)) <= led.cap[node]
    for node in lo.gone:
        assert node not in led.cap and not led.lent_on(node) and node not in lo.pending_restores
    assert set(led.cap) | set(lo.gone) | set(lo.returning) == set(NODES)
    assert led.lent + led.warming + led.capacity == led.total == sum(led.cap.values())
    assert sum(r.gpus for r in led.reclaims) <= led.lent
    assert lo.stats["double_counted_steps"] == 0


def _drive(ctl, ex, clock, steps, adapter, until=None) -> None:
    """Step the plane every 0.5 s: ranks beat and exit 75 a step after a notice; stop early once
    ``until(ctl)``."""
    for _ in range(steps):
        now = clock.advance(0.5)
        for jid, fj in list(ex.jobs.items()):
            if all(c is None for c in fj.codes):
                ex.beat(jid, now, int(now))
        for call in ex.calls:
            if call[0] == "stop" and call[1] in ex.jobs and any(c is None for c in ex.jobs[call[1]].codes):
                ex.exit(call[1], 75)
        ex.calls = [c for c in ex.calls if c[0] != "stop"]
        ctl.step(now)
        _check(ctl, adapter)
        if until is not None and until(ctl):
            return
    assert until is None, "the condition never held"


def _kinds(store, kind: str) -> list:
    return [e for e in store.events(limit=100000) if e.kind == kind]


def _returns(store, node: str) -> int:
    return sum(1 for e in _kinds(store, "return") if e.data["node"] == node)


def _lent_with_a_job(ctl) -> str | None:
    for j in ctl.store.jobs(states=HELD):
        for n in j.placement:
            if n in NODES and ctl.loans.lent_on(n) > 0:
                return n
    return None


def _setup(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving=dict(NODES))
    ctl, adapter = _plane(clock, ex, store)
    for i in range(2):
        submit(store, "a", clock.t, name=f"s{i}", kind="spot", gpus={"min": 1, "max": 4}, max_restarts=50)
    _drive(ctl, ex, clock, 400, adapter, until=lambda c: _lent_with_a_job(c) is not None)
    return store, clock, ex, ctl, adapter


def test_a_lent_serving_node_lost_ends_its_loans_and_serves_again_only_after_its_warm_up(tmp_path):
    store, clock, ex, ctl, adapter = _setup(tmp_path)
    node = _lent_with_a_job(ctl)
    lent = ctl.loans.lent_on(node)
    jobs = sorted(j.id for j in store.jobs(states=HELD) if node in j.placement)
    ex.lose_node(node)  # the Ray node removed: its ranks go with it
    _drive(ctl, ex, clock, 1, adapter)
    (ev,) = _kinds(store, "serving_node_lost")
    assert ev.data["node"] == node and ev.data["lent_gpus"] == lent and ev.data["jobs"] == jobs, ev.data
    assert "nothing is reclaimed from it" in ev.message and node in ev.message
    assert node in ctl.loans.gone and node not in ctl.loans.ledger.cap
    assert ctl.loans.serving_gpus == sum(NODES.values()) - NODES[node]
    text = metrics.render(metrics.registry(store, ctl.nodes, clock, loans=ctl.loans)).decode()
    assert f"tidal_serving_pool_gpus {float(ctl.loans.serving_gpus)}" in text
    assert "tidal_serving_node_losses_total 1.0" in text
    assert not _kinds(store, "return") or all(e.data["node"] != node for e in _kinds(store, "return"))
    # a reclaim in flight when it went: its ReturnGpus (had the scheduler sent one) gives nothing back
    events = ctl.loans.returned(node, 1, clock.t)
    assert [e[0] for e in events] == ["decision"] and "lost" in events[0][1]
    assert ctl.loans.stats["returned_gpus"] == sum(e.data["gpus"] for e in _kinds(store, "return"))
    _drive(ctl, ex, clock, 40, adapter)  # the jobs recover like any node loss, on the rest
    assert all(node not in j.placement for j in store.jobs(states=HELD))
    assert {e.job_id for e in _kinds(store, "node_lost")} == set(jobs)
    assert ctl.loans.stats["reclaims_missed"] == 0
    # back: not in the pool before its warm-up is over and the adapter says ready
    adapter.not_ready.add(node)
    ex.serving[node] = NODES[node]
    _drive(ctl, ex, clock, 1, adapter)
    (back,) = _kinds(store, "serving_node_back")
    assert back.data["node"] == node and node in ctl.loans.returning
    assert adapter.released()[node] == 0  # told: serve with all of it
    ready_s = ctl.loans.returning[node]["ready_s"]
    _drive(ctl, ex, clock, int((ready_s - clock.t) / 0.5) + 4, adapter)
    assert node in ctl.loans.returning and node not in ctl.loans.ledger.cap  # warm-up over, not ready
    adapter.not_ready.discard(node)
    _drive(ctl, ex, clock, 1, adapter)
    assert node in ctl.loans.ledger.cap and ctl.loans.serving_gpus == sum(NODES.values())
    assert any(e.data.get("rejoined") and e.data["node"] == node for e in _kinds(store, "serving_ready"))
    # and lendable again: the night goes on lending, on it too once the plan asks for more
    _drive(ctl, ex, clock, 400, adapter, until=lambda c: c.loans.lent_on(node) > 0)
    # lost again with a reclaim in flight there (a burst: every lent GPU due back): nothing owed from it
    adapter.demand_gpus = lambda now_s: float(sum(NODES.values()))
    _drive(ctl, ex, clock, 40, adapter, until=lambda c: any(r.due(clock.t) for r in c.loans.ledger.reclaims))
    assert ctl.loans.lent_on(node) > 0
    missed, returns = ctl.loans.stats["reclaims_missed"], _returns(store, node)
    ex.lose_node(node)
    _drive(ctl, ex, clock, 10, adapter)
    assert len(_kinds(store, "serving_node_lost")) == 2 and ctl.loans.stats["reclaims_missed"] == missed
    assert _returns(store, node) == returns and not ctl.loans.ledger.reclaims


def test_lost_during_its_warm_up_twice_in_a_row_back_with_fewer_gpus_and_at_random(tmp_path):
    store, clock, ex, ctl, adapter = _setup(tmp_path)
    node = _lent_with_a_job(ctl)
    ex.lose_node(node)
    _drive(ctl, ex, clock, 2, adapter)
    ex.serving[node] = NODES[node]
    _drive(ctl, ex, clock, 1, adapter)
    assert node in ctl.loans.returning
    ex.serving.pop(node)  # lost again during its warm-up
    _drive(ctl, ex, clock, 1, adapter)
    lost = _kinds(store, "serving_node_lost")
    assert len(lost) == 2 and any("during its warm-up" in e.message for e in lost)
    assert node in ctl.loans.gone and node not in ctl.loans.returning
    ex.serving[node] = NODES[node] - 1  # back with one GPU fewer
    _drive(ctl, ex, clock, 1, adapter)
    assert ctl.loans.returning[node]["gpus"] == NODES[node] - 1
    assert adapter.released()[node] == 1  # the adapter counts the missing GPU as not serving
    _drive(ctl, ex, clock, 200, adapter, until=lambda c: node in c.loans.ledger.cap)
    assert ctl.loans.ledger.cap[node] == NODES[node] - 1
    assert ctl.loans.serving_gpus == sum(NODES.values()) - 1
    ex.lose_node(node)  # and lost once more, now from the pool
    _drive(ctl, ex, clock, 1, adapter)
    assert len(_kinds(store, "serving_node_lost")) == 3 and node not in ctl.loans.ledger.cap
    rng = random.Random(11)  # then nodes lost and back at random: the checks of every step hold
    for _ in range(6):
        node = rng.choice(sorted(NODES))
        if node in ex.serving:
            ex.lose_node(node)
        else:
            ex.serving[node] = rng.choice([NODES[node], NODES[node] - 1, NODES[node] + 1])
        _drive(ctl, ex, clock, rng.randint(1, 8), adapter)
    ex.serving.update(NODES)
    _drive(ctl, ex, clock, 300, adapter, until=lambda c: not c.loans.gone and not c.loans.returning)
    # back with other GPUs between two steps (never seen gone): lost and back at once
    node = sorted(NODES)[1]
    ex.serving[node] = NODES[node] - 1
    _drive(ctl, ex, clock, 1, adapter)
    assert node in ctl.loans.returning and ctl.loans.returning[node]["gpus"] == NODES[node] - 1
    assert [e.data["node"] for e in _kinds(store, "serving_node_back")][-1] == node


def test_a_plane_killed_between_the_loss_and_the_return_continues(tmp_path):
    store, clock, ex, ctl, adapter = _setup(tmp_path)
    node = _lent_with_a_job(ctl)
    ex.lose_node(node)
    _drive(ctl, ex, clock, 1, adapter)
    # SIGKILL: a new plane on the same store; the node is still missing from the cluster
    ex2 = FakeExecutor(gpus=1, serving={n: g for n, g in NODES.items() if n != node})
    ex2.survivors = dict(ex.jobs)
    ctl2, adapter2 = _plane(clock, ex2, store)
    assert node in ctl2.loans.gone and node not in ctl2.loans.ledger.cap
    ctl2.recover(clock.t)
    _drive(ctl2, ex2, clock, 4, adapter2)
    assert len(_kinds(store, "serving_node_lost")) == 1  # not lost a second time
    ex2.serving[node] = NODES[node]
    _drive(ctl2, ex2, clock, 1, adapter2)
    assert node in ctl2.loans.returning
    doc = store.get_doc("serving")
    assert doc["returning"][node]["told"] is True
    # killed again during the warm-up: the third plane rejoins it
    ex3 = FakeExecutor(gpus=1, serving=dict(NODES))
    ex3.survivors = dict(ex2.jobs)
    ctl3, adapter3 = _plane(clock, ex3, store)
    assert node in ctl3.loans.returning
    ctl3.recover(clock.t)
    _drive(ctl3, ex3, clock, 200, adapter3, until=lambda c: node in c.loans.ledger.cap)


def test_a_missing_serving_node_at_a_fresh_start_is_still_an_error(tmp_path):
    store = new_store(tmp_path, ("a", 0, 1.0))
    clock = FakeClock()
    ex = FakeExecutor(gpus=1, serving={n: g for n, g in NODES.items() if n != "serve-0"})
    try:
        _plane(clock, ex, store)
    except ValueError as e:
        assert "serving nodes" in str(e)
    else:
        raise AssertionError("a fresh plane started without one of its serving nodes")

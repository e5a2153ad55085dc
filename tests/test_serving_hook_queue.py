"""The operator's hook never holds up the loan step: a real webhook and Prometheus on loopback that hold
their answers until the test lets them go (an Event), so "the step returned before the hook answered"
is a fact, not a timing. GPUs are lent only after the hook said yes, a refused release lends nothing,
a restore that hangs keeps the GPUs out of serving until a retry succeeds, and a plane killed while
an action is in flight sends it again."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.control.loans import LiveLoans
from tidal.policy.loan import LoanTiming
from tidal.serving.adapters import HookAdapter
from tidal.serving.sources import PrometheusQuery

NODES = {"serve-0": 4, "serve-1": 4}
TIMING = LoanTiming(notice_s=10, final_checkpoint_s=5, release_s=5, warmup_s=10, restart_cost_s=10)
T0 = 1_000_000.0


class _Hook:
    """Prometheus (demand 2 of 8) and the webhook. Each POST waits for ``open`` (set: answer at once),
    answers the next of ``codes`` (200 when none left) and then records it in ``answered``."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.prom_open = threading.Event()
        self.prom_open.set()
        self.codes: list[int] = []
        self.posts: list[dict] = []
        self.answered: list[tuple[str, int]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.prom_open.wait(30)
                self._send(200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {}, "value": [time.time(), "2"]}]}}).encode())

            def do_POST(self) -> None:  # noqa: N802
                doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                outer.posts.append(doc)
                outer.open.wait(30)
                code = outer.codes.pop(0) if outer.codes else 200
                if self._send(code, b"{}"):
                    outer.answered.append((doc["action"], code))

            def _send(self, code: int, body: bytes) -> bool:
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return True
                except OSError:  # the client gave up
                    return False

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def adapter(self, **kw: float) -> HookAdapter:
        return HookAdapter(PrometheusQuery(self.url, "sum(x)", timeout_s=20), NODES, url=self.url + "/hook",
                           **{"timeout_s": 20, "attempts": 1, "retry_wait_s": 0, **kw})

    def close(self) -> None:
        self.open.set()
        self.prom_open.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = _Hook()
    yield h
    h.close()


def _until_queued(loans: LiveLoans, t: float = T0) -> tuple[float, list]:
    """Step every ``step_s`` until a release is in flight; (time, events)."""
    events: list = []
    for _ in range(100):
        events += loans.tick(t, {})
        if loans.releasing:
            return t, events
        t += loans.step_s
    raise AssertionError("the plan never lent with steady low demand")


def _assert_pools(loans: LiveLoans) -> None:
    led = loans.ledger
    assert loans.lent + sum(loans.releasing.values()) + led.warming + led.capacity == sum(NODES.values())
    assert sum(ln.gpus for ln in loans.loans) == loans.lent


def test_a_hanging_release_never_holds_up_the_step_and_lends_only_after_the_hook_said_yes(hook):
    hook.open.clear()
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=60.0)
    t, _ = _until_queued(loans)
    node, gpus = next(iter(loans.releasing.items()))
    for _ in range(29):  # the hook holds its answer to the first: the steps go on, nothing is lent
        t += 60.0
        loans.tick(t, {})
        _assert_pools(loans)
    assert hook.answered == [] and len(hook.posts) == 1
    assert 1 <= a.queued <= len(NODES)  # more may queue behind it, one release in flight per node
    assert loans.lent == 0 and not loans.loans and not loans.reclaims
    assert sum(loans.releasing.values()) == loans.ledger.lent
    assert loans.ledger.capacity == sum(NODES.values()) - loans.ledger.lent  # not serving either
    assert loans.stats["steps"] >= 29
    hook.open.set()
    assert a.settle(10) and hook.answered == [("release", 200)] * len(hook.posts)
    events = loans.tick(t + 1.0, {})
    assert ("loan", node, gpus) in {(e[0], e[2]["node"], e[2]["gpus"]) for e in events if e[2]}
    assert loans.lent_on(node) >= gpus and {ln.node for ln in loans.loans} >= {node}
    assert loans.lent == loans.ledger.lent and a.health()["released"][node] >= gpus
    _assert_pools(loans)


def test_a_release_the_hook_refuses_lends_nothing(hook):
    hook.codes = [500]
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=60.0)
    t, _ = _until_queued(loans)
    assert a.settle(10) and hook.answered == [("release", 500)]
    events = loans.tick(t + 1.0, {})
    failed = [e for e in events if e[0] == "serving_action_failed"]
    assert failed and "HTTP 500" in failed[0][1] and failed[0][2]["action"] == "release"
    assert loans.lent == 0 and loans.ledger.lent == 0 and not loans.releasing
    assert loans.stats["release_failures"] == 1 and loans.ledger.capacity == sum(NODES.values())
    assert a.health()["released"] == {"serve-0": 0, "serve-1": 0}


def test_a_hanging_restore_keeps_the_gpus_out_of_serving_until_a_retry_succeeds(hook):
    a = hook.adapter(timeout_s=0.5)
    loans = LiveLoans(a, TIMING, step_s=600.0)  # no plan (that could lend them again) in what follows
    t, _ = _until_queued(loans)
    assert a.settle(10)
    loans.tick(t + 1.0, {})
    node = loans.loans[0].node
    hook.open.clear()  # the restore hangs past the adapter's timeout: it fails, and is owed
    loans.returned(node, 1, t + 2.0)
    assert loans.restoring == {node: 1}
    assert a.settle(10)
    events = loans.tick(t + 3.0, {})
    assert any(e[0] == "serving_action_failed" and e[2]["action"] == "restore" for e in events)
    # the retry was queued in that step and hangs too; past the warm-up (15 s) they still do not serve
    assert loans.restoring == {node: 1} or loans.pending_restores == {node: 1}
    warm = loans.ledger.warming
    assert warm >= 1
    for k in range(3):
        events = loans.tick(t + 20.0 + k, {})
        assert loans.ledger.warming == warm and "serving_ready" not in {e[0] for e in events}
        _assert_pools(loans)
        a.settle(10)
    hook.open.set()  # the next attempt succeeds
    done: list = []
    for k in range(100):
        done += loans.tick(t + 30.0 + k * 0.1, {})
        if any(e[0] == "serving_ready" for e in done):
            break
        a.settle(10)
    kinds = [e[0] for e in done]
    assert "serving_restored" in kinds and "serving_ready" in kinds, kinds
    assert kinds.index("serving_restored") < kinds.index("serving_ready")
    assert not loans.restoring and not loans.pending_restores and loans.ledger.warming == warm - 1
    assert ("restore", 200) in hook.answered


def test_a_plane_killed_while_a_release_is_in_flight_sends_it_again(hook):
    hook.open.clear()
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=60.0)
    t, _ = _until_queued(loans)
    doc = json.loads(json.dumps(loans.dump()))  # what the store holds when the plane is SIGKILLed now
    node, gpus = next(iter(loans.releasing.items()))
    # a new plane: the old one's answer never reaches it
    a2 = hook.adapter()
    loans2 = LiveLoans(a2, TIMING, step_s=60.0)
    loans2.load(doc)
    assert loans2.releasing == {node: gpus} and loans2.lent == 0 and not loans2.loans
    loans2.tick(t + 1.0, {})  # sent again
    assert loans2.releasing == {node: gpus} and a2.queued == 1 and loans2.lent == 0
    hook.open.set()
    assert a2.settle(10)
    events = loans2.tick(t + 2.0, {})
    assert any(e[0] == "loan" for e in events) and loans2.lent_on(node) >= gpus
    assert a2.health()["released"][node] == gpus
    first, again = (p for p in hook.posts if p["node"] == node and p["action"] == "release")
    assert first == again  # the same lent_after: the hook sets a count, so the repeat is harmless
    _assert_pools(loans2)


def test_a_slow_prometheus_is_unknown_demand_and_its_late_answer_is_kept(hook):
    hook.prom_open.clear()
    a = hook.adapter(demand_max_age_s=60)
    assert math.isnan(a.demand_gpus(T0))  # waited demand_wait_s, not the query's timeout
    hook.prom_open.set()
    assert a.demand.fetching is not None
    a.demand.fetching.join(10)
    hook.prom_open.clear()  # the next query hangs: the late answer, 30 s old, stands in
    assert a.demand_gpus(T0 + 30) == 2.0
    assert math.isnan(a.demand_gpus(T0 + 120))  # too old


def test_a_plane_killed_while_a_restore_is_in_flight_sends_it_again_before_serving(hook):
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=600.0)
    t, _ = _until_queued(loans)
    assert a.settle(10)
    loans.tick(t + 1.0, {})
    node = loans.loans[0].node
    hook.open.clear()
    loans.returned(node, 1, t + 2.0)
    doc = json.loads(json.dumps(loans.dump()))
    a2 = hook.adapter()
    loans2 = LiveLoans(a2, TIMING, step_s=600.0)
    loans2.load(doc)
    assert loans2.restoring == {node: 1}
    warm = loans2.ledger.warming
    events = loans2.tick(t + 30.0, {})  # past the warm-up: sent again, and not serving before it succeeded
    assert a2.queued == 1 and loans2.ledger.warming == warm and "serving_ready" not in {e[0] for e in events}
    hook.open.set()
    assert a2.settle(10)
    kinds = [e[0] for e in loans2.tick(t + 31.0, {})]
    assert kinds == ["serving_restored", "serving_ready"] and loans2.ledger.warming == warm - 1
    assert a2.health()["released"][node] == loans2.ledger.lent_on(node)
    restores = [p for p in hook.posts if p["action"] == "restore"]
    assert len(restores) == 2 and restores[0] == restores[1]


def test_one_release_in_flight_per_node(hook):
    """A second release on a node waits for the first's outcome, so every ``lent_after`` the hook gets
    holds whatever the first's outcome is."""
    hook.open.clear()
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=60.0)
    t = T0
    for _ in range(100):  # spot jobs could use one GPU: one is lent
        loans.tick(t, {}, wanted=1)
        if loans.releasing:
            break
        t += 60.0
    assert loans.releasing == {"serve-0": 1}
    for k in range(1, 4):  # now they could use more: nothing more is lent on serve-0 meanwhile
        loans.tick(t + 60.0 * k, {}, wanted=2)
        assert loans.releasing == {"serve-0": 1} and loans.ledger.lent_on("serve-0") == 1
    hook.open.set()
    assert a.settle(10)
    loans.tick(t + 241.0, {}, wanted=2)
    assert loans.lent == 1
    for k in range(1, 4):
        loans.tick(t + 241.0 + 60.0 * k, {}, wanted=2)
        assert a.settle(10)
    assert loans.ledger.lent_on("serve-0") == 2 and [p["lent_after"] for p in hook.posts] == [1, 2]


def test_a_release_that_fails_after_a_queued_restore_leaves_the_hook_at_the_true_count(hook):
    """serve-0 has 1 GPU lent (confirmed); a second is released (the hook holds its answer), then the job
    hands the first back: the restore is queued behind the release with ``lent_after`` = 1, which
    assumed the release would succeed. It fails: serve-0 has 0 lent, so the hook is told so again (a
    corrective restore of the GPU whose release failed); before, it was left at 1, one GPU serving
    nobody and counted as serving."""
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=60.0)
    t = T0
    for _ in range(100):
        loans.tick(t, {}, wanted=1)
        if loans.releasing:
            break
        t += 60.0
    assert a.settle(10)
    loans.tick(t + 1.0, {}, wanted=1)
    assert loans.lent_on("serve-0") == 1 and not loans.releasing
    hook.open.clear()
    hook.codes = [500]  # the next POST (the release) is refused
    t += 60.0
    loans.tick(t, {"serve-0": 1}, wanted=1)  # one more could be used: serve-0 (partly lent) first
    assert loans.releasing == {"serve-0": 1}
    loans.returned("serve-0", 1, t + 1.0)  # the job hands back the confirmed one
    assert [p["action"] for p in hook.posts] == ["release", "release"] or a.queued == 2
    hook.open.set()
    for k in range(20):
        assert a.settle(10)
        events = loans.tick(t + 2.0 + k, {}, wanted=0)
        assert loans.lent_on("serve-0") == 0 or k == 0
        _assert_pools(loans)
        if not a.queued and not loans.restoring and not loans.pending_restores:
            break
    assert ("release", 500) in hook.answered
    assert [p["lent_after"] for p in hook.posts if p["node"] == "serve-0"][-1] == 0, hook.posts
    assert a.health()["released"]["serve-0"] == 0 == loans.ledger.lent_on("serve-0")
    assert loans.stats["release_failures"] == 1 and events is not None


def test_a_node_lost_with_a_release_in_flight_lends_nothing_and_is_told_when_it_is_back(hook):
    """The hook's answer to a release sent before the node was lost is ignored (nothing is lent on a
    node that is gone); back, the node gets a restore with its GPUs and serves only once the hook said
    yes and its warm-up is over."""
    hook.open.clear()
    a = hook.adapter()
    loans = LiveLoans(a, TIMING, step_s=60.0)
    t, _ = _until_queued(loans)
    node = next(iter(loans.releasing))
    rest = {n: g for n, g in NODES.items() if n != node}
    events = loans.tick(t + 1.0, {}, present=rest)
    (lost,) = [e for e in events if e[0] == "serving_node_lost"]
    assert lost[2]["node"] == node and lost[2]["releasing"] >= 1
    assert node not in loans.releasing and loans.serving_gpus == sum(rest.values())
    hook.open.set()
    assert a.settle(10)
    events = loans.tick(t + 2.0, {}, present=rest)
    assert not [e for e in events if e[0] == "loan" and e[2]["node"] == node]
    assert loans.lent_on(node) == 0 and node not in loans.ledger.cap
    events = loans.tick(t + 3.0, {}, present=NODES)  # back: the restore is queued at once
    assert [e[0] for e in events if e[0].startswith("serving_node")] == ["serving_node_back"]
    assert loans.returning[node]["told"] is False and a.queued >= 1
    assert a.settle(10)
    events = loans.tick(t + 4.0, {}, present=NODES)
    assert ("serving_restored", node) in {(e[0], e[2]["node"]) for e in events if e[2]}
    assert hook.posts[-1] == {"action": "restore", "node": node, "gpus": NODES[node], "lent_after": 0}
    assert node in loans.returning  # warm-up not over (release_s + warmup_s = 15 s)
    events = loans.tick(t + 3.0 + 15.0, {}, present=NODES)
    assert any(e[0] == "serving_ready" and e[2].get("rejoined") for e in events)
    assert node in loans.ledger.cap and loans.serving_gpus == sum(NODES.values())
    _assert_pools(loans)

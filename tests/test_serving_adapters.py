"""Serving adapters against real servers on loopback: Prometheus for demand, a webhook or a command for
the actions. A webhook that fails, answers garbage or hangs never makes the plane lend more."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.control.loans import LiveLoans
from tidal.policy.loan import LoanTiming
from tidal.serving.adapters import AdapterError, HookAdapter, parse_nodes
from tidal.serving.sources import PrometheusQuery

NODES = {"serve-0": 4, "serve-1": 4}
TIMING = LoanTiming(notice_s=10, final_checkpoint_s=5, release_s=5, warmup_s=10, restart_cost_s=10)


class _Server:
    """Answers Prometheus queries (``demand``) and webhook POSTs (``mode``: ok, fail, hang, garbage)."""

    def __init__(self) -> None:
        self.demand: float | None = 2.0
        self.series: list[dict] | None = None  # a grouped answer instead of ``demand``
        self.mode = "ok"
        self.posts: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if outer.series is not None:
                    body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                                     "result": outer.series}}).encode()
                elif outer.demand is None:
                    body = json.dumps({"status": "error", "error": "down"}).encode()
                else:
                    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                        {"metric": {}, "value": [time.time(), str(outer.demand)]}]}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                doc = json.loads(self.rfile.read(n))
                if outer.mode == "hang":
                    time.sleep(3)
                outer.posts.append(doc)
                code = 500 if outer.mode == "fail" else 200
                body = b"{" if outer.mode == "garbage" else b"{}"
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up (the hang case)
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def srv():
    s = _Server()
    yield s
    s.close()


def _loans(adapter) -> LiveLoans:
    return LiveLoans(adapter, TIMING, step_s=60.0)


def test_webhook_release_and_restore_carry_node_gpus_and_the_total(srv):
    a = HookAdapter(
        PrometheusQuery(srv.url, "sum(x)"), NODES, url=srv.url + "/hook", timeout_s=1, retry_wait_s=0
    )
    a.release("serve-0", 2, 2, 0.0)
    a.restore("serve-0", 1, 1, 0.0)
    assert a.health()["released"] == {"serve-0": 0, "serve-1": 0}  # counted once done() reports them
    assert a.settle(10)
    assert [(d.action, d.error) for d in a.done()] == [("release", None), ("restore", None)]
    assert srv.posts == [{"action": "release", "node": "serve-0", "gpus": 2, "lent_after": 2},
                         {"action": "restore", "node": "serve-0", "gpus": 1, "lent_after": 1}]
    assert a.health()["released"] == {"serve-0": 1, "serve-1": 0}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_a_failing_or_hanging_webhook_lends_nothing(srv, mode):
    srv.mode = mode
    a = HookAdapter(
        PrometheusQuery(srv.url, "sum(x)"),
        NODES,
        url=srv.url + "/hook",
        timeout_s=0.5,
        attempts=2,
        retry_wait_s=0,
    )
    loans = _loans(a)
    t = 1_000_000.0
    kinds = set()
    for k in range(200):  # demand 2 of 8: the plan wants to lend; every release fails
        kinds |= {e[0] for e in loans.tick(t + 60.0 * k, {})}
        assert loans.lent == 0 and not loans.loans
        assert a.settle(10)
        if loans.stats["release_failures"] >= 3:
            break
    assert loans.stats["release_failures"] >= 3 and "serving_action_failed" in kinds
    assert a.health()["last_error"] and a.health()["released"] == {"serve-0": 0, "serve-1": 0}


def test_prometheus_outage_lends_nothing_new_and_holds_what_is_lent(srv):
    a = HookAdapter(
        PrometheusQuery(srv.url, "sum(x)", timeout_s=1), NODES, url=srv.url + "/hook", timeout_s=1
    )
    loans = _loans(a)
    t = 1_000_000.0
    k = 0
    while loans.lent == 0 and k < 200:
        loans.tick(t + 60.0 * k, {})
        assert a.settle(10)
        k += 1
    lent = loans.ledger.lent  # with releases still in flight
    assert lent > 0, "the plan never lent with steady low demand"
    srv.demand = None  # Prometheus answers "status": "error"
    for j in range(k, k + 30):
        loans.tick(t + 60.0 * j, {})
        assert loans.ledger.lent <= lent and loans.lent <= lent
    assert loans.stats["unknown_demand_steps"] >= 30


def test_command_actions(tmp_path):
    log = tmp_path / "actions.log"
    script = (
        "import os,sys; open(sys.argv[1],'a').write(' '.join(os.environ['TIDAL_SERVING_' + k] "
        "for k in ('ACTION','NODE','GPUS','LENT_AFTER')) + '\\n'); sys.exit(int(os.environ.get('FAIL','0')))"
    )
    a = HookAdapter(
        PrometheusQuery("http://127.0.0.1:9", "x"),
        NODES,
        command=[sys.executable, "-c", script, str(log)],
        timeout_s=10,
    )
    a.release("serve-1", 3, 3, 0.0)
    assert a.settle(20) and [d.error for d in a.done()] == [None]
    assert log.read_text() == "release serve-1 3 3\n"
    slow = HookAdapter(
        PrometheusQuery("http://127.0.0.1:9", "x"),
        NODES,
        command=[sys.executable, "-c", "import time; time.sleep(5)"],
        timeout_s=0.3,
        attempts=1,
    )
    slow.release("serve-0", 1, 1, 0.0)
    assert slow.settle(20)
    assert "timed out" in (slow.done()[0].error or "") and slow.health()["released"]["serve-0"] == 0
    with pytest.raises(AdapterError, match="cannot move"):  # refused before it is queued
        slow.release("serve-0", 1, 9, 0.0)
    assert math.isnan(a.demand_gpus(0.0))  # nothing listens on port 9: unknown, never zero


def test_a_command_that_leaves_a_server_running_succeeds_once(tmp_path):
    """A restore hook that starts a serving process in the background and exits 0 (``vllm serve ... &``).
    The hook's output was read through pipes, so the adapter waited for the background process to close
    them: the action was reported as timed out and run again, starting a second server. Now: one run,
    success, the background process left running; on a timeout the hook's process group is killed."""
    runs, pids = tmp_path / "runs", tmp_path / "pids"
    script = (f"echo run >> {runs}; sleep 60 & echo $! >> {pids}; echo started; echo to stderr >&2; exit 0")
    a = HookAdapter(PrometheusQuery("http://127.0.0.1:9", "x"), NODES, command=["sh", "-c", script],
                    timeout_s=5, attempts=2)
    started = []
    try:
        a.release("serve-1", 3, 3, 0.0)
        assert a.settle(30)
        assert [d.error for d in a.done()] == [None]
        assert runs.read_text() == "run\n"  # once, not retried
        started = [int(x) for x in pids.read_text().split()]
        assert len(started) == 1
        os.kill(started[0], 0)  # the server it started still runs
        hang = HookAdapter(PrometheusQuery("http://127.0.0.1:9", "x"), NODES, timeout_s=0.5, attempts=1,
                           command=["sh", "-c", f"sleep 60 & echo $! >> {pids}; wait"])
        hang.release("serve-0", 1, 1, 0.0)
        assert hang.settle(30) and "timed out" in (hang.done()[0].error or "")
        child = int(pids.read_text().split()[-1])
        for _ in range(200):  # killed with the hook's process group (reaped by init or the test runner)
            try:
                with open(f"/proc/{child}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the timed-out hook's background process {child} still runs")
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_adapter_and_nodes_refuse_bad_settings():
    with pytest.raises(ValueError, match="exactly one"):
        HookAdapter(PrometheusQuery("http://x:1", "q"), NODES)
    with pytest.raises(ValueError, match="http"):
        HookAdapter(PrometheusQuery("http://x:1", "q"), NODES, url="file:///etc/passwd")
    assert parse_nodes("2x4") == {"serve-0": 4, "serve-1": 4}
    assert parse_nodes("1,2") == {"serve-0": 1, "serve-1": 2}
    for bad in ("0x4", "2x0", "x", "a,b", {"n": 0}, {"n": True}):
        with pytest.raises(ValueError, match="serving nodes"):
            parse_nodes(bad)


def test_prometheus_grouped_by_client_label_is_bounded(srv, caplog):
    """Per-client demand from a query grouped by a configurable label: a stable column per client, a
    series without the label and the clients past the cap in the tail; the total is their sum."""
    q = PrometheusQuery(srv.url, "sum by (tenant) (rate(requests_total[5m]))", gpus_per_unit=0.5,
                        client_label="tenant", max_clients=2)
    srv.series = [{"metric": {"tenant": "a"}, "value": [0, "4"]},
                  {"metric": {"tenant": "b"}, "value": [0, "2"]}, {"metric": {}, "value": [0, "1"]}]
    assert q.client_gpus(100.0).tolist() == [2.0, 1.0, 0.5]
    assert q.demand_gpus(100.0) == 3.5
    srv.series = [{"metric": {"tenant": f"t{i}"}, "value": [0, "1"]} for i in range(10_000)]
    srv.series += [{"metric": {"tenant": "b"}, "value": [0, "6"]}]
    got = q.client_gpus(200.0)
    assert got.tolist() == [0.0, 3.0, 5000.0] and len(q._columns) == 2  # a and b keep theirs
    srv.series = [{"metric": {"tenant": "a"}, "value": [0, "-1"]}]
    assert q.client_gpus(300.0) is None and math.isnan(q.demand_gpus(300.0))
    assert "not a finite number >= 0" in caplog.text
    assert PrometheusQuery(srv.url, "sum(x)").client_gpus(1.0) is None
    from tidal.serving.requests import RequestModel

    model = RequestModel(service_rate_per_replica=1.0, latency_target_s=0.5)
    srv.series = [{"metric": {"tenant": "a"}, "value": [0, "30"]},
                  {"metric": {"tenant": "b"}, "value": [0, "10"]}]
    by_rate = PrometheusQuery(srv.url, "q", client_label="tenant", requests=model)
    got = by_rate.client_gpus(400.0)  # the GPUs of 40 requests/s, shared 3:1
    assert got is not None and math.isclose(got.sum(), model.gpus(40.0)) and math.isclose(got[0], 3 * got[1])
    assert math.isclose(by_rate.demand_gpus(400.0), model.gpus(40.0))
    with pytest.raises(ValueError, match="client_label"):
        PrometheusQuery(srv.url, "q", client_label=" ")

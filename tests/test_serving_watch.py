"""Live demand sources (trace replay, Prometheus over real HTTP) and the advisory loan-plan loop."""

from __future__ import annotations

import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
from typer.testing import CliRunner

from tidal.policy.forecast import ForecastConfig
from tidal.policy.loan import LoanContext, TidalConfig, TidalPolicy
from tidal.serving.cli import app as serving_app
from tidal.serving.sources import PrometheusQuery, TraceReplay
from tidal.serving.traces import load_trace
from tidal.serving.watch import watch


def trace_file(tmp_path: Path, loads: list[float], step_s: int = 600) -> Path:
    p = tmp_path / "t.csv"
    p.write_text("seconds,rps\n" + "".join(f"{i * step_s},{v}\n" for i, v in enumerate(loads)))
    return p


# --- trace replay ----------------------------------------------------------------------------------


def test_trace_replay_holds_each_row_for_a_step_repeats_and_reads_gaps_as_unknown(tmp_path):
    tr = load_trace(trace_file(tmp_path, [10, 20, 0, 40]))  # row 2 is a gap (below 1 % of the median)
    src = TraceReplay(tr, serving_gpus=128, start_s=1000.0)
    assert src.demand_gpus(1000.0) == 32.0  # 128 x 10 / 40
    assert src.demand_gpus(1000.0 + 599) == 32.0
    assert src.demand_gpus(1000.0 + 600) == 64.0
    assert math.isnan(src.demand_gpus(1000.0 + 1300))  # the gap
    assert src.demand_gpus(1000.0 + 1800) == 128.0
    assert src.demand_gpus(1000.0 + 2400) == 32.0  # the trace repeats
    assert math.isnan(src.demand_gpus(999.0))  # before the replay starts
    with pytest.raises(ValueError, match="serving_gpus must be >= 1"):
        TraceReplay(tr, serving_gpus=0)


# --- Prometheus, over real HTTP on loopback --------------------------------------------------------


class _Prom:
    """A loopback HTTP server answering /api/v1/query with whatever ``reply`` says."""

    def __init__(self) -> None:
        self.reply: tuple[int, bytes] = (200, b"{}")
        self.truncate = False  # promise more bytes than are sent, then close
        self.queries: list[dict[str, list[str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = urlsplit(self.path)
                outer.queries.append({"path": [parts.path], **parse_qs(parts.query)})
                code, body = outer.reply
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body) + (100 if outer.truncate else 0)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, doc: object, code: int = 200) -> None:
        self.reply = (code, json.dumps(doc).encode() if not isinstance(doc, bytes) else doc)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def prom():
    p = _Prom()
    try:
        yield p
    finally:
        p.close()


def vector(*values: float) -> dict:
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": {}, "value": [1.0, str(v)]} for v in values]}}


def test_prometheus_query_reads_one_number_at_the_time_asked(prom):
    src = PrometheusQuery(prom.url, "sum(vllm:num_requests_running)", gpus_per_unit=0.25)
    prom.answer(vector(48))
    assert src.demand_gpus(1_700_000_000.0) == 12.0
    q = prom.queries[-1]
    assert q["path"] == ["/api/v1/query"] and q["query"] == ["sum(vllm:num_requests_running)"]
    assert float(q["time"][0]) == 1_700_000_000.0
    prom.answer({"status": "success", "data": {"resultType": "scalar", "result": [1.0, "8"]}})
    assert src.demand_gpus(0.0) == 2.0


@pytest.mark.parametrize(("reply", "code", "reason"), [
    (vector(), 200, "expected exactly one series, got 0"),
    (vector(1, 2), 200, "expected exactly one series, got 2"),
    (vector(-3), 200, "not a finite number >= 0"),
    ({"status": "success", "data": {"resultType": "vector", "result": [{"value": [1.0, "NaN"]}]}}, 200,
     "not a finite number"),
    ({"status": "error", "error": "parse error at char 5"}, 400, "HTTP 400"),
    ({"status": "error", "error": "query timed out"}, 200, "query timed out"),
    ({"status": "success", "data": {"resultType": "matrix", "result": []}}, 200, "scalar or a vector"),
    (b"<html>", 200, "did not answer JSON"),
])
def test_prometheus_failures_read_as_unknown_demand_and_say_why(prom, caplog, reply, code, reason):
    src = PrometheusQuery(prom.url, "sum(up)")
    prom.answer(reply, code)
    with caplog.at_level(logging.WARNING, logger="tidal.serving.sources"):
        assert math.isnan(src.demand_gpus(10.0))
    assert "sum(up)" in caplog.text and reason in caplog.text


def test_prometheus_cut_off_answer_reads_as_unknown(prom, caplog):
    prom.answer(vector(5))
    prom.truncate = True
    with caplog.at_level(logging.WARNING, logger="tidal.serving.sources"):
        assert math.isnan(PrometheusQuery(prom.url, "sum(up)", timeout_s=2.0).demand_gpus(10.0))
    assert (
        "no complete answer" in caplog.text or "cannot reach" in caplog.text
    )  # cut off: while reading, or reset


def test_prometheus_unreachable_reads_as_unknown(prom, caplog):
    url = prom.url
    prom.close()  # nothing listens there any more
    with caplog.at_level(logging.WARNING, logger="tidal.serving.sources"):
        assert math.isnan(PrometheusQuery(url, "sum(up)", timeout_s=2.0).demand_gpus(10.0))
    assert "cannot reach" in caplog.text


def test_prometheus_query_rejects_bad_settings():
    with pytest.raises(ValueError, match="base URL"):
        PrometheusQuery("prometheus:9090", "sum(up)")
    with pytest.raises(ValueError, match="query must not be empty"):
        PrometheusQuery("http://p:9090", " ")
    with pytest.raises(ValueError, match="gpus_per_unit"):
        PrometheusQuery("http://p:9090", "sum(up)", gpus_per_unit=0)


# --- the loop --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_watch_plans_on_the_step_grid_with_the_policy_the_simulator_uses(tmp_path):
    rng = np.random.default_rng(0)
    loads = list(40 + 20 * np.sin(np.arange(300) * 2 * np.pi / 144) + rng.normal(0, 2, 300))
    tr = load_trace(trace_file(tmp_path, loads))
    src = TraceReplay(tr, serving_gpus=64)
    cfg = TidalConfig(shortfall_budget=0.01, forecast=ForecastConfig(step_s=600.0))
    clock = FakeClock(17.0)  # between grid points: the first observation waits for 600
    seen = []
    watch(
        src, TidalPolicy(cfg), serving_gpus=64, clock=clock, sleep=clock.sleep, on_step=seen.append, steps=200
    )
    assert [s.now_s for s in seen] == [600.0 * k for k in range(1, 201)]
    assert clock.slept[0] == 583.0
    # the same plans as driving the policy directly with the same observations
    pol = TidalPolicy(cfg)
    state, lent = pol.initial_state(), 0
    for s in seen:
        plan, state = pol(LoanContext(now_s=s.now_s, serving_gpus=64, demand_gpus=src.demand_gpus(s.now_s),
                                      lent_gpus=lent), state)
        lent = plan.lendable_gpus
        assert (plan.lendable_gpus, plan.reclaims, plan.reclaim_now_gpus) == (
            s.plan.lendable_gpus, s.plan.reclaims, s.plan.reclaim_now_gpus)
    assert any(s.plan.lendable_gpus > 0 for s in seen) and any(s.plan.reclaims for s in seen)


def test_watch_that_falls_behind_skips_to_the_latest_step(tmp_path):
    tr = load_trace(trace_file(tmp_path, [30.0] * 50))
    clock = FakeClock(0.0)
    seen = []

    def slow(step) -> None:
        seen.append(step)
        if len(seen) == 2:
            clock.t += 3 * 600.0 + 10  # this step took three and a bit steps
    watch(TraceReplay(tr, 64), TidalPolicy(TidalConfig()), serving_gpus=64, clock=clock, sleep=clock.sleep,
          on_step=slow, steps=4)
    assert [s.now_s for s in seen] == [0.0, 600.0, 2400.0, 3000.0]


def test_cli_prints_one_json_plan_per_step_and_rejects_two_sources(tmp_path):
    p = trace_file(tmp_path, [30.0, 35.0, 40.0, 38.0] * 10)
    runner = CliRunner()
    r = runner.invoke(serving_app, ["watch", "--trace", str(p), "--serving-gpus", "64", "--speedup", "6000",
                                    "--steps", "3", "--json"])  # a 10-min step every 0.1 s
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    times = [row["now_s"] for row in rows]
    assert len(rows) == 3 and all(t % 600 == 0 for t in times) and times == sorted(set(times))
    assert all({"demand_gpus", "lendable_gpus", "reclaims", "reclaim_now_gpus"} <= set(row) for row in rows)
    r = runner.invoke(
        serving_app,
        ["watch", "--trace", str(p), "--prometheus", "http://p:9090", "--query", "x", "--serving-gpus", "64"],
    )
    assert r.exit_code == 2 and "exactly one demand source" in r.output
    r = runner.invoke(serving_app, ["watch", "--prometheus", "http://p:9090", "--serving-gpus", "64"])
    assert r.exit_code == 2 and "--query" in r.output

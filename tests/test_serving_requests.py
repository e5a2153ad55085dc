"""Requests, not GPUs: a request-rate trace or query plus a service rate and a latency target, turned into
GPU demand (tidal.serving.requests) in every place demand is read: the `serving:` block and its errors,
trace replay, Prometheus over real HTTP, `tidal serving watch`, `tidal plan`, the live loan step, and a
real `tidal up`."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from test_serving_watch import prom, trace_file, vector  # noqa: F401 (prom: a fixture)
from tidal.control.client import TidalClient
from tidal.control.config import ControlConfig
from tidal.control.loans import build_live_loans
from tidal.policy.queueing import gpus_needed, latency_exceeds
from tidal.serving.cli import app as serving_app
from tidal.serving.requests import RequestModel
from tidal.serving.sources import PrometheusQuery, TraceReplay
from tidal.serving.traces import load_trace
from tidal.serving.watch import WatchConfig
from tidal.sim.cli import app as sim_app

WIDE = {"COLUMNS": "400"}  # one line per error message
RATES = [40.0, 55.0, 0.0, 70.0, 90.0, 62.0]  # requests/s; row 2 is a telemetry gap
# 1.5 requests/s per GPU, replicas of 2 GPUs (3 requests/s each), p99 of the queue wait <= 0.2 s
REQ = {"service_rate_per_gpu": 1.5, "gpus_per_replica": 2, "latency_target_s": 0.2}


def model() -> RequestModel:
    m = RequestModel.from_settings(REQ)
    assert m is not None
    return m


def test_model_meets_the_target_with_whole_replicas():
    m = model()
    assert m.service_rate_per_replica == 3.0 and m.latency_quantile == 0.99 and m.latency_of == "queue"
    for rate in (1.0, 40.0, 90.0, 1234.0):
        gpus = m.gpus(rate)
        replicas = int(gpus) // 2
        assert gpus == 2 * replicas
        assert (
            latency_exceeds(replicas, rate, 3.0, 0.2) <= 0.01 < latency_exceeds(replicas - 1, rate, 3.0, 0.2)
        )
    assert RequestModel.from_settings({}) is None
    assert RequestModel.from_settings({"latency_quantile": None}) is None


@pytest.mark.parametrize(
    ("extra", "msg"),
    [
        (
            {"latency_target_s": 0.2},
            "serving.service_rate_per_gpu or serving.service_rate_per_replica (exactly one)",
        ),
        ({**REQ, "service_rate_per_replica": 3.0}, "(not both)"),
        ({"service_rate_per_gpu": 1.5}, "serving.latency_target_s is required"),
        ({**REQ, "service_rate_per_gpu": 0}, "serving.service_rate_per_gpu must be a number > 0"),
        ({**REQ, "service_rate_per_gpu": float("nan")}, "serving.service_rate_per_gpu must be a number > 0"),
        ({**REQ, "service_rate_per_gpu": "fast"}, "serving.service_rate_per_gpu must be a number > 0"),
        ({**REQ, "gpus_per_replica": 1.5}, "serving.gpus_per_replica must be a whole number >= 1"),
        ({**REQ, "gpus_per_replica": 0}, "serving.gpus_per_replica must be a whole number >= 1"),
        ({**REQ, "latency_target_s": -1}, "serving.latency_target_s must be a number >= 0"),
        ({**REQ, "latency_quantile": 1}, "serving.latency_quantile must be in (0, 1)"),
        ({**REQ, "latency_of": "ttft"}, "serving.latency_of must be one of queue, response"),
        (
            {**REQ, "latency_of": "response"},
            "serving.latency_target_s: target_s 0.2 s is below the 0.99-quantile",
        ),
        ({**REQ, "gpus_per_unit": 0.5}, "serving.gpus_per_unit does not apply to a request-rate demand"),
    ],
)
def test_serving_block_errors_name_the_field(extra, msg):
    with pytest.raises(ValueError) as e:
        ControlConfig.from_dict({"serving": {"serving_gpus": 64, "trace": "t.csv", **extra}})
    assert msg in str(e.value)


def test_trace_replay_of_request_rates(tmp_path, caplog):
    tr = load_trace(trace_file(tmp_path, RATES))
    want = gpus_needed(np.array(RATES), 3.0, 0.2, 0.99, gpus_per_replica=2)
    src = TraceReplay(tr, serving_gpus=96, start_s=0.0, requests=model())
    got = [src.demand_gpus(600.0 * i + 1) for i in range(len(RATES))]
    assert math.isnan(got[2])
    assert [g for i, g in enumerate(got) if i != 2] == [float(w) for i, w in enumerate(want) if i != 2]
    assert got[4] > got[3] > got[1] > got[0] and got[4] == 72  # absolute GPUs, not scaled to the pool
    with caplog.at_level(logging.WARNING, logger="tidal.serving.sources"):
        TraceReplay(tr, serving_gpus=16, requests=model())
    assert f"needs up to {got[4]:g} GPUs" in caplog.text and "the serving pool has 16" in caplog.text
    # the GPU path is untouched: the same trace without a model scales to the pool's peak
    assert TraceReplay(tr, serving_gpus=96).demand_gpus(600.0 * 4) == 96.0


def test_prometheus_request_rate_over_http(prom, caplog):  # noqa: F811 (the fixture)
    src = PrometheusQuery(prom.url, "sum(rate(vllm:request_success_total[5m]))", requests=model())
    prom.answer(vector(90))
    assert src.demand_gpus(1_700_000_000.0) == gpus_needed(90.0, 3.0, 0.2, 0.99, gpus_per_replica=2)
    prom.answer(vector(0))
    assert src.demand_gpus(1_700_000_600.0) == 0.0
    prom.answer({"status": "error", "error": "boom"})
    assert math.isnan(src.demand_gpus(1_700_001_200.0))  # unknown, never zero
    prom.answer(vector(1e12))  # a rate no pool meets (1e12 requests/s): unknown, said why, no crash
    with caplog.at_level(logging.WARNING, logger="tidal.serving.sources"):
        assert math.isnan(src.demand_gpus(1_700_001_800.0))
    assert "1e+12 requests/s: the target needs more than" in caplog.text


def test_watch_cli_takes_requests(tmp_path):
    p = trace_file(tmp_path, RATES * 4)
    args = ["watch", "--trace", str(p), "--serving-gpus", "96", "--speedup", "6000", "--steps", "3", "--json",
            "--service-rate-per-gpu", "1.5", "--gpus-per-replica", "2", "--latency-target-s", "0.2"]
    r = CliRunner().invoke(serving_app, args)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    by_row = dict(zip(RATES, gpus_needed(np.array(RATES), 3.0, 0.2, 0.99, gpus_per_replica=2), strict=True))
    for row in rows:
        rate = RATES[int(row["now_s"] // 600) % len(RATES)]
        assert row["demand_gpus"] == (None if rate == 0 else by_row[rate])
    r = CliRunner().invoke(serving_app, [*args, "--latency-quantile", "1.5"], env=WIDE)
    assert r.exit_code == 2 and "--latency-quantile" in r.output and "must be in (0, 1)" in r.output
    r = CliRunner().invoke(serving_app, args[:-6] + ["--latency-target-s", "0.2"], env=WIDE)
    assert r.exit_code == 2 and "--service-rate-per-gpu" in r.output
    huge = trace_file(tmp_path, [40.0, 1e12, 50.0])  # a row no pool could serve: refused at start, named
    r = CliRunner().invoke(serving_app, [*args[:2], str(huge), *args[3:]], env=WIDE)
    assert r.exit_code == 2 and "trace 't' (rps): the target needs more than 10000000 servers" in r.output


def test_plan_cli_takes_requests(tmp_path):
    p = trace_file(tmp_path, [40.0 + 30 * math.sin(i / 144 * 2 * math.pi) for i in range(144 * 3)])
    common = ["plan", str(p), "--serving-gpus", "64", "--json", "--latency-target-s", "0.2"]
    r = CliRunner().invoke(sim_app, [*common, "--service-rate-per-replica", "3", "--gpus-per-replica", "2"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    rates = load_trace(p).load
    want = gpus_needed(rates, 3.0, 0.2, 0.99, gpus_per_replica=2)
    assert rep["mean_demand_over_pool"] * 64 == pytest.approx(float(np.mean(want)))
    r = CliRunner().invoke(
        sim_app, [*common, "--service-rate-per-replica", "3", "--latency-of", "ttft"], env=WIDE
    )
    assert r.exit_code == 2 and "--latency-of" in r.output


def test_live_loan_step_reads_requests(tmp_path):
    p = trace_file(tmp_path, RATES * 40)
    cfg = WatchConfig(nodes="4x16", trace=str(p), history_days=1.0, **REQ)
    loans = build_live_loans(cfg)
    want = gpus_needed(np.array(RATES), 3.0, 0.2, 0.99, gpus_per_replica=2)
    warm = loans._warm
    assert len(warm) == 144
    for t, y in warm:
        i = int(t // 600) % len(RATES)
        assert (math.isnan(y) and i == 2) or y == want[i]


def test_tidal_up_plans_from_request_rates(tmp_path):
    """A real ``tidal up`` on a loopback port whose ``serving:`` block gives requests, not GPUs."""
    trace_file(tmp_path, [40.0 + (i * 7) % 23 for i in range(400)])
    (tmp_path / "c.yaml").write_text(
        "serving:\n  serving_gpus: 64\n  trace: t.csv\n  speedup: 6000\n"
        "  service_rate_per_gpu: 1.5\n  gpus_per_replica: 2\n  latency_target_s: 0.2\n"
    )
    state, out = tmp_path / "state", tmp_path / "up.log"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from tidal.cli import main; main()",
                "up",
                "--gpus",
                "1",
                "--port",
                "0",
                "--state-dir",
                str(state),
                "--config",
                str(tmp_path / "c.yaml"),
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        deadline = time.monotonic() + 60
        while not (state / "api.url").exists():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        client = TidalClient(
            (state / "api.url").read_text().strip(), (state / "admin.token").read_text().strip()
        )
        while (got := client.serving())["latest"] is None or got["latest"]["now_s"] < 1200:
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
        latest = got["latest"]
        rate = 40.0 + (int(latest["now_s"] // 600) * 7) % 23
        assert latest["demand_gpus"] == gpus_needed(rate, 3.0, 0.2, 0.99, gpus_per_replica=2)
        assert "Erlang C" in got["source"] and "p99 queue time <= 0.2 s" in got["source"]
    finally:
        proc.kill()
        proc.wait(timeout=30)

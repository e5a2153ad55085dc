"""The live loan plan in the control plane (advice): ``serving:`` config, the advisor as a phase of the
reconcile step, the API and metrics, in-process and in a real ``tidal up`` on loopback."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from control_fakes import FakeClock, FakeExecutor, new_store
from tidal.control.api import ApiContext, create_app
from tidal.control.auth import ensure_admin
from tidal.control.client import ApiError, TidalClient
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.server import ReconcileLoop
from tidal.control.store import Store
from tidal.model import Node
from tidal.serving.watch import WatchConfig, build_advisor, start_advisor


def write_trace(path: Path, rows: int = 400) -> Path:
    path.write_text("seconds,rps\n" + "".join(f"{600 * i},{40 + (i * 7) % 23}\n" for i in range(rows)))
    return path


@pytest.mark.parametrize(
    ("serving", "msg"),
    [
        ({"trace": "t.csv"}, r"serving_gpus \(or nodes, to lend them\) is required"),
        ({"serving_gpus": 8}, "exactly one demand source"),
        (
            {"serving_gpus": 8, "trace": "t.csv", "prometheus": "http://p:9090", "query": "x"},
            "exactly one demand source",
        ),
        ({"serving_gpus": 8, "prometheus": "http://p:9090"}, "serving.query is required"),
        ({"serving_gpus": 0, "trace": "t.csv"}, "serving.serving_gpus must be a whole number >= 1"),
        ({"serving_gpus": 8, "trace": "t.csv", "shortfall_budget": 2}, "serving.shortfall_budget must be in"),
        ({"serving_gpus": 8, "trace": "t.csv", "speedup": 0}, "serving.speedup must be a number > 0"),
        ({"serving_gpus": 8, "trace": "t.csv", "lead": 3}, "config: serving: unknown field 'lead'"),
        ({"serving_gpus": 8, "trace": "t.csv", "client_label": "tenant"}, "serving.client_label must be"),
        ({"serving_gpus": 8, "prometheus": "http://p:9090", "query": "x", "client_label": 3},
         "serving.client_label must be a label name"),
        ("yes", "config: serving must be a mapping"),
    ],
)
def test_serving_config_errors_name_the_field(serving, msg):
    with pytest.raises(ValueError, match=msg):
        ControlConfig.from_dict({"serving": serving})


def test_serving_config_trace_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "c.yaml").write_text(
        "serving:\n  serving_gpus: 16\n  trace: traffic.csv\n  speedup: 60\n"
    )
    cfg = ControlConfig.load(tmp_path / "conf" / "c.yaml")
    assert cfg.serving == WatchConfig(
        serving_gpus=16, trace=str(tmp_path / "conf" / "traffic.csv"), speedup=60.0
    )
    assert ControlConfig.from_dict({}).serving is None


def _app(tmp_path: Path, serving):
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    token, _ = ensure_admin(store, tmp_path, 0.0)
    app = create_app(ApiContext(store, [Node("local", 4)], lambda j, r: None, FakeClock(), serving=serving))
    return store, TidalClient(http=TestClient(app), token=token)


def test_api_and_metrics_show_the_newest_plan(tmp_path):
    cfg = WatchConfig(serving_gpus=64, trace=str(write_trace(tmp_path / "t.csv")), speedup=1.0)
    adv, clock, _ = start_advisor(cfg)
    store, client = _app(tmp_path, (adv, cfg.describe()))
    try:
        got = client.serving()
        assert got["latest"] is None and got["advice_only"] and got["serving_gpus"] == 64
        assert "tidal_serving_lendable_gpus" not in client.metrics()
        t = 0.0
        for _ in range(30):  # thirty 10-minute steps of the replayed trace
            assert adv.tick(t) is not None
            t += 600.0
        got = client.serving()["latest"]
        assert got["now_s"] == 600.0 * 29 and got["lendable_gpus"] == adv.latest.plan.lendable_gpus
        assert got["demand_gpus"] == pytest.approx(adv.source.demand_gpus(600.0 * 29), abs=1e-3)
        text = client.metrics()
        assert f"tidal_serving_lendable_gpus {float(got['lendable_gpus'])}" in text
        assert 'tidal_serving_reclaim_gpus{within="6h"}' in text
    finally:
        store.close()


def test_without_a_serving_side_the_api_says_how_to_configure_one(tmp_path):
    store, client = _app(tmp_path, None)
    try:
        with pytest.raises(ApiError) as e:
            client.serving()
        assert e.value.status == 404 and "serving: in tidal up --config" in str(e.value)
    finally:
        store.close()


def test_reconcile_loop_plans_on_its_own_and_stops(tmp_path):
    """The advisor is a phase of the reconcile step: the one loop plans at every grid point the serving
    clock passed (a replay 60,000x as fast: ~100 grid points a second, many per step), then stops."""
    cfg = WatchConfig(serving_gpus=32, trace=str(write_trace(tmp_path / "t.csv")), speedup=60_000.0)
    adv = build_advisor(cfg)
    store = new_store(tmp_path)
    loop = ReconcileLoop(Controller(store, FakeExecutor(), advisor=adv), 0.05)
    seen: list[float] = []
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while (adv.latest is None or adv.latest.now_s < 6000) and time.monotonic() < deadline:
            if adv.latest is not None:
                seen.append(adv.latest.now_s)
            time.sleep(0.02)
        assert adv.latest is not None and adv.latest.now_s >= 6000 and adv.latest.now_s % 600 == 0
        assert adv.state.forecast.n_obs * 600 >= adv.latest.now_s - adv.start_s  # every grid point observed
    finally:
        loop.stop()
        loop.join(timeout=10)
        store.close()
    assert not loop.is_alive()
    assert loop.steps >= 1


def test_advance_observes_each_grid_point_then_skips_when_far_behind(tmp_path):
    cfg = WatchConfig(serving_gpus=32, trace=str(write_trace(tmp_path / "t.csv")), speedup=600.0)
    adv = build_advisor(cfg)
    start = adv.start_s
    assert adv.advance(1000.0) == (1 if start % 600 == 0 else 0)  # the first call sets the clock's origin
    n0 = adv.state.forecast.n_obs
    assert adv.advance(1010.0) == 10  # 6,000 s of serving time: ten grid points, each observed
    assert adv.state.forecast.n_obs == n0 + 10 and adv.latest.now_s == start + 6000.0
    made = adv.advance(1010.0 + 100)  # 100 grid points behind: MAX_CATCH_UP one by one, then the latest
    assert made == 65 and adv.latest.now_s == start + 6000.0 + 100 * 600


def test_tidal_up_serves_the_plan_from_a_replayed_trace(tmp_path):
    """A real ``tidal up`` on a loopback port with ``serving:`` in its config."""
    write_trace(tmp_path / "traffic.csv")
    (tmp_path / "c.yaml").write_text("serving:\n  serving_gpus: 32\n  trace: traffic.csv\n  speedup: 6000\n")
    state = tmp_path / "state"
    out = tmp_path / "up.log"
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
        while True:
            got = client.serving()
            if got["latest"] is not None and got["latest"]["now_s"] >= 3000:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
        assert got["source"].startswith("trace ") and got["serving_gpus"] == 32
        assert "tidal_serving_lendable_gpus" in client.metrics()
        assert "serving 32 GPUs, plan from trace" in out.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_prometheus_that_never_answers_does_not_hold_up_the_reconcile_step(tmp_path):
    """The advice phase runs in the reconcile step: the plane's advisor asks Prometheus on a thread of its
    own (as the lending hook adapter does), so a server that accepts and never answers makes the demand
    unknown for that grid point, not the jobs' loop wait for the query's 5 s timeout."""
    import socket
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are queued, never answered
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    cfg = WatchConfig(serving_gpus=8, prometheus=url, query="sum(x)")
    store = new_store(tmp_path)
    try:
        ctl = Controller(store, FakeExecutor(), advisor=build_advisor(cfg, wait_s=0.1))
        step = threading.Thread(target=ctl.step, args=(600.0 * 3_000_000,), daemon=True)
        step.start()
        step.join(4.0)  # less than the query's own timeout (5 s): a step that waited on it is still here
        assert not step.is_alive()
        latest = ctl.advisor.latest
        assert latest is not None and math.isnan(latest.demand_gpus)
    finally:
        store.close()
        silent.close()

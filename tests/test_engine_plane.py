"""A real ``tidal up`` (uvicorn on loopback) lending the GPUs of real llama.cpp replicas (``serving:
{adapter: llama.cpp}``): demand comes from the engines' own metrics, the reclaim lead time uses their
measured warm-up, a spot job grows onto the lent replica's GPU at night and gives it back before the
morning rise, and the traffic through the router loses no request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from plane_proc import Plane, engine_figures, require_engine, stop_engine_plane, wait_until
from tidal.control.client import TidalClient

require_engine()
from tidal.demo.serve_traffic import Traffic  # noqa: E402
from tidal.serving.engine_bench import request_body  # noqa: E402
from tidal.serving.tiny_gguf import write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
DAY = 86400


def day_trace(path: Path) -> Path:
    """Earlier days' demand: half the pool from 00:00 to 06:00, all of it by day (scaled to the pool)."""
    rows = [f"{t},{0.5 if t % DAY < 6 * 3600 else 1.0}" for t in range(0, 3 * DAY, 600)]
    path.write_text("seconds,load\n" + "\n".join(rows) + "\n")
    return path


def config(tmp: Path) -> str:
    """From 02:00 of the third day at 900x: about 16 s of night before the rise (the notice one measured
    lead time earlier); the configured warm-up (10 s) would leave no window to lend in."""
    return yaml.safe_dump({
        "restart_backoff_s": 0.2, "startup_timeout_s": 60, "loop_interval_s": 0.2, "kill_slack_s": 3,
        "serving": {
            "adapter": "llama.cpp", "nodes": "2x1",
            "engine": {"model": str(write_tiny_gguf(tmp / "tiny.gguf")), "slots": 2, "threads": 1},
            "latency_target_s": 0.5, "rate_window_s": 3,
            "trace": str(day_trace(tmp / "day.csv")), "history_days": 2, "start_s": 2 * DAY + 2 * 3600,
            "speedup": 900, "shortfall_budget": 0.05,
            "grace_s": 2, "final_checkpoint_s": 1, "release_s": 0.5, "warmup_s": 10, "restart_cost_s": 1}})


def test_tidal_up_lends_a_real_engines_gpu_and_takes_it_back_in_time(tmp_path):
    p = Plane(tmp_path, config(tmp_path), gpus=1)
    traffic, pids = None, set()
    try:
        p.start()
        admin = p.admin

        def engine() -> dict:
            return engine_figures(p, pids)

        url = wait_until("the engine's router", lambda: engine().get("url"), 30)
        traffic = Traffic(f"{url}/v1/completions", lambda t: 3.0, 60.0, max_rate=3.0,
                          body=lambda i: request_body(i, 8), stream=True)
        traffic.start()
        lab = TidalClient(p.url, admin.create_tenant("lab")["token"])
        job = lab.submit({"name": "spot", "kind": "spot", "gpus": {"min": 1, "max": 2}, "grace_s": 2,
                          "max_restarts": 20, "workdir": str(tmp_path),
                          "command": [sys.executable, str(WORKER), "--steps", "10000000", "--step-s", "0.05"],
                          "env": {"TIDAL_CKPT_INTERVAL_STEPS": "20", "TIDAL_SHM_DIR": str(tmp_path / "shm")}})
        jid = job["id"]
        events = lambda kind: [e for e in admin.events() if e["kind"] == kind]  # noqa: E731
        loan = wait_until("a loan", lambda: events("loan"), 30)[0]
        s = admin.serving()
        # demand is the engines' own (replicas the p99 wait target needs), the lead time their warm-up
        assert s["warmup_measured"] and s["warmup_s"] < 5 and 0 < s["demand_gpus"] <= 1, s
        e = engine()
        assert e["rate_per_s"] > 0 and e["service_s"] > 0 and 0 < e["replicas_needed"] <= 1, e
        lent = loan["data"]["node"]
        wait_until("the lent replica unrouted", lambda: engine()["routed"] == 1, 10)
        wait_until("the job on the lent GPU", lambda: lent in (lab.job(jid)["placement"] or {}), 30)
        ret = wait_until("the GPU returned", lambda: events("return"), 40)[0]
        assert ret["data"]["margin_s"] >= 0, ret  # before its deadline
        wait_until("the replica serving again", lambda: events("serving_ready"), 30)
        wait_until("both replicas routed", lambda: engine()["routed"] == 2, 10)
        assert engine()["ttft_p99_s"] > 0 and engine()["requests"] > 20
        traffic.stop(60.0)
        assert traffic.error is None and len(traffic.records) > 20
        failed = [r for r in traffic.records if not r.ok]
        assert not failed, failed[:3]
        st = admin.serving()["stats"]
        assert st["reclaims_missed"] == 0 and st["reclaims_met"] >= 1 and st["lent_total_gpus"] >= 1
        kinds = {ev["kind"] for ev in admin.serving()["adapter"]["engine"]["events"]}
        assert {"lent", "returned"} <= kinds, kinds
    finally:
        if traffic is not None:
            traffic.stop(10.0)
        stop_engine_plane(p, pids)

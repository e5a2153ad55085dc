"""``tidal demo ray``: bad options are one clear error before anything starts; the whole demos (their own
Ray clusters: ~1.5 min, the day cycle ~4 min, with Ray Serve ~5 min) only with TIDAL_RAY_LONG=1 (not in
make test)."""

from __future__ import annotations

import json
import os

import pytest
import typer
from typer.testing import CliRunner

from tidal.demo.on_ray import demo_ray


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(demo_ray)
    return a


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--parallel", "tp"], "--parallel 'tp': expected ddp or fsdp"),
        (["--kill-at", "1.5"], "expected 0 < kill-at < 1"),
        (["--steps", "8", "--ckpt-every", "5"], "steps >= 2 x ckpt-every + 2"),
        (["--cycle", "--kill-hour", "25"], "--kill-hour 25: expected 0 to 24"),
        (
            ["--cycle", "--hours", "3", "--kill-hour", "4"],
            "--kill-hour 4 is not within the 3 h replayed from 22:00",
        ),
        (["--cycle", "--speedup", "600"], "serving: TidalConfig.forecast.horizon_s"),
        (["--cycle", "--jobs", "9"], "--jobs must be 1 to 8"),
        (["--serve"], "--serve goes with --cycle"),
        (["--cycle", "--serve", "--speedup", "600"], "serving: TidalConfig.forecast.horizon_s"),
    ],
)
def test_bad_options_are_one_clear_error(args, msg, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = CliRunner().invoke(app(), args)
    assert r.exit_code == 2 and msg in " ".join(r.output.split()), r.output
    assert list(tmp_path.iterdir()) == []  # no state dir left behind


@pytest.mark.slow
@pytest.mark.ray_long
@pytest.mark.skipif(os.environ.get("TIDAL_RAY_LONG") != "1", reason="starts its own Ray cluster (~1.5 min): "
                    "TIDAL_RAY_LONG=1 runs it")
def test_the_demo_recovers_from_a_node_loss():
    pytest.importorskip("ray")
    r = CliRunner().invoke(app(), ["--json", "--steps", "40"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout[r.stdout.index("{"):])
    assert s["state"] == "succeeded" and s["restarts"] == 0 and s["world_sizes"]["1"] == 3
    assert s["world_sizes"]["2"] == 2 and s["restored_step"] > 0 and s["detection_s"] > 0


@pytest.mark.slow
@pytest.mark.ray_long
@pytest.mark.skipif(
    os.environ.get("TIDAL_RAY_LONG") != "1",
    reason="starts its own 4-node Ray cluster (~3-4 min): TIDAL_RAY_LONG=1 runs it",
)
def test_the_day_cycle_on_ray_lends_reclaims_and_survives_a_node_loss():
    pytest.importorskip("ray")
    r = CliRunner().invoke(app(), ["--cycle", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout[r.stdout.index("{"):])
    lv, nl = s["live"], s["node_loss"]
    assert (
        s["ok"]
        and lv["lent_gpus_total"] > 0
        and lv["returns_missed"] == 0
        and lv["double_counted_steps"] == 0
    )
    assert nl["node"] in ("train-0", "train-1") and nl["detected"] and nl["recovered"], nl
    # killed when the agents left held the newest step, the disk no newer one (looked for until 06:00, then
    # at any moment: "forced"): that step, from the buddy's memory
    peer = nl["tiers"].get("peer")
    assert peer is not None and peer >= (nl["tiers"].get("disk") or -1), nl
    assert nl["restore_tier"] == "peer" and nl["restored_step"] == peer, nl
    assert nl["detection_s"] > 0, nl


@pytest.mark.slow
@pytest.mark.ray_long
@pytest.mark.skipif(
    os.environ.get("TIDAL_RAY_LONG") != "1",
    reason="starts its own 4-node Ray cluster with Ray Serve (~7 min): TIDAL_RAY_LONG=1 runs it",
)
def test_the_day_cycle_with_ray_serve_replicas_serves_every_request_across_the_reclaims():
    pytest.importorskip("ray")
    r = CliRunner().invoke(app(), ["--cycle", "--serve", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout[r.stdout.index("{"):])
    lv, nl, sv = s["live"], s["node_loss"], s["serve"]
    print(json.dumps({"node_loss": nl, "latency": sv["latency"], "demand": sv["adapter"].get("demand"),
                      "live": {k: v for k, v in lv.items() if k != "jobs"}, "simulator": s["simulator"]}))
    assert s["ok"] and lv["lent_gpus_total"] > 0 and lv["returns_missed"] == 0, lv
    assert nl["detected"] and nl["recovered"] and nl["restore_tier"] == "peer", nl
    lat = sv["latency"]
    assert sv["ok"] and lat["total"]["failed"] == 0 and lat["total"]["requests"] > 100, sv
    assert sv["reclaim_at_s"] is not None and lat["during"]["requests"] > 0, sv


def test_the_serve_days_history_and_traffic_are_one_request_rate_trace(tmp_path):
    """``--serve`` without a cluster: the plane accepts its serving block, the forecast's three earlier
    days and the load generator's live day come from one written trace, and the latency phases split
    at the reclaim notice and at serving ready again."""
    from tidal.control.loans import build_live_loans
    from tidal.demo import serve_traffic as st
    from tidal.demo.ray_cycle import options
    from tidal.serving.loadgen import Record, constant

    opts = options(360.0, 14.0, 22.0, 2, 2)
    p = st.write_rate_trace(opts, tmp_path / "requests.csv")
    cfg = st.serving_config(opts, p, 8000)
    loans = build_live_loans(cfg)  # no Ray contacted
    assert loans.adapter.s.rate_smoothing_s == st.RATE_SMOOTHING_S > 0  # the demand's noise smoothed
    hist = dict(loans.adapter.forecast_history(opts.start_s, cfg.step_s))
    assert len(hist) == 3 * 144 and min(hist) == opts.start_s - 3 * 86400
    night, evening = hist[2 * 86400 + 4 * 3600], hist[2 * 86400 + 22 * 3600]
    assert night < evening <= 16, (night, evening)  # the night needs fewer replicas: GPUs to lend
    rate = st.trace_rate(p, opts.start_s, opts.speedup)
    assert 0.9 * st.PEAK_RATE_PER_S < rate(0.0) <= st.PEAK_RATE_PER_S  # 22:00, near the peak
    assert rate(6 * 3600 / opts.speedup) < rate(0.0)  # 04:00
    t = st.Traffic("http://127.0.0.1:9/", constant(1.0), 1.0)
    t.records = [Record(0.5, 1.1, 200), Record(5.0, 2.0, 200), Record(12.0, 0.0, 0, "refused")]
    ph = t.phases(2.0, 10.0)
    assert [ph[k]["requests"] for k in ("before", "during", "after")] == [1, 1, 1]
    assert ph["after"]["failed"] == 1 and ph["total"]["failed"] == 1 and ph["during"]["p50_s"] == 2.0
    assert t.phases(None, None)["before"]["requests"] == 3


def test_the_node_loss_picks_an_attempt_with_its_own_peer_step_not_the_jobs_older_checkpoint():
    """A job grown onto lent GPUs restarted from its notice checkpoint (the job's ``ckpt_step``); its new
    attempt's progress has no step per tier (``{}``) until it commits one: killing it then restores from
    the notice checkpoint's tier, not from the peer tier, so it is not picked, even ``LATE_S`` late."""
    from tidal.demo.ray_cycle import LATE_S, NodeLoss

    loss = NodeLoss(at_s=1000.0)
    job = {"id": "spot-0-1", "state": "running", "placement": {"train-0": 1, "serve-0": 1}, "ckpt_step": 68,
           "progress": {"step": 70, "tiers": {}}}
    assert loss.pick([job], 1000.0) is None and loss.pick([job], 1000.0 + LATE_S) is None
    disk = {**job, "progress": {"step": 71, "tiers": {"disk": [70, 1.0]}}}
    assert loss.pick([disk], 1000.0) is None  # no peer step: only late
    assert loss.pick([disk], 1000.0 + LATE_S) == ("train-0", disk)
    peer = {**job, "progress": {"step": 81, "tiers": {"peer": [80, 2.0], "disk": [70, 1.0]}}}
    one_node = {**peer, "placement": {"serve-0": 2}}
    starting = {**peer, "state": "starting"}
    assert loss.pick([one_node, starting, peer], 1000.0) == ("train-0", peer)

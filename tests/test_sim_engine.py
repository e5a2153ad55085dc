"""The simulator end to end on a short hand-built trace: invariants, baselines' guarantees, the CLI."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tidal.sim.cli import app
from tidal.sim.config import make_config, with_modes
from tidal.sim.engine import Engine, simulate
from tidal.sim.jobs import JobSpec, SpotBacklog
from tidal.sim.metrics import METRIC_KEYS
from tidal.sim.policies import POLICIES, PolicySpec
from tidal.sim.traffic import demand_gpus

N, M = 32, 16


def write_trace(path: Path, days: float = 2.0, seed: int = 0) -> Path:
    """A noisy daily cycle every 10 minutes: busy by day, quiet at night, one burst."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(days * 144)) * 600.0
    load = 100 + 60 * np.sin(2 * np.pi * (t / 86400.0 - 0.25)) + rng.normal(0, 6, t.size)
    load[150:153] += 50
    rows = "".join(f"{a:.0f},{max(b, 1.0):.3f}\n" for a, b in zip(t, load, strict=True))
    path.write_text("seconds,requests_per_second\n" + rows)
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return write_trace(tmp_path_factory.mktemp("sim") / "traffic.csv")


@pytest.fixture(scope="module")
def demand(trace) -> np.ndarray:
    d, step, _ = demand_gpus(trace, N)
    assert step == 600.0
    return d


def cfg(**kw):
    args = {"serving_gpus": N, "training_gpus": M, "days": 2.0}
    args.update(kw)
    return make_config(**args)


def trace_jobs() -> list[JobSpec]:
    return [
        JobSpec(
            f"j{i:03d}",
            "a" if i % 2 else "b",
            "dedicated" if i % 5 == 0 else "spot",
            i % 2,
            g,
            2 * g,
            g * 3600.0 * (1 + i % 4),
            i * 1800.0,
            gpus_per_node=8 if g == 8 else None,
        )
        for i, g in enumerate([1, 2, 4, 8, 2, 1, 4, 8, 2, 4] * 3)
    ]


@pytest.fixture(scope="module")
def runs(demand) -> dict:
    out = {}
    for name in POLICIES:
        e = Engine(demand, 600.0, PolicySpec(name), cfg(), trace_jobs(), SpotBacklog(), check=True)
        out[name] = (e, e.run())
    return out


def test_every_policy_runs_and_reports_every_metric(runs):
    for name, (_, r) in runs.items():
        assert set(METRIC_KEYS) <= set(r.metrics), name
        assert r.metrics["schedule_calls"] > 0 and r.metrics["jobs_submitted"] > 0


def test_none_lends_nothing(runs):
    m = runs["none"][1].metrics
    assert (
        m["loaned_gpu_hours"] == 0 and m["harvested_gpu_hours"] == 0 and m["serving_shortfall_gpu_hours"] == 0
    )
    assert m["training_kept_gpu_hours"] > 0  # the training pool still trains


def test_oracle_never_falls_short_and_harvests(runs):
    m = runs["oracle"][1].metrics
    assert m["serving_shortfall_gpu_hours"] == pytest.approx(0.0, abs=1e-9)
    assert m["harvest_ratio"] > 0.5


def test_conservation_and_bounds(runs):
    for name, (e, r) in runs.items():
        m = r.metrics
        w = e.world
        held_by_jobs = sum(
            sj.held_gpu_s + sj.job.gpus * (e.cfg.end_s - sj.held_since) for sj in w.jobs.values()
        )
        assert held_by_jobs / 3600 == pytest.approx(e.meter.held_gpu_s / 3600, rel=1e-6), name
        assert (
            m["harvested_gpu_hours"]
            <= m["trained_on_loans_held_gpu_hours"] + 1e-6
            <= m["loaned_gpu_hours"] + 2e-6
        )
        assert e.meter.held_gpu_s <= (e.meter.lent_gpu_s + M * e.meter.scored_s) * (1 + 1e-9)
        assert m["training_kept_gpu_hours"] <= e.meter.held_gpu_s / 3600 + 1e-6
        # serving: what is met plus what is short is what was demanded
        assert (e.meter.met_gpu_s + e.meter.short_gpu_s) == pytest.approx(e.meter.demand_gpu_s, rel=1e-9)


def test_serving_never_lent_beyond_what_the_plan_allowed(runs):
    for name, (_, r) in runs.items():
        tl = r.timeline
        lent, lendable = tl["lent_gpus"], tl["lendable_gpus"]
        before = np.concatenate([[0.0], lent[:-1]])
        # new loans only up to the plan; beyond it only loans made earlier and not yet handed back
        assert np.all(lent <= np.maximum(lendable, before)), name
        assert np.all(lent + tl["warming_gpus"] <= N) and np.all(tl["training_on_loans_gpus"] <= lent), name


def test_same_seed_same_result(demand):
    threshold = gc.get_threshold()
    a = simulate(
        demand, step_s=600.0, policy=PolicySpec("tidal"), config=cfg(days=1.0), backlog=SpotBacklog()
    )
    assert gc.get_threshold() == threshold  # a run raises the collector's threshold for itself only
    b = simulate(
        demand, step_s=600.0, policy=PolicySpec("tidal"), config=cfg(days=1.0), backlog=SpotBacklog()
    )
    keys = [k for k in a.metrics if not any(x in k for x in ("ms", "wall", "cpu"))]
    assert {k: a.metrics[k] for k in keys} == {k: b.metrics[k] for k in keys}


def test_checkpoint_and_resize_modes(demand):
    c = cfg(days=1.0, failure_rate_per_gpu_hour=0.01)  # many failures: durability matters
    sync = simulate(
        demand,
        step_s=600.0,
        policy=PolicySpec("oracle"),
        config=with_modes(c, "sync", "reshard"),
        backlog=SpotBacklog(),
    ).metrics
    conc = simulate(
        demand, step_s=600.0, policy=PolicySpec("oracle"), config=c, backlog=SpotBacklog()
    ).metrics
    assert sync["failures"] > 0 and conc["failures"] > 0
    assert sync["final_ckpt_missed"] > 0 and conc["final_ckpt_missed"] == 0  # a 300 s stall misses the grace
    assert sync["harvested_gpu_hours"] < conc["harvested_gpu_hours"]
    rigid = simulate(
        demand,
        step_s=600.0,
        policy=PolicySpec("oracle"),
        config=cfg(days=1.0, resize="restart-full"),
        backlog=SpotBacklog(),
    ).metrics
    assert rigid["shrinks"] == 0


def test_trace_repeats_when_shorter_than_the_run(demand):
    r = simulate(demand[:144], step_s=600.0, policy=PolicySpec("reactive"), config=cfg(days=2.0),
                 backlog=SpotBacklog())
    d = r.timeline["demand_gpus"]
    assert len(d) == 288 and np.allclose(d[:144], d[144:], equal_nan=True)


def test_cli_json_has_every_metric_for_every_policy(trace, tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "sim",
            "--traffic",
            str(trace),
            "--spot-backlog",
            "--serving-gpus",
            str(N),
            "--training-gpus",
            str(M),
            "--days",
            "1",
            "--policy",
            "none,reactive,oracle",
            "--json",
            "--plot",
            str(tmp_path / "t.png"),
            "--warmup-days",
            "0.25",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "(days 0.25 to 2.25; scored from day 0.25)" in res.stderr  # the plot starts where scoring does
    out = json.loads(res.stdout)
    assert list(out) == ["none", "reactive", "oracle"]
    for m in out.values():
        assert set(METRIC_KEYS) <= set(m)
        assert all(v is None or not (isinstance(v, float) and math.isnan(v)) for v in m.values())
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_cli_sweep_and_plan(trace, tmp_path):
    png = tmp_path / "sweep.png"
    res = CliRunner().invoke(
        app,
        [
            "sim",
            "--traffic",
            str(trace),
            "--spot-backlog",
            "--serving-gpus",
            str(N),
            "--days",
            "0.5",
            "--policy",
            "oracle,none",
            "--sweep",
            "--sweep-png",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    assert png.stat().st_size > 10_000 and "oracle" in res.stdout
    res = CliRunner().invoke(app, ["plan", str(trace), "--serving-gpus", str(N), "--json",
                                   "--png", str(tmp_path / "plan.png")])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["lead_time_s"] == 1200 and len(rep["by_hour"]) == 24
    res = CliRunner().invoke(app, ["plan", str(trace), "--serving-gpus", str(N)])
    assert "columns: idle GPU-h/day = " in res.stdout
    assert "tidal lent GPU-h/day = what the tidal policy" in res.stdout
    assert 0 < rep["lendable_gpu_hours_per_day_at_risk"] <= rep["idle_gpu_hours_per_day"]


def test_cli_names_bad_input(trace):
    res = CliRunner().invoke(
        app, ["sim", "--traffic", str(trace), "--serving-gpus", "8", "--policy", "greedy"]
    )
    assert res.exit_code != 0 and "greedy" in res.output


def test_timeline_bands_never_lie_on_the_capacity_line():
    """The plot shows lent and warming GPUs as bands from serving's capacity up to the pool, so they
    cannot overlap the capacity line (they did as lines: lent = capacity whenever half the pool was lent)."""
    from tidal.sim.report import serving_bands

    tl = {"lent_gpus": np.array([0, 4, 8, 6]), "warming_gpus": np.array([0, 0, 0, 2])}
    cap, top = serving_bands(tl, 8)
    assert cap.tolist() == [8, 4, 0, 0] and top.tolist() == [8, 4, 0, 2]
    assert ((8 - top) == tl["lent_gpus"]).all() and ((top - cap) == tl["warming_gpus"]).all()


def test_per_client_traffic_feeds_the_client_model(trace, tmp_path):
    """A per-client trace (gzip) gives the same total as the aggregate one; the simulator passes the
    breakdown to the policy and `tidal plan` says the client model served."""
    import gzip

    rows = trace.read_text().splitlines()[1:]
    lines = ["seconds,client,requests_per_second,interarrival_cv"]
    for i, r in enumerate(rows):
        t, x = r.split(",")
        big = 0.4 * float(x) if 40 <= i % 144 < 70 else 0.0  # a client on for 5 hours a day
        lines += [f"{t},big,{big:.4f},1.0"] * (big > 0) + [f"{t},rest,{float(x) - big:.4f},1.0"]
    path = tmp_path / "clients.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    from tidal.sim.traffic import traffic_gpus

    total, per, step, _ = traffic_gpus(path, N)
    assert np.allclose(total, demand_gpus(trace, N)[0], atol=1e-3) and per is not None
    assert np.allclose(per.sum(axis=1), total) and per.shape[1] == 3
    e = Engine(total, step, PolicySpec("tidal"), cfg(days=1.0), [], SpotBacklog(), clients=per)
    e.run()
    assert e.pstate.clients is not None and e.pstate.clients.n_obs == 144
    got = {}
    for p in (path, trace):
        res = CliRunner().invoke(app, ["plan", str(p), "--serving-gpus", str(N), "--json"])
        assert res.exit_code == 0, res.output
        got[p] = json.loads(res.stdout)["forecaster"]
    assert got == {path: "clients", trace: "aggregate"}

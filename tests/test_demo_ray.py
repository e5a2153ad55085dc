"""``tidal demo ray``: bad options are one clear error before anything starts; the whole demo (its own
3-node Ray cluster, ~1.5 min) only with TIDAL_RAY_LONG=1 (not in make test)."""

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
    ],
)
def test_bad_options_are_one_clear_error(args, msg):
    r = CliRunner().invoke(app(), args)
    assert r.exit_code == 2 and msg in " ".join(r.output.split()), r.output


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

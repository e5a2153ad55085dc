"""`python -m lab generalize`: the stress traces, the vectorized oracle, the protocol end to end on small
files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from lab.cli import app
from lab.forecast.generalize import _timing, oracle_lent, parse_overrides
from lab.forecast.stress import DAY_S, stress_traces
from lab.forecast.study import run_policy
from tidal.policy.baselines import OraclePolicy


def test_stress_traces_are_seeded_and_stress_what_they_say():
    a, b, c = stress_traces(0), stress_traces(0), stress_traces(1)
    for name in a:
        assert np.array_equal(a[name][1], b[name][1])
        assert not np.array_equal(a[name][1], c[name][1])
        assert (a[name][1] >= 0).all() and np.isfinite(a[name][1]).all()
    day = round(DAY_S / 600.0)
    t, load = a["burst"]
    assert load[:9 * day].max() < 0.8 * load.max()  # the burst is larger than anything before it
    t, load = a["level-shift"]
    assert load[7 * day:].mean() > 1.5 * load[:7 * day].mean()
    t, load = a["holiday-week"]
    assert len(load) == 21 * day
    assert load[7 * day:14 * day].max() < 0.6 * load[:7 * day].max()
    assert load[14 * day:].mean() > 1.5 * load[7 * day:14 * day].mean()
    t, load = a["multi-model"]
    assert load.max() < 3 * load.mean()  # models peaking at different hours fill the day
    with pytest.raises(ValueError, match="unknown stress"):
        stress_traces(0, names=("nope",))


def test_vectorized_oracle_is_the_oracle_policy():
    rng = np.random.default_rng(3)
    d = 60 + 30 * np.sin(np.arange(300) / 20) + rng.normal(0, 8, 300)
    d[[5, 6, 100, 299]] = np.nan
    times = 600.0 * np.arange(300)
    for lead in (1, 2, 3):
        lent, _ = run_policy(
            OraclePolicy(step_s=600.0, horizon_s=6 * 3600.0, timing=_timing(lead, 600.0)),
            times,
            d,
            128,
            future=True,
        )
        assert np.array_equal(lent, oracle_lent(d, 128, lead))


def test_overrides_are_checked():
    assert parse_overrides(["ledger_fraction=0.8"]) == {"ledger_fraction": 0.8}
    assert parse_overrides(["forecast.errors.noise_exponent=0.5"]) == {
        "forecast": {"errors.noise_exponent": 0.5}
    }
    with pytest.raises(ValueError, match="KEY=NUMBER"):
        parse_overrides(["bogus=1"])
    with pytest.raises(ValueError, match="KEY=NUMBER"):  # a forecast setting the product no longer has
        parse_overrides(["forecast.lead.quantile=0.8"])
    with pytest.raises(ValueError, match="not a number"):
        parse_overrides(["ledger_fraction=x"])
    with pytest.raises(ValueError, match="ledger_fraction"):  # a value the config refuses, with its message
        parse_overrides(["ledger_fraction=5"])


def _trace(path, seed: int, days: int = 4) -> None:
    rng = np.random.default_rng(seed)
    t = 600 * np.arange(days * 144)
    load = 100 + 50 * np.sin(2 * np.pi * t / DAY_S + seed) + rng.normal(0, 8, t.size)
    path.write_text(
        "seconds,requests_per_second\n" + "".join(f"{a},{b:.3f}\n" for a, b in zip(t, load, strict=True))
    )


def test_generalize_end_to_end_on_two_traces(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    _trace(a, 1)
    _trace(b, 2)
    res = CliRunner().invoke(app, ["generalize", str(a), str(b), "--budget", "0.01", "--stress", "",
                                   "--workers", "1", "--warmup-days", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(out["traces"]) == {"a", "b"}
    per = out["traces"]["a"]["summary"]["0.01"]
    assert set(per) == {"tidal", "reactive (tuned: b)", "night-window (tuned: b)"}  # tuned on the other one
    assert per["tidal"]["rotations"] == 4  # every whole day
    assert 0 < per["tidal"]["rotation0"]["x_oracle"] <= 1.0 + 1e-9
    bad = CliRunner().invoke(app, ["generalize", str(a), "--stress", ""])
    assert bad.exit_code != 0 and "two real traces" in str(bad.exception)
    bad = CliRunner().invoke(app, ["generalize", str(a), str(b), "--tidal", "nope=1"])
    assert bad.exit_code != 0 and "--tidal" in bad.output

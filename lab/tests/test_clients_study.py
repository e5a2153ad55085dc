"""The regime shifts of ``python -m lab clients`` and its evaluation on a small per-client trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lab.forecast.clients import run, shifted


def test_shifts_change_only_the_days_after_the_shift():
    day = 4
    r = np.arange(14 * day * 2, dtype=float).reshape(14 * day, 2)  # one client and the tail
    new = shifted(r, "double-client", 7 * day, day)
    assert new.shape == (14 * day, 3) and (new[:7 * day, 0] == 0).all()
    assert (new[7 * day:, 0] == 2 * r[7 * day:, 0]).all() and (new[:, 1:] == r).all()
    r8 = np.arange(14 * 8 * 2, dtype=float).reshape(14 * 8, 2)  # 8 windows a day: 3 hours is one
    late = shifted(r8, "peak-3h", 7 * 8, 8)
    assert (late[:7 * 8 + 1] == r8[:7 * 8 + 1]).all() and (late[7 * 8 + 1:] == r8[7 * 8: -1]).all()
    flat = shifted(r, "no-weekend", 7 * day, day)
    assert (flat[9 * day: 10 * day] == r[8 * day: 9 * day]).all()  # day 9 (a Saturday) is day 8, a Friday
    assert (flat[:9 * day] == r[:9 * day]).all()
    with pytest.raises(ValueError, match="shift 'x'"):
        shifted(r, "x", 0, day)


@pytest.mark.slow
def test_the_table_reports_ceilings_and_every_variant_per_rotation_and_size(tmp_path, capsys):
    rows = ["seconds,client,requests_per_second"]
    for i in range(4 * 144):
        t = i * 600
        rows += [f"{t},rest,{3 + np.sin(i / 23):.3f}"] + [f"{t},big,5"] * (60 <= i % 144 < 90)
    path = tmp_path / "c.csv"
    path.write_text("\n".join(rows) + "\n")
    out = run([path], serving_gpus=(16, 64), budgets=(0.01,), rotations=[0, 1], warmup_days=1.0,
              variants=("before", "clients"), as_json=True)
    assert json.loads(capsys.readouterr().out)["config"]["variants"] == ["before", "clients"]
    for n in ("16", "64"):
        tr = out["traces"]["c"][n]
        assert [r["rotation"] for r in tr["runs"]] == [0, 1]
        s = tr["summary"]["0.01"]
        assert set(s) == {"before", "clients", "ceiling_aggregate", "ceiling_clients"}
        assert all(0 <= v["first_rotation_over_oracle"] <= 1.0 + 1e-9 for v in s.values())
        assert s["clients"]["met"] == 2 and s["clients"]["rotations"] == 2
    with pytest.raises(ValueError, match="--variants: unknown"):
        run([path], variants=("nope",))

"""Per-client traces (tidal.serving.client_traces) and the client
level demand model (tidal.policy.clients)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest

from tidal.policy import codec
from tidal.policy.clients import (
    ClientConfig,
    client_forecast,
    initial_clients,
    observe_clients,
    reserve_factor,
)
from tidal.policy.forecast import Forecast, ForecastConfig
from tidal.policy.loan import LoanContext, TidalPolicy
from tidal.serving.client_traces import is_client_trace, load_client_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _write(path: Path, text: str, gz: bool) -> Path:
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_client_trace_folds_the_tail_and_marks_gaps(tmp_path, gz):
    rows = ["seconds,client,requests_per_second,interarrival_cv", "0,a,5,1", "0,b,1,1", "0,c,2,1",
            "600,a,4,1", "600,z,0.5,1", "1800,b,3,1"]
    p = _write(tmp_path / "t.csv.gz", "\n".join(rows) + "\n", gz)
    assert is_client_trace(p)
    ct = load_client_trace(p, max_clients=2)
    assert ct.clients == ("a", "b", "other") and ct.step_s == 600
    assert ct.rates[:2].tolist() == [[5, 1, 2], [4, 0, 0.5]]
    assert np.isnan(ct.rates[2]).all() and ct.rates[3].tolist() == [0, 3, 0]
    total = ct.total(0.0)
    assert total.load.tolist() == [8, 4.5, 0, 3] and total.gap.tolist() == [False, False, True, False]


def test_client_trace_errors_name_file_and_line(tmp_path):
    agg = _write(tmp_path / "agg.csv", "seconds,requests_per_second\n0,1\n600,2\n", False)
    assert not is_client_trace(agg)
    with pytest.raises(ValueError, match=r"agg.csv:1: expected the header"):
        load_client_trace(agg)
    head = "seconds,client,requests_per_second\n"
    for body, where in (("0,a,1\n600,a,x\n", ":3: time"), ("0,a,1\n600,,2\n", ":3: expected"),
                        ("0,a,1\n600,a,-2\n", ":3: time and rate"),
                        ("0,a,1\n600,a,1\n1500,a,1\n", ":4: time 1500")):
        with pytest.raises(ValueError, match=where):
            load_client_trace(_write(tmp_path / "c.csv", head + body, False))
    with pytest.raises(ValueError, match="at least two windows"):
        load_client_trace(_write(tmp_path / "c.csv", head + "0,a,1\n", False))


def test_many_clients_stay_bounded(tmp_path):
    rows = ["seconds,client,requests_per_second"] + [f"{t},{c},1" for t in (0, 600) for c in range(10_000)]
    ct = load_client_trace(_write(tmp_path / "c.csv", "\n".join(rows), True), max_clients=4)
    assert ct.rates.shape == (2, 5) and ct.rates[:, -1].tolist() == [9996, 9996]


@pytest.mark.skipif(not (TRACES / "servegen-language-m-mid-clients.csv.gz").exists(), reason="no traces")
def test_servegen_clients_sum_to_the_aggregate():
    from tidal.serving.traces import load_trace

    ct = load_client_trace(TRACES / "servegen-language-m-mid-clients.csv.gz")
    agg = load_trace(TRACES / "servegen-language-m-mid.csv")
    total = ct.total()
    assert np.allclose(total.load, agg.load, atol=0.01) and (total.gap == agg.gap).all()


FC = ForecastConfig(step_s=600.0, horizon_s=6 * 3600.0)


def _day(t0: float, days: int, weekday_only: bool) -> np.ndarray:
    """One big client on 9:00-12:00 (weekdays only, if asked), a small one always on; the tail constant."""
    out = []
    for i in range(days * 144):
        t = t0 + i * 600.0
        weekend = (t // 86400 + 3) % 7 >= 5
        on = 9 <= (t % 86400) / 3600 < 12 and not (weekday_only and weekend)
        out.append([50.0 if on else 0.0, 2.0, 10.0])
    return np.array(out)


def _scale_at(state, t_s: float) -> float:
    agg = Forecast(t_s, t_s + 600.0 * np.arange(1, FC.horizon_steps + 1), np.full(FC.horizon_steps, 10.0),
                   np.full(FC.horizon_steps, 1.0))
    return float(client_forecast(ClientConfig(heavy=2), FC, state, agg).scale_gpus[1])  # 20 minutes ahead


def test_switch_on_risk_follows_the_hour_and_the_day_type():
    """The big client's start widens the scale before 9:00 on a weekday, not at night nor on a weekend."""
    cfg = ClientConfig(heavy=2)
    t0 = 4 * 86400.0  # a Monday (Unix time)
    ys = _day(t0, 14, weekday_only=True)
    st = initial_clients(cfg)
    for i, y in enumerate(ys):
        st = observe_clients(cfg, FC, st, t0 + 600.0 * i, y)
    monday = t0 + 14 * 86400.0
    def at(t):  # the state as at t (the last steps replayed from the same history, the client off)
        s = st
        for k in range(1, 4):
            s = observe_clients(cfg, FC, s, t - 600.0 * (4 - k), np.array([0.0, 2.0, 10.0]))
        return _scale_at(s, t)
    before_nine, night = at(monday + 8 * 3600 + 2400), at(monday + 2 * 3600)  # 20 minutes before 9:00
    saturday = at(monday + 5 * 86400 + 8 * 3600 + 2400)
    assert before_nine > 15 and night < 3 and saturday < 0.5 * before_nine
    assert math.isclose(_scale_at(initial_clients(cfg), monday), 1.0)  # nothing seen: the aggregate's own


def test_policy_says_which_forecaster_served_and_its_state_round_trips():
    pol = TidalPolicy.build(0.005, 600.0, horizon_s=6 * 3600.0)
    st = pol.initial_state()
    ys = _day(4 * 86400.0, 3, weekday_only=False)
    for i, y in enumerate(ys):
        t = 4 * 86400.0 + 600.0 * i
        plan, st = pol(LoanContext(t, 128, float(y.sum()), client_gpus=y if i < len(ys) - 1 else None), st)
        if i == len(ys) - 2:
            assert plan.forecaster == "clients"
    assert plan.forecaster == "aggregate"  # the last step came without a breakdown
    again = codec.decode(codec.encode(st))
    assert again.clients is not None and (again.clients.up == st.clients.up).all()
    with pytest.raises(ValueError, match="reserve_floor in"):
        ClientConfig(reserve_floor=0.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        observe_clients(ClientConfig(), FC, st.clients, 1e9, np.array([-1.0, 0.0]))


def test_advisor_replays_a_per_client_trace_through_the_client_model(tmp_path):
    """`tidal serving watch` and the plane's advisor: a per-client trace replays its total and, per
    client, what the policy's client model reads; the same trace in total uses the aggregate forecast."""
    from tidal.serving.sources import replay_of
    from tidal.serving.watch import Advisor

    rows = ["seconds,client,requests_per_second"]
    rows += [f"{i * 600},{c},{x}" for i in range(288)
             for c, x in (("big", 5.0 * (i % 144 > 60)), ("rest", 3.0)) if x > 0]
    path = _write(tmp_path / "c.csv.gz", "\n".join(rows), True)
    total = tmp_path / "total.csv"
    total.write_text("seconds,requests_per_second\n" + "".join(
        f"{i * 600},{3.0 + 5.0 * (i % 144 > 60)}\n" for i in range(288)))
    got = {}
    for p in (path, total):
        src = replay_of(str(p), 16, None, None)
        adv = Advisor(src, TidalPolicy.build(0.005, 600.0, horizon_s=6 * 3600.0), 16)
        for i in range(150):
            step = adv.tick(i * 600.0)
        assert step is not None and math.isclose(step.demand_gpus, 6.0)  # 3 of a peak of 8
        got[p.name] = step.plan.forecaster
    assert got == {"c.csv.gz": "clients", "total.csv": "aggregate"}
    assert replay_of(str(path), 16, None, None).clients_at(-1.0) is None  # before the replay's start


def test_the_tail_reserve_follows_the_switch_on_risk():
    """With ``reserve_floor`` the reserve shrinks while no heavy client can switch on (the big one is on)
    and grows before its usual start; the policy keeps the mean risk across observations."""
    from dataclasses import replace

    base = TidalPolicy.build(0.005, 600.0, horizon_s=6 * 3600.0).config
    cfg = ClientConfig(heavy=2, reserve_floor=0.5)
    pol = TidalPolicy(replace(base, clients=cfg))
    t0, ys = 4 * 86400.0, _day(4 * 86400.0, 4, weekday_only=False)
    st = pol.initial_state()
    for i, y in enumerate(ys):
        _, st = pol(LoanContext(t0 + 600.0 * i, 128, float(y.sum()), client_gpus=y), st)
    cs = st.clients
    assert cs is not None and math.isfinite(cs.risk_mean) and cs.risk_mean > 0

    def factor(hour: float, big: float) -> float:
        t = t0 + 4 * 86400.0 + hour * 3600.0
        s = observe_clients(cfg, FC, cs, t, np.array([big, 2.0, 10.0]))
        agg = Forecast(t, t + 600.0 * np.arange(1, FC.horizon_steps + 1), np.full(FC.horizon_steps, 10.0),
                       np.full(FC.horizon_steps, 1.0))
        return reserve_factor(cfg, FC, s, agg, client_forecast(cfg, FC, s, agg), 1, False)[0]

    assert factor(10.0, 50.0) == 0.5 and factor(8 + 40 / 60, 0.0) == 2.0  # on at 10:00; off at 8:40

"""Forecast history for the Ray Serve adapter (tidal.serving.serve_history): a request-rate trace of
earlier days read through the real Erlang C request model, the demand the adapter measured kept in its
persist/resume document (bounded) across a restart, and a restart whose stored forecast no longer fits
(step_s changed) learning afresh from it. Serve's RPCs are recorded at our own seams (no Ray)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from test_serving_ray_serve import BASE, Recorded
from tidal.control.loans import LiveLoans, build_live_loans
from tidal.policy.loan import LoanTiming
from tidal.serving.serve_history import MAX_HISTORY_DAYS, MAX_MEASURED, MeasuredHistory
from tidal.serving.traces import load_trace
from tidal.serving.watch import WatchConfig

DAY = 86400.0
STEP = 600.0
TIMING = LoanTiming(notice_s=1, final_checkpoint_s=1, release_s=0, warmup_s=1, restart_cost_s=1)


def day_trace(path, days: int = 2, step: float = STEP) -> Any:
    """requests/s on the serving clock from 0: 20/s at night, 60/s by day."""
    rows = ["seconds,requests_per_second"]
    for i in range(int(days * DAY / step)):
        t = i * step
        rows.append(f"{t:g},{20 + 40 * (math.sin(2 * math.pi * t / DAY) > 0):g}")
    path.write_text("\n".join(rows) + "\n")
    return path


class Measuring(Recorded):
    """Recorded, with the router's counts set by the test (``stats``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.stats: dict[str, Any] = {}

    def _sync(self, slots):
        super()._sync(slots)
        return dict(self.stats)


def test_the_first_day_is_planned_from_a_request_rate_trace_of_earlier_days(tmp_path):
    p = day_trace(tmp_path / "earlier.csv")
    cfg = WatchConfig.from_dict({**BASE, "trace": str(p), "history_days": 2, "service_rate_per_replica": 20.0,
                                 "start_s": 2 * DAY})
    loans = build_live_loans(cfg)  # reads and checks the trace; Ray not contacted
    assert loans.adapter.trace is not None and "learns 2 days" in cfg.describe()
    a = Measuring(service_rate_per_replica=20.0, history_days=2, start_s=2 * DAY)
    a.trace = load_trace(p)
    pts = a.forecast_history(2 * DAY, STEP)
    assert len(pts) == 288 and pts[0][0] == 0.0 and pts[-1][0] == 2 * DAY - STEP
    model = a.s.model(20.0)  # the adapter's own Erlang C model at the configured service rate
    assert {y for _, y in pts} == {float(model.gpus(20.0)), float(model.gpus(60.0))}
    assert model.gpus(20.0) < model.gpus(60.0) <= 4
    live = LiveLoans(a, TIMING, step_s=STEP)
    events = live.tick(1000.0, {})
    fs = live.state.forecast  # the history, then the first live step (demand unknown: nothing counted yet)
    assert fs.n_obs == 288 and fs.t_s == 2 * DAY, fs
    assert ("serving_history", "the forecast learned 288 steps of history", {"steps": 288}) in events
    # once the adapter has measured a service rate, a trace is read at that one, and what it measured wins
    b = Measuring(service_rate_per_replica=20.0, history_days=2)
    b.trace = a.trace
    b.measured.add(2 * DAY - STEP, 30.0, 10.0, 3.0)
    pts = dict(b.forecast_history(2 * DAY, STEP))
    assert pts[2 * DAY - STEP] == 3.0 and pts[0.0] == float(b.s.model(10.0).gpus(20.0))


def test_measured_demand_survives_a_restart_and_a_changed_step_relearns_from_it():
    a = Measuring(speedup=10.0, start_s=0.0, min_samples=5)
    a.stats = {"window_s": 10.0, "arrivals": 400, "completed": 390, "service_sum_s": 390 * 0.05}
    loans = LiveLoans(a, TIMING, step_s=STEP)
    for i in range(40):  # 40 x 30 s at 10x: 20 grid steps of 600 s
        loans.tick(1000.0 + 30.0 * i, {})
    assert len(a.measured) == 20 and a.measured.service_rate() == pytest.approx(20.0)
    assert all(g == a.s.model(20.0).gpus(40.0) for _, _, _, g in a.measured.rows)
    doc = loans.dump()
    # a restarted plane: the same doc, the measured history and the forecast continue
    b = Measuring(speedup=10.0, start_s=0.0, min_samples=5)
    again = LiveLoans(b, TIMING, step_s=STEP)
    again.load(doc)
    assert b.measured.rows == a.measured.rows and again.state.forecast.n_obs == loans.state.forecast.n_obs
    # restarted with another step_s: was an IndexError in every reconcile step; now it learns afresh from
    # what the adapter measured (re-gridded), and says so
    c = Measuring(speedup=10.0, start_s=0.0, min_samples=5)
    c.stats = a.stats
    other = LiveLoans(c, TIMING, step_s=300.0)
    other.load(doc)
    events = other.tick(1000.0 + 30.0 * 40, {})
    said = [e for e in events if e[0] == "serving_history"]
    assert said and "another step_s" in said[0][1] and said[0][2]["steps"] == 20, events
    assert other.state.forecast.n_obs >= 20
    for i in range(10):
        other.tick(1000.0 + 30.0 * (41 + i), {})  # the loop goes on


def test_the_measured_history_is_bounded_and_a_damaged_one_is_refused():
    long = [[float(i), 1.0, 2.0, 1.0] for i in range(MAX_MEASURED + 500)]
    h = MeasuredHistory.from_doc(long)
    assert len(h) == MAX_MEASURED and h.rows[0][0] == 500.0  # the newest kept
    h.add(10.0, 1.0, None, 1.0)  # a time not after the newest: ignored
    assert len(h) == MAX_MEASURED and h.rows[-1][0] == MAX_MEASURED + 499.0
    for bad in ([[0.0, -1.0, 2.0, 1.0]], [[0.0, 1.0, 0.0, 1.0]], [[0.0, float("nan"), 2.0, 1.0]],
                [[0.0, 1.0, 2.0]], "rows", [[None, 1.0, 2.0, 1.0]]):
        with pytest.raises(ValueError, match="measured"):
            MeasuredHistory.from_doc(bad)
    a = Measuring()
    loans = LiveLoans(a, TIMING, step_s=STEP)
    doc = loans.dump()
    doc["adapter"]["measured"] = [[0.0, 1.0, 0.0, 1.0]]  # a service rate of 0
    with pytest.raises(ValueError, match=r"serving document .* damaged: measured\[0\]") as e:
        LiveLoans(Measuring(), TIMING, step_s=STEP).load(doc)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("body, says", [
    ("seconds,requests_per_second\n0,1\n600,nan\n1200,2\n", "must be finite and >= 0"),
    ("seconds,requests_per_second\n0,1\n600,-3\n1200,2\n", "must be finite and >= 0"),
    ("", "expected a header and at least two rows"),
    ("seconds,requests_per_second\n", "expected a header and at least two rows"),
    ("seconds,requests_per_second\n0,1\n600,1e15\n", "more than"),  # a flood no pool meets
])
def test_a_bad_history_trace_is_one_line_naming_the_file_before_anything_starts(tmp_path, body, says):
    p = tmp_path / "earlier.csv"
    p.write_text(body)
    cfg = WatchConfig.from_dict({**BASE, "trace": str(p), "history_days": 1,
                                 "service_rate_per_replica": 20.0})
    with pytest.raises(ValueError) as e:
        build_live_loans(cfg)
    msg = str(e.value)
    assert says in msg and "earlier" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("change, says", [
    ({"trace": "x.csv"}, "serving.trace and serving.history_days go together"),
    ({"history_days": 1}, "serving.trace and serving.history_days go together"),
    ({"trace": "x.csv", "history_days": 1}, "needs serving.service_rate_per_replica"),
    ({"trace": "x.csv", "history_days": MAX_HISTORY_DAYS + 1, "service_rate_per_replica": 1.0},
     "serving.history_days must be a number from 0 to 28"),
    # a service time of 0 (a rate of 0) was taken for "no prior", silently
    ({"service_rate_per_replica": 0}, "serving.service_rate_per_replica"),
    ({"service_rate_per_replica": float("inf")}, "serving.service_rate_per_replica"),
    ({"service_rate_per_replica": -2}, "serving.service_rate_per_replica"),
])
def test_history_settings_errors_name_the_field(change, says):
    with pytest.raises(ValueError, match=says):
        WatchConfig.from_dict({**BASE, **change})


def test_a_replay_history_longer_than_the_bound_is_refused_not_built():
    # was accepted: history_days 1e8 built 1.4e10 points at tidal up
    with pytest.raises(ValueError, match="serving.history_days must be a number from 0 to 28"):
        WatchConfig.from_dict({"trace": "x.csv", "nodes": "1x2", "history_days": 1e8})


def test_a_trace_with_gaps_is_unknown_there_not_zero(tmp_path):
    p = tmp_path / "gappy.csv"
    p.write_text("seconds,rps\n" + "".join(f"{i * 600},{0 if 10 <= i < 20 else 30}\n" for i in range(144)))
    a = Measuring(service_rate_per_replica=20.0, history_days=1)
    a.trace = load_trace(p)
    ys = np.array([y for _, y in a.forecast_history(DAY, STEP)])
    assert len(ys) == 144 and np.isnan(ys[10:20]).all() and not np.isnan(ys[:10]).any()

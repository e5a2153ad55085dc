"""Serving load traces: CSV in, regular demand series (GPUs) out.

A trace file is a CSV with a header row, one time column and one load column:

* time: seconds (``seconds``, ``time_s``, ``t``, …: any number, e.g. seconds from trace start or Unix
  time) or ISO-8601 timestamps (``2024-05-01T00:10:00Z``; naive timestamps are read as UTC);
* load: any non-negative rate that serving capacity must follow (requests/s, tokens/s, busy GPUs).

By default the time column is the first column whose name contains ``time``, ``second`` or ``date``
(else the first column) and the load column is the first other numeric column; both can be named.
Rows must be in increasing time order and evenly spaced (the step is the median spacing; a
missing row is an error that names the line, because the forecast works on a fixed grid).

**Gaps.** Telemetry outages show up in recorded traces as windows of (almost) zero load: the
ServeGen m-mid trace has runs of 0.0 for up to four hours, after which the load resumes at its
previous level. A live system must read a metrics outage as *unknown* demand, never as *zero*
demand (lending the whole pool during an outage would be a disaster when the metrics come back).
:func:`load_trace` therefore marks as a gap every row whose load is below ``gap_below_fraction`` of
the median load (default 1 %), and :func:`Trace.demand_gpus` returns NaN there. The policies treat
NaN as "no observation" and evaluations skip those rows when scoring. Pass
``gap_below_fraction=0`` to keep every row as recorded.

**Demand.** A pool of ``serving_gpus`` GPUs is sized for the trace's own peak (over non-gap rows),
so demand at time t is ``serving_gpus * load(t) / peak`` GPUs (fractional; capacity comes in whole
GPUs, the loan plan rounds).

**Requests.** When the load column is a request rate (requests/s, e.g. ServeGen's
``seconds,requests_per_second``) and the operator states how fast a replica serves and a latency
target (:class:`tidal.serving.requests.RequestModel`), :meth:`Trace.request_demand_gpus` gives demand
in GPUs directly, from the Erlang C queue, with no pool scaling: the GPUs that meet the target at
each row's rate (whole replicas), NaN at gaps.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tidal.serving.requests import RequestModel

TIME_HINTS = ("time", "second", "date", "timestamp")


@dataclass(frozen=True, eq=False)
class Trace:
    """One serving load trace on a regular grid.

    ``times_s[i]`` is the time of row i in seconds (as in the file, or Unix seconds for ISO-8601),
    ``load`` its load in the file's unit, ``gap`` whether row i is a telemetry gap (see the module
    docstring). Arrays are read-only.
    """

    name: str
    times_s: np.ndarray
    load: np.ndarray
    gap: np.ndarray
    step_s: float
    load_column: str

    @property
    def peak_load(self) -> float:
        """The largest load outside gaps: the load a full serving pool is sized for."""
        ok = self.load[~self.gap]
        return float(ok.max()) if ok.size else 0.0

    def demand_gpus(self, serving_gpus: int) -> np.ndarray:
        """Demand in GPUs for a pool of ``serving_gpus`` sized for the peak; NaN at gaps."""
        if serving_gpus <= 0:
            raise ValueError(f"serving_gpus must be positive, got {serving_gpus}")
        peak = self.peak_load
        if peak <= 0:
            raise ValueError(f"trace {self.name!r}: no positive load outside gaps, cannot size a pool")
        out = serving_gpus * self.load / peak
        out[self.gap] = np.nan
        out.flags.writeable = False
        return out

    def request_demand_gpus(self, model: RequestModel) -> np.ndarray:
        """Demand in GPUs when the load is requests/s: ``model.gpus(load)`` per row, NaN at gaps."""
        from tidal.serving.requests import request_demand_gpus

        try:
            return request_demand_gpus(self.load, self.gap, model)
        except ValueError as e:
            raise ValueError(f"trace {self.name!r} ({self.load_column}): {e}") from None

    def resample(self, step_s: float | None) -> Trace:
        """This trace at ``step_s`` (a whole multiple of its step; ``None``: itself): a coarse row is the
        mean of its rows at the time of the first, and a gap if any of them is (its mean would mix in
        the outage's zeros). Rows that do not fill a last coarse step are dropped."""
        if step_s is None:
            return self
        k = step_s / self.step_s
        if abs(k - round(k)) > 1e-6 or round(k) < 1:
            raise ValueError(f"step {step_s:g} s must be a whole multiple of the trace {self.name!r} step "
                             f"({self.step_s:g} s)")
        k = round(k)
        n = len(self.load) // k
        if n < 2:
            raise ValueError(f"trace {self.name!r} is shorter than two {step_s:g} s steps")
        times = np.array(self.times_s[: n * k : k])
        load = self.load[: n * k].reshape(n, k).mean(axis=1)
        gap = np.asarray(self.gap[: n * k].reshape(n, k).any(axis=1))
        for a in (times, load, gap):
            a.flags.writeable = False
        return replace(self, times_s=times, load=load, gap=gap, step_s=float(step_s))

    @property
    def duration_s(self) -> float:
        return float(self.times_s[-1] - self.times_s[0] + self.step_s)


def parse_time(text: str) -> float:
    """Seconds from a number or an ISO-8601 timestamp (naive = UTC). Raises ValueError."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    iso = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    dt = datetime.fromisoformat(iso)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _pick_columns(header: list[str], time_column: str | None, load_column: str | None,
                  path: Path) -> tuple[int, int]:
    names = [h.strip() for h in header]
    lowered = [n.lower() for n in names]

    def index_of(name: str, role: str) -> int:
        if name not in names:
            raise ValueError(f"{path}: no column {name!r} for the {role} (columns: {', '.join(names)})")
        return names.index(name)

    if time_column is not None:
        ti = index_of(time_column, "time")
    else:
        ti = next((i for i, n in enumerate(lowered) if any(h in n for h in TIME_HINTS)), 0)
    if load_column is not None:
        li = index_of(load_column, "load")
    else:
        others = [i for i in range(len(names)) if i != ti]
        if not others:
            raise ValueError(f"{path}: needs a time column and a load column, found only {names}")
        li = others[0]
    if li == ti:
        raise ValueError(f"{path}: time and load column are the same ({names[ti]!r})")
    return ti, li


def load_trace(path: str | Path, *, time_column: str | None = None, load_column: str | None = None,
               gap_below_fraction: float = 0.01, name: str | None = None) -> Trace:
    """Read a serving trace CSV (see the module docstring for the format and the gap rule).

    Raises ``ValueError`` naming the file, line and column for anything malformed: a non-numeric
    load, a negative load, times out of order, or uneven spacing.
    """
    path = Path(path)
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if len(rows) < 3:
        raise ValueError(f"{path}: expected a header and at least two rows, found {len(rows)} lines")
    header, body = rows[0], rows[1:]
    ti, li = _pick_columns(header, time_column, load_column, path)
    times, loads = [], []
    for n, r in enumerate(body, start=2):
        if max(ti, li) >= len(r):
            raise ValueError(f"{path}:{n}: expected at least {max(ti, li) + 1} columns, found {len(r)}")
        try:
            t = parse_time(r[ti])
        except ValueError:
            raise ValueError(f"{path}:{n}: time {r[ti]!r} in column {header[ti]!r} is neither seconds "
                             "nor ISO-8601") from None
        try:
            x = float(r[li])
        except ValueError:
            raise ValueError(f"{path}:{n}: load {r[li]!r} in column {header[li]!r} is not a number") from None
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"{path}:{n}: load {r[li]!r} in column {header[li]!r} must be finite and >= 0")
        times.append(t)
        loads.append(x)
    t_arr = np.asarray(times, dtype=float)
    dt = np.diff(t_arr)
    if np.any(dt <= 0):
        bad = int(np.argmax(dt <= 0)) + 3
        raise ValueError(f"{path}:{bad}: time does not increase (column {header[ti]!r})")
    step = float(np.median(dt))
    off = np.abs(dt - step) > 1e-6 * step + 1e-9
    if np.any(off):
        bad = int(np.argmax(off)) + 3
        raise ValueError(
            f"{path}:{bad}: rows must be evenly spaced every {step:g} s; this row is "
            f"{dt[bad - 3]:g} s after the previous one (fill missing rows with 0 load to mark a gap)"
        )
    load = np.asarray(loads, dtype=float)
    if not 0 <= gap_below_fraction < 1:
        raise ValueError(f"gap_below_fraction must be in [0, 1), got {gap_below_fraction}")
    gap = (
        load < gap_below_fraction * float(np.median(load))
        if gap_below_fraction > 0
        else np.zeros_like(load, bool)
    )
    for a in (t_arr, load, gap):
        a.flags.writeable = False
    return Trace(name=name or path.stem, times_s=t_arr, load=load, gap=gap, step_s=step,
                 load_column=header[li].strip())

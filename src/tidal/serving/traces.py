"""Serving load traces: CSV in, regular demand series (GPUs) out.

A trace is a CSV with a header, a time column (seconds, or ISO-8601 read as UTC when naive; by default
the first whose name contains ``time``, ``second`` or ``date``) and a load column (any non-negative
rate serving must follow; by default the first other numeric one). Rows are in increasing time and
evenly spaced (a missing row is an error naming the line: the forecast works on a fixed grid).

**Gaps.** A metrics outage shows as (almost) zero load and must read as *unknown* demand, never zero
(lending the whole pool then would be a disaster): rows below ``gap_below_fraction`` of the median load
are gaps, where demand is NaN. **Demand**: ``serving_gpus * load / peak``; or, with a request rate and a
:class:`~tidal.serving.requests.RequestModel`, the GPUs that meet the latency target
(:meth:`Trace.request_demand_gpus`).
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
    """One serving load trace on a regular grid: ``times_s`` (seconds as in the file, or Unix seconds for
    ISO-8601), ``load`` in the file's unit, ``gap`` per row; read-only arrays."""

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
        """This trace at ``step_s`` (a whole multiple; ``None``: itself): a coarse row is the mean of its
        rows, a gap if any of them is; a last partial step is dropped."""
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
    """Read a serving trace CSV; ``ValueError`` naming the file, line and column of anything malformed."""
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
        raise ValueError(f"{path}:{bad}: rows must be evenly spaced every {step:g} s; this row is "
                         f"{dt[bad - 3]:g} s after the previous one (fill missing rows with 0 load to mark a "
                         "gap)")
    load = np.asarray(loads, dtype=float)
    if not 0 <= gap_below_fraction < 1:
        raise ValueError(f"gap_below_fraction must be in [0, 1), got {gap_below_fraction}")
    gap = load < gap_below_fraction * float(np.median(load))  # (none with a fraction of 0)
    for a in (t_arr, load, gap):
        a.flags.writeable = False
    return Trace(name=name or path.stem, times_s=t_arr, load=load, gap=gap, step_s=step,
                 load_column=header[li].strip())

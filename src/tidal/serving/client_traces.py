"""Per-client serving traces: ``seconds, client, requests_per_second[, interarrival_cv]`` rows (gzip or
plain CSV), one row per client and window in which it sent requests.

Bounded: the ``max_clients`` largest clients (by requests) keep a column each, the rest are folded into one
``other`` column, so memory is the number of windows times ``max_clients + 1`` whatever the number of
distinct clients. A window a client does not list is 0 for it; a window no client lists is a gap (NaN).
"""

from __future__ import annotations

import csv
import gzip
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from tidal.serving.traces import Trace, load_trace, parse_time

CLIENT_COLUMNS = ("seconds", "client", "requests_per_second")
OTHER = "other"


def is_client_trace(path: str | Path) -> bool:
    """Whether ``path`` (gzip or plain) starts with the per-client header."""
    with _open(Path(path)) as f:
        header = next(csv.reader(f), [])
    return tuple(h.strip() for h in header[:3]) == CLIENT_COLUMNS


def _open(path: Path) -> TextIO:
    with path.open("rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", newline="") if gz else path.open(newline="")


@dataclass(frozen=True, eq=False)
class ClientTrace:
    """Rates per window (rows, on ``step_s`` from ``times_s[0]``) and client (columns ``clients``, the folded
    tail last as ``other``); read-only arrays."""

    name: str
    times_s: np.ndarray
    rates: np.ndarray
    clients: tuple[str, ...]
    step_s: float

    def total(self, gap_below_fraction: float = 0.01) -> Trace:
        """The aggregate trace (the sum over clients); gaps as :func:`~tidal.serving.traces.load_trace`'s."""
        load = np.nansum(self.rates, axis=1)
        gap = np.isnan(self.rates).all(axis=1) | (load < gap_below_fraction * float(np.median(load)))
        for a in (load, gap):
            a.flags.writeable = False
        return Trace(name=self.name, times_s=self.times_s, load=load, gap=gap, step_s=self.step_s,
                     load_column=CLIENT_COLUMNS[2])

    def resample(self, step_s: float) -> ClientTrace:
        """Means over whole multiples of the step (a last partial step dropped)."""
        k = round(step_s / self.step_s)
        if k < 1 or abs(k * self.step_s - step_s) > 1e-6:
            raise ValueError(f"step {step_s:g} s: not a whole multiple of {self.name!r}'s {self.step_s:g} s")
        n = len(self.times_s) // k
        rates = self.rates[: n * k].reshape(n, k, -1).mean(axis=1)
        times = np.array(self.times_s[: n * k: k])
        for a in (rates, times):
            a.flags.writeable = False
        return ClientTrace(self.name, times, rates, self.clients, float(step_s))


def read_trace(path: str | Path, step_s: float | None = None) -> tuple[Trace, ClientTrace | None]:
    """A serving trace of either format (told apart by the header) at ``step_s``: (its total, its
    clients or None)."""
    if not is_client_trace(path):
        return load_trace(path).resample(step_s), None
    clients = load_client_trace(path)
    clients = clients.resample(step_s) if step_s is not None else clients
    return clients.total(), clients


def _rows(path: Path) -> Iterator[tuple[int, float, str, float]]:
    with _open(path) as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if tuple(header[:3]) != CLIENT_COLUMNS:
            raise ValueError(f"{path}:1: expected the header {','.join(CLIENT_COLUMNS)}[,...], got "
                             f"{','.join(header)!r}")
        for line, r in enumerate(reader, start=2):
            if not r or not any(c.strip() for c in r):
                continue
            if len(r) < 3 or not r[1].strip():
                raise ValueError(f"{path}:{line}: expected seconds, client, requests_per_second; got {r!r}")
            try:
                t, x = parse_time(r[0]), float(r[2])
            except ValueError:
                raise ValueError(f"{path}:{line}: time {r[0]!r} or rate {r[2]!r} is not a number") from None
            if not (math.isfinite(t) and math.isfinite(x) and x >= 0):
                raise ValueError(f"{path}:{line}: time and rate must be finite, the rate >= 0; got {r[:3]!r}")
            yield line, t, r[1].strip(), x


def load_client_trace(path: str | Path, *, max_clients: int = 32, step_s: float | None = None,
                      name: str | None = None) -> ClientTrace:
    """Read a per-client trace (two passes: the clients' totals and the grid, then the rates).
    ``ValueError`` naming the file and line of anything malformed; times off the grid included."""
    path = Path(path)
    if max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    totals: dict[str, float] = {}
    times: set[float] = set()
    for _, t, c, x in _rows(path):
        totals[c] = totals.get(c, 0.0) + x
        times.add(t)
    if len(times) < 2:
        raise ValueError(f"{path}: expected rows in at least two windows, found {len(times)}")
    grid = np.array(sorted(times))
    step = float(step_s if step_s is not None else np.min(np.diff(grid)))
    top = sorted(totals, key=lambda c: (-totals[c], c))[:max_clients]
    col = {c: i for i, c in enumerate(top)}
    rows = round((grid[-1] - grid[0]) / step) + 1
    rates = np.zeros((rows, len(top) + 1))
    seen = np.zeros(rows, dtype=bool)
    for line, t, c, x in _rows(path):
        k = (t - grid[0]) / step
        if abs(k - round(k)) > 1e-6:
            raise ValueError(f"{path}:{line}: time {t:g} is not on the {step:g} s grid from {grid[0]:g}")
        rates[round(k), col.get(c, len(top))] += x
        seen[round(k)] = True
    rates[~seen] = np.nan
    times_s = grid[0] + step * np.arange(rows)
    for a in (rates, times_s):
        a.flags.writeable = False
    return ClientTrace(name or path.name.split(".")[0], times_s, rates, (*top, OTHER), step)

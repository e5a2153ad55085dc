"""Serving demand for the simulator: a trace CSV on the simulation's grid, in GPUs.

A pool of ``serving_gpus`` GPUs serves the trace's peak (:mod:`tidal.serving.traces`), so demand at
step i is ``serving_gpus * load_i / peak`` GPUs; telemetry gaps are NaN (unknown, never zero).
The simulation's clock starts at 0 at the trace's first row; a trace shorter than the run repeats
(the engine tiles it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.serving.requests import RequestModel
from tidal.serving.requests import request_demand_gpus as request_demand_gpus_of
from tidal.serving.traces import Trace, load_trace


def resample(trace: Trace, step_s: float | None) -> tuple[np.ndarray, np.ndarray, float]:
    """(load, gap) at ``step_s`` (a whole multiple of the trace's step; ``None``: as recorded), and the
    step. A coarse step is the mean of its rows, and a gap if any of them is."""
    if step_s is None:
        return np.asarray(trace.load), np.asarray(trace.gap), trace.step_s
    k = step_s / trace.step_s
    if abs(k - round(k)) > 1e-6 or round(k) < 1:
        raise ValueError(f"step_s={step_s:g} must be a whole multiple of the trace {trace.name!r} step "
                         f"({trace.step_s:g} s)")
    k = round(k)
    n = len(trace.load) // k
    if n < 2:
        raise ValueError(f"trace {trace.name!r} is shorter than two {step_s:g} s steps")
    load = trace.load[: n * k].reshape(n, k).mean(axis=1)
    gap = np.asarray(trace.gap[: n * k].reshape(n, k).any(axis=1))
    return load, gap, float(step_s)


def demand_gpus(
    path: str | Path, serving_gpus: int, step_s: float | None = None
) -> tuple[np.ndarray, float, str]:
    """(demand per step in GPUs with NaN at gaps, step_s, trace name) for a pool of ``serving_gpus``."""
    trace = load_trace(path)
    load, gap, step = resample(trace, step_s)
    ok = load[~gap]
    peak = float(ok.max()) if ok.size else 0.0
    if peak <= 0:
        raise ValueError(f"{path}: no positive load outside gaps; cannot size a serving pool")
    d = serving_gpus * load / peak
    d[gap] = np.nan
    if 86400.0 % step > 1e-6:
        raise ValueError(f"{path}: the step ({step:g} s) must divide a day (the forecast's period)")
    return d, step, trace.name


def request_demand_gpus(path: str | Path, model: RequestModel,
                        step_s: float | None = None) -> tuple[np.ndarray, float, str]:
    """As :func:`demand_gpus` for a trace of request rates (requests/s): demand per step is
    ``model.gpus(mean rate of the step)`` (Erlang C, :mod:`tidal.serving.requests`), not scaled to a
    pool; NaN at gaps."""
    trace = load_trace(path)
    load, gap, step = resample(trace, step_s)
    if 86400.0 % step > 1e-6:
        raise ValueError(f"{path}: the step ({step:g} s) must divide a day (the forecast's period)")
    return np.array(request_demand_gpus_of(load, gap, model)), step, trace.name

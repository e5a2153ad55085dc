"""Serving demand for the simulator: a trace CSV on the simulation's grid, in GPUs (NaN at gaps). The
clock starts at 0 at the trace's first row; a shorter trace repeats."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.serving.requests import RequestModel
from tidal.serving.traces import Trace, load_trace


def _trace(path: str | Path, step_s: float | None) -> Trace:
    trace = load_trace(path).resample(step_s)
    if 86400.0 % trace.step_s > 1e-6:
        raise ValueError(f"{path}: the step ({trace.step_s:g} s) must divide a day (the forecast's period)")
    return trace


def demand_gpus(path: str | Path, serving_gpus: int,
                step_s: float | None = None) -> tuple[np.ndarray, float, str]:
    """(demand per step in GPUs, step_s, trace name) for a pool of ``serving_gpus`` sized for the peak."""
    trace = _trace(path, step_s)
    return trace.demand_gpus(serving_gpus), trace.step_s, trace.name


def request_demand_gpus(path: str | Path, model: RequestModel,
                        step_s: float | None = None) -> tuple[np.ndarray, float, str]:
    """As :func:`demand_gpus` for a trace of request rates: ``model.gpus(rate)`` per step (Erlang C)."""
    trace = _trace(path, step_s)
    return np.array(trace.request_demand_gpus(model)), trace.step_s, trace.name

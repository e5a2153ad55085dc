"""Serving demand for the simulator: a trace CSV on the simulation's grid, in GPUs (NaN at gaps). The
clock starts at 0 at the trace's first row; a shorter trace repeats. A per-client trace
(:mod:`tidal.serving.client_traces`, told apart by its header) gives its total, and the same per client."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.serving.client_traces import ClientTrace, read_trace
from tidal.serving.requests import RequestModel
from tidal.serving.traces import Trace


def read_serving_trace(path: str | Path, step_s: float | None = None) -> tuple[Trace, ClientTrace | None]:
    """The trace at ``path`` (either format) on ``step_s`` (``None``: its own), and its clients or None;
    ``ValueError`` unless its step divides a day."""
    trace, clients = read_trace(path, step_s)
    if 86400.0 % trace.step_s > 1e-6:
        raise ValueError(f"{path}: the step ({trace.step_s:g} s) must divide a day (the forecast's period)")
    return trace, clients


def traffic_gpus(path: str | Path, serving_gpus: int,
                 step_s: float | None = None) -> tuple[np.ndarray, np.ndarray | None, float, str]:
    """(demand per step in GPUs, the same per client or None, step_s, trace name) for a pool of
    ``serving_gpus`` sized for the peak; per client: the heavy clients, the tail last."""
    trace, clients = read_serving_trace(path, step_s)
    d = np.array(trace.demand_gpus(serving_gpus))
    if clients is None:
        return d, None, trace.step_s, trace.name
    per = clients.rates * (serving_gpus / trace.peak_load)
    per[trace.gap] = np.nan
    return d, per, trace.step_s, trace.name


def demand_gpus(path: str | Path, serving_gpus: int,
                step_s: float | None = None) -> tuple[np.ndarray, float, str]:
    """(demand per step in GPUs, step_s, trace name) for a pool of ``serving_gpus`` sized for the peak."""
    d, _, step, name = traffic_gpus(path, serving_gpus, step_s)
    return d, step, name


def request_demand_gpus(path: str | Path, model: RequestModel,
                        step_s: float | None = None) -> tuple[np.ndarray, float, str]:
    """As :func:`demand_gpus` for a trace of request rates: ``model.gpus(rate)`` per step (Erlang C)."""
    trace, _ = read_serving_trace(path, step_s)
    return np.array(trace.request_demand_gpus(model)), trace.step_s, trace.name

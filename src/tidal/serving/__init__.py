"""Serving side: where Tidal learns how many GPUs serving needs.

Tidal does not serve models. It reads serving load (a recorded trace in the embedded default and in
evaluations; live metrics in production), turns it into demand in GPUs, and hands that to the pure
forecast and loan plan in :mod:`tidal.policy`.

* :mod:`tidal.serving.traces` — load a CSV trace (time, load) into a :class:`~tidal.serving.traces.Trace`
  and scale it to GPU demand for a pool of a given size.
* :mod:`tidal.serving.sources` — live demand: a trace replayed on a clock, or a Prometheus query.
* :mod:`tidal.serving.requests` — requests, not GPUs: a request rate to the GPUs that meet a latency
  target (Erlang C, :mod:`tidal.policy.queueing`).
* :mod:`tidal.serving.watch` — ``tidal serving watch``: the loan plan, live, as advice.
"""

"""Pure decision functions: the same code runs in the live control plane and in the simulator.

Everything in this package is a function of its arguments: no I/O, no clock reads (time is an
argument, in seconds), no unseeded randomness. Inputs and outputs are frozen dataclasses and
numpy arrays; decisions are values. Policies that learn keep a state value that the caller passes
in and gets back (``policy(ctx, state) -> (decision, new_state)``), so a test or the simulator can
advance them one step at a time and a control plane can persist the state between steps.

* :mod:`tidal.policy.forecast` — serving demand (GPUs) over a horizon: time-of-day profile, live
  level and trend, per-horizon error scale.
* :mod:`tidal.policy.loan` — the loan / reclaim plan: how many serving GPUs may be lent now and
  when each must be back, calibrated online to a shortfall budget; baselines with a fixed margin
  (night-window, reactive, oracle) in the same interface.
* :mod:`tidal.policy.scheduler` — the scheduler: snapshot in, decisions out.
* :mod:`tidal.policy.apply` — the store's side of those decisions, ``apply(snapshot, decisions)``,
  shared by the simulator, the tests and the benchmarks.
"""

"""The scheduler's parts, one seam per module; :mod:`tidal.policy.scheduler` runs them in order.

* ``config`` — :class:`SchedulerConfig`, every knob.
* ``cycle`` — one call's working state: the snapshot indexed once, decisions issued through it.
* ``placement`` — free GPUs per node in count buckets; packing gangs onto the fewest nodes.
* ``ordering`` — aged priority, fair share, and the merge of pending-queue heads.
* ``preemption`` — computing victims for a need (shrink first, then preempt, then give back); victim order.
* ``targets`` — the admission step's preemption path: who may lose GPUs to a waiting job, then acting.
* ``reclaim`` — returning loaned GPUs to serving.
* ``growth`` — handing spare GPUs to elastic jobs.
* ``index`` — :class:`~.index.RunningIndex`, optional incremental per-node sums for repeated calls.
"""

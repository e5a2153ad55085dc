"""Executors: carry out the control plane's decisions on machines, behind one protocol.

* :mod:`tidal.exec.protocol` — the :class:`~tidal.exec.protocol.Executor` protocol and the values it
  reports (:class:`~tidal.exec.protocol.Observation`, :class:`~tidal.exec.protocol.RankState`,
  :class:`~tidal.exec.progress.Progress`).
* :mod:`tidal.exec.local` — the local executor: each rank a process on this machine, behind a small
  shim (:mod:`tidal.exec.shim`) that survives a crash of the control plane and records the rank's
  exit code, so a restarted control plane re-adopts running workers instead of running them twice.

Executors never import the control plane; the control plane (and tests, through a fake at this
seam) drives them.
"""

from tidal.exec.progress import Progress
from tidal.exec.protocol import EXIT_PREEMPTED, Executor, LaunchRequest, Observation, RankState

__all__ = ["EXIT_PREEMPTED", "Executor", "LaunchRequest", "Observation", "Progress", "RankState"]

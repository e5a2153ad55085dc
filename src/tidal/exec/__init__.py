"""Executors: carry out the control plane's decisions on machines, behind one protocol
(:mod:`tidal.exec.protocol`): :mod:`tidal.exec.local` (ranks as processes here, behind
:mod:`tidal.exec.shim`) and :mod:`tidal.exec.ray_exec`. Executors never import the control plane.
"""

from tidal.exec.progress import Progress
from tidal.exec.protocol import EXIT_PREEMPTED, Executor, LaunchRequest, Observation, RankState

__all__ = ["EXIT_PREEMPTED", "Executor", "LaunchRequest", "Observation", "Progress", "RankState"]

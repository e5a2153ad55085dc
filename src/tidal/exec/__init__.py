"""Executors: the control plane's decisions carried out on machines, behind :mod:`tidal.exec.protocol`
(:mod:`tidal.exec.local`, :mod:`tidal.exec.ray_exec`); they never import the control plane."""

from tidal.exec.progress import Progress
from tidal.exec.protocol import EXIT_PREEMPTED, Executor, LaunchRequest, Observation, RankState

__all__ = ["EXIT_PREEMPTED", "Executor", "LaunchRequest", "Observation", "Progress", "RankState"]

"""The scheduler's parts, one seam per module; :mod:`tidal.policy.scheduler` runs them in order."""

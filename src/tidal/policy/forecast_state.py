"""The serving demand forecaster's state: a frozen value, its arrays read-only."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class ForecastState:
    """What the forecaster remembers between observations. ``past_center[r, h-1]``: the center for
    horizon h of the path made r steps before the latest (row 0), scored when its target arrives."""

    t_s: float
    n_obs: int
    level_gpus: float
    trend_gpus_per_s: float
    mean_gpus: float
    profile_gpus: np.ndarray
    profile_n: np.ndarray
    err_sum: np.ndarray
    err_weight: np.ndarray
    past_center: np.ndarray
    err_profile: np.ndarray
    err_profile_n: np.ndarray
    burst: float
    scale_gpus: np.ndarray = field(repr=False)
    past_base: np.ndarray | None = field(default=None, repr=False)
    """``past_base[r, h-1]``: the scale before the context factor, for the path of ``past_center``."""
    past_ctx: np.ndarray | None = field(default=None, repr=False)
    """``past_ctx[r, h-1]``: the context of that path's point (conditional error quantiles)."""
    ctx_hist: np.ndarray | None = field(default=None, repr=False)
    """Per context, an exponentially weighted histogram of standardized errors (``CTX_BINS``)."""
    tail_hist: np.ndarray | None = field(default=None, repr=False)
    """``tail_hist[k-1]``: exponentially weighted histogram (``TAIL_BINS``) of the worst miss of a
    lead window of k steps, ``max(y(u) - center made h steps before u, h = 1..k) / mean``."""
    tail_pending: np.ndarray | None = field(default=None, repr=False)
    """The first period's worst misses (GPUs, ``-inf`` = none), held until ``mean`` is a reference."""

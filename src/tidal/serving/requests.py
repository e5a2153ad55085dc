"""Requests, not GPUs: turn a request rate into the GPUs serving needs for a latency target.

:meth:`RequestModel.gpus` turns requests/s into GPUs with the Erlang C (M/M/c) queue of
:mod:`tidal.policy.queueing`: the fewest replicas whose ``latency_quantile`` of ``latency_of``
(``"queue"``: waiting for a replica; ``"response"``: waiting + service) is at most
``latency_target_s``, times ``gpus_per_replica``. The settings are the ``serving:`` block's
(:data:`FIELDS`, :data:`DEFAULTS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.policy.queueing import MEASURES, check_target, gpus_needed

FIELDS = ("service_rate_per_gpu", "service_rate_per_replica", "gpus_per_replica", "latency_target_s",
          "latency_quantile", "latency_of")
DEFAULTS: dict[str, Any] = {"gpus_per_replica": 1, "latency_quantile": 0.99, "latency_of": "queue"}


def number_in(v: Any, lo: float = -math.inf, hi: float = math.inf, whole: bool = False) -> bool:
    """``v`` is a finite number (an int if ``whole``; never a bool) in ``[lo, hi]``."""
    return (isinstance(v, int if whole else int | float) and not isinstance(v, bool) and math.isfinite(v)
            and lo <= v <= hi)


@dataclass(frozen=True)
class RequestModel:
    """Requests/s -> GPUs for a latency target (see the module docstring)."""

    service_rate_per_replica: float
    latency_target_s: float
    gpus_per_replica: int = 1
    latency_quantile: float = 0.99
    latency_of: str = "queue"

    def gpus(self, rate: Any) -> Any:
        """GPUs needed at ``rate`` requests/s (a number or an array; NaN stays NaN: unknown)."""
        return gpus_needed(rate, self.service_rate_per_replica, self.latency_target_s, self.latency_quantile,
                           self.latency_of, self.gpus_per_replica)

    def describe(self) -> str:
        return (f"requests/s -> GPUs: p{100 * self.latency_quantile:g} {self.latency_of} time <= "
                f"{self.latency_target_s:g} s, {self.service_rate_per_replica:g} requests/s per replica of "
                f"{self.gpus_per_replica} GPU{'s' if self.gpus_per_replica != 1 else ''} (Erlang C)")

    @classmethod
    def from_settings(cls, settings: dict[str, Any], where: str = "serving") -> RequestModel | None:
        """The model for the settings named in :data:`FIELDS` (``None``: none given, demand is in GPUs).
        ``ValueError`` naming ``where.field`` for anything wrong."""
        given = {k: v for k, v in settings.items() if k in FIELDS and v is not None}
        if not given:
            return None
        per_gpu, per_replica = given.get("service_rate_per_gpu"), given.get("service_rate_per_replica")
        if (per_gpu is None) == (per_replica is None):
            which = "not both" if per_gpu is not None else "exactly one"
            raise ValueError(f"{where}.service_rate_per_gpu or {where}.service_rate_per_replica ({which}) is "
                             f"needed for a request-rate demand (given: {', '.join(sorted(given))})")
        kw = {**DEFAULTS, **given}
        g = kw["gpus_per_replica"]
        if not isinstance(g, int) or isinstance(g, bool) or not 1 <= g <= 1_000_000:
            raise ValueError(f"{where}.gpus_per_replica must be a whole number >= 1, got {g!r}")
        name = "service_rate_per_gpu" if per_gpu is not None else "service_rate_per_replica"
        rate = kw[name]
        if not number_in(rate) or not rate > 0:
            raise ValueError(f"{where}.{name} must be a number > 0 (requests/s), got {rate!r}")
        if "latency_target_s" not in given:
            raise ValueError(f"{where}.latency_target_s is required with {where}.{name} (seconds)")
        target, p, of = kw["latency_target_s"], kw["latency_quantile"], kw["latency_of"]
        if not number_in(target) or not target >= 0:
            raise ValueError(f"{where}.latency_target_s must be a number >= 0 (seconds), got {target!r}")
        if not number_in(p) or not 0 < p < 1:
            raise ValueError(f"{where}.latency_quantile must be in (0, 1), e.g. 0.99, got {p!r}")
        if of not in MEASURES:
            raise ValueError(f"{where}.latency_of must be one of {', '.join(MEASURES)}, got {of!r}")
        per_rep = float(rate) * g if per_gpu is not None else float(rate)
        try:
            check_target(per_rep, float(target), float(p), of)
        except ValueError as e:
            raise ValueError(f"{where}.latency_target_s: {e}") from None
        return cls(service_rate_per_replica=per_rep, latency_target_s=float(target), gpus_per_replica=g,
                   latency_quantile=float(p), latency_of=of)


def request_demand_gpus(rates: np.ndarray, gap: np.ndarray, model: RequestModel) -> np.ndarray:
    """GPUs per row of a request-rate series, NaN at gaps (unknown, never zero); read-only."""
    rates = np.asarray(rates, dtype=float)
    out = np.asarray(model.gpus(np.where(gap, np.nan, rates)), dtype=float)
    out.flags.writeable = False
    return out

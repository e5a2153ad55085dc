"""Shortfall budget ledger: a cap on lending that keeps the budget by construction. Pure.

The ledger ``G`` (GPU-seconds) is a CUSUM of realized shortfall over the allowed rate ``B_l``::

    G(t) = max(-bank, G(t - dt) + (shortfall(t) - B_l * demand(t)) * dt)        G(0) = 0

``L`` GPUs are lent now only if ``G + exposure(L) <= A``, the exposure being the worst shortfall the
loans could still cause within one lead time; then ``S(0..b) <= B_l * D(0..b) + A`` for any demand
(docs/loaning.md, "The guarantee").
"""

from __future__ import annotations

import math

EPS = 1e-9


def ledger_update(g_gpu_s: float, shortfall_gpus: float, demand_gpus: float, dt_s: float, rate: float,
                  bank_gpu_s: float) -> float:
    """``G`` after one observed step: ``max(min(-bank, G), G + (shortfall - rate * demand) * dt)`` (the
    floor never raises ``G``: a bank that shrank with the pool takes nothing back)."""
    return max(min(-bank_gpu_s, g_gpu_s), g_gpu_s + (shortfall_gpus - rate * demand_gpus) * dt_s)


def exposure_gpu_s(committed_gpus: list[float], lend_gpus: float, dt_s: float) -> float:
    """Worst-case shortfall (GPU-seconds) still to come from loans: ``dt * sum max(c_j, L)``."""
    return dt_s * sum(max(c, lend_gpus) for c in committed_gpus)


def max_lendable(g_gpu_s: float, allowance_gpu_s: float, committed_gpus: list[float], dt_s: float,
                 pool_gpus: int) -> int:
    """The largest ``L`` in ``[0, pool_gpus]`` with ``G + exposure(L) <= A`` (0 if none);
    ``committed_gpus[j]``: GPUs of earlier plans still away at the j-th grid time of ``(now, now + lead]``."""
    if not committed_gpus:
        return pool_gpus  # nothing lent now can be away at an observed step
    room = (allowance_gpu_s - g_gpu_s) / dt_s  # in GPU-steps
    if exposure_gpu_s(committed_gpus, 0.0, 1.0) > room + EPS:
        return 0
    # sum_j max(c_j, L) is increasing and piecewise linear in L: walk its pieces from the top.
    cs = sorted(committed_gpus)
    k = len(cs)
    above = 0.0  # sum of the c_j above the current piece
    for i in range(k, 0, -1):  # pieces where the i smallest c_j are below L: f(L) = i * L + above
        lo = cs[i - 1]
        best = (room - above) / i
        if best >= lo - EPS:
            return int(max(0, min(pool_gpus, math.floor(best + EPS))))
        above += cs[i - 1]
    return 0  # unreachable: f(0) <= room was checked


__all__ = ["exposure_gpu_s", "ledger_update", "max_lendable"]

"""Shortfall budget ledger: a cap on lending that keeps the budget by construction. Pure.

The forecast and its calibrated margin (:mod:`tidal.policy.loan`) decide how much *should* be lent;
this module decides how much *may* be lent whatever the demand does next. It keeps one number, the
ledger ``G`` (GPU-seconds), a CUSUM of realized shortfall over the allowed rate::

    G(t) = max(-bank, G(t - dt) + (shortfall(t) - B_l * demand(t)) * dt)        G(0) = 0

and lends ``L`` GPUs now only if the worst case still fits the allowance ``A``::

    G(t) + exposure(t, L) <= A
    exposure(t, L) = dt * sum_{u grid in (t, t + lead]} max(lent(u) by earlier plans, L)

``exposure`` is the shortfall the loans already made and the one made now could still cause if
serving demand rose to the whole pool at every step until they are back (one lead time), with
nothing more lent from now on. Lending nothing more is always allowed, and it keeps the invariant
``G + exposure <= A`` at the next step: the next step's shortfall is at most the first term of the
exposure. So at every step ``G(t) <= A``, which gives, for every window ``[a, b]`` of observed steps
(``S`` = shortfall, ``D`` = demand, in GPU-seconds)::

    S(0..b) <= B_l * D(0..b) + A                          from the start
    S(a..b) <= B_l * D(a..b) + A + bank                   any window

*Assumptions* (see docs/loaning.md, "The guarantee"): the shortfall counted is the part the loans
cause, ``max(0, min(demand, N) - supply)`` (demand beyond the pool is not a loan's doing); a GPU on
loan in the plan made at ``s`` serves again by ``s + lead`` (reclaims complete within the lead
time, as the plans' promises say); demand is observed every step (a gap step counts neither
shortfall nor demand).

*A pool that changes size* (serving nodes lost and back: ``N(t)``): the plans remember how many GPUs
they lent (not the supply they promised), the GPUs away at a step are at most today's ``N``, the
allowance and the bank follow the pool (``A(t)``, ``K(t)`` from ``N(t)``), and the floor never raises
``G``. Then ``G`` grows only by shortfall and never above the largest allowance so far, so both bounds
hold with ``max A`` and ``max K`` over ``[0, b]`` (docs/loaning.md, "A pool that changes size").
"""

from __future__ import annotations

import math

EPS = 1e-9


def ledger_update(g_gpu_s: float, shortfall_gpus: float, demand_gpus: float, dt_s: float, rate: float,
                  bank_gpu_s: float) -> float:
    """``G`` after one observed step: ``max(min(-bank, G), G + (shortfall - rate * demand) * dt)``. The
    floor never raises ``G`` (a bank that shrank with the pool stops ``G`` from falling further, it does
    not take back what was banked), so ``G`` only ever grows by shortfall; with a constant bank it is
    ``max(-bank, G + ...)``."""
    return max(min(-bank_gpu_s, g_gpu_s), g_gpu_s + (shortfall_gpus - rate * demand_gpus) * dt_s)


def exposure_gpu_s(committed_gpus: list[float], lend_gpus: float, dt_s: float) -> float:
    """Worst-case shortfall (GPU-seconds) still to come from loans: ``dt * sum max(c_j, L)``."""
    return dt_s * sum(max(c, lend_gpus) for c in committed_gpus)


def max_lendable(g_gpu_s: float, allowance_gpu_s: float, committed_gpus: list[float], dt_s: float,
                 pool_gpus: int) -> int:
    """The largest ``L`` in ``[0, pool_gpus]`` with ``G + exposure(L) <= A``; 0 if even 0 does not fit.

    ``committed_gpus[j]`` = GPUs lent by earlier plans that are still away at the j-th grid time of
    the coming lead time (one entry per grid time in ``(now, now + lead]``).
    """
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

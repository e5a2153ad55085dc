"""What the live loan step shows (``GET /v1/serving``, the dashboard): the newest plan and the ledger as
it is now, built from a :class:`~tidal.control.loans.LiveLoans`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tidal.control import loan_nodes
from tidal.policy.loan import LoanPlan

if TYPE_CHECKING:
    from tidal.control.loans import LiveLoans


def finite(x: float) -> float | None:
    """``x``, or None for an infinite time (a loan with no end yet): JSON has no infinity."""
    return None if math.isinf(x) else x


def plan_view(ll: LiveLoans, now_s: float, t_serv: float, demand: float, plan: LoanPlan) -> dict[str, Any]:
    """The newest plan: demand, what may be lent, the margin and the first hours of the forecast."""
    k = min(len(plan.times_s), 36)
    return {
        "planned_s": now_s, "serving_time_s": t_serv, "speedup": ll.speedup,
        "demand_gpus": None if math.isnan(demand) else round(demand, 3),
        "lendable_gpus": plan.lendable_gpus, "margin_gpus": round(plan.margin_gpus, 3),
        "z": round(float(ll.state.z), 4), "shortfall_budget": ll.policy.config.shortfall_budget,
        "forecast_observations": int(ll.state.forecast.n_obs),
        "forecast": {"times_s": [round(float(x), 1) for x in plan.times_s[:k]],
                     "upper_gpus": [round(float(x), 2) for x in plan.upper_gpus[:k]]},
    }


def state_view(ll: LiveLoans, now_s: float, held: Mapping[str, int] | None) -> dict[str, Any]:
    """The newest plan's view with the ledger, the loans, the reclaims and the adapter as they are now
    (``held``: serving node -> GPUs jobs hold there)."""
    led = ll.ledger
    return {
        "held_gpus": {n: g for n, g in (held or {}).items() if n in ll.nodes},
        **ll.plan_shown,
        "now_s": now_s,
        "serving_nodes": dict(ll.nodes),
        **loan_nodes.view(ll),
        "serving_gpus": ll.serving_gpus,
        "lent_gpus": ll.lent,
        "warming_gpus": led.warming,
        "serving_capacity_gpus": led.capacity,
        "releasing": dict(ll.releasing),
        "restoring": dict(ll.restoring),
        "loans": [{"node": ln.node, "gpus": ln.gpus, "until_s": finite(ln.until_s)} for ln in ll.loans],
        "reclaims": [{"gpus": r.gpus, "by_s": r.by_s, "notice_s": r.notice_s} for r in ll.reclaims],
        "warming": {n: led.warming_ready_s(n) for n in led.cap if led.warming_ready_s(n)},
        "stats": dict(ll.stats),
        "worst_margin_s": min(ll.margins) if ll.margins else None,
        "pending_restores": dict(ll.pending_restores),
        "adapter": ll.adapter.health(),
    }

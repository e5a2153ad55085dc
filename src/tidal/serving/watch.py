"""``tidal serving watch``: the loan plan, live, from a demand source — advice for an operator.

Every ``step_s`` it reads serving demand from a :class:`~tidal.serving.sources.DemandSource`, calls
the same :class:`~tidal.policy.loan.TidalPolicy` the simulator evaluates, and reports the plan: how
many serving GPUs could be lent now, when how many of them must be serving again, and when to send
those reclaim notices. It assumes every lendable GPU is lent (so the policy scores its promises as
if it had been followed). It acts on nothing: the live control plane does not yet place spot jobs on
serving GPUs (see docs/loaning.md, "Live").

The loop reads no clock of its own: ``clock()`` gives the time the policy sees (seconds) and
``sleep(s)`` waits for ``s`` of that time, so a replayed trace can run faster than real time and
tests run it with a fake clock. Observations fall on a grid of whole steps (``k * step_s``), the
grid the forecast's time-of-day slots need; the source is asked for the grid time. A loop that falls
behind by whole steps skips to the latest grid point, and the forecast counts the skipped steps as
missing observations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.policy.loan import LoanContext, LoanPlan, TidalPolicy, TidalState
from tidal.serving.sources import DemandSource


@dataclass(frozen=True)
class Step:
    """One observation and the plan made from it."""

    now_s: float
    demand_gpus: float
    plan: LoanPlan
    z: float
    shortfall_ratio: float

    def as_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "now_s": self.now_s,
            "demand_gpus": None if math.isnan(self.demand_gpus) else round(self.demand_gpus, 3),
            "lendable_gpus": p.lendable_gpus,
            "reclaim_now_gpus": p.reclaim_now_gpus,
            "reclaims": [{"gpus": r.gpus, "deadline_s": r.deadline_s, "notice_s": r.notice_s} for r in p.reclaims],
            "margin_gpus": round(p.margin_gpus, 3),
            "lead_time_s": p.lead_time_s,
            "z": round(self.z, 4),
            "shortfall_ratio_so_far": self.shortfall_ratio,
        }


def watch(source: DemandSource, policy: TidalPolicy, *, serving_gpus: int, clock: Callable[[], float],
          sleep: Callable[[float], None], on_step: Callable[[Step], None], steps: int | None = None,
          state: TidalState | None = None) -> TidalState:
    """Observe, plan and report every ``policy.config.forecast.step_s`` until ``steps`` are done
    (``None``: forever). Returns the policy's state."""
    if serving_gpus < 1:
        raise ValueError(f"serving_gpus must be >= 1, got {serving_gpus}")
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    step_s = policy.config.forecast.step_s
    state = state if state is not None else policy.initial_state()
    lent = 0
    done = 0
    # The forecast observes on a grid of whole steps (multiples of step_s, so that time-of-day slots
    # line up); the next grid point after the last observation, or from now.
    t = state.forecast.t_s
    grid = t + step_s if not math.isnan(t) else math.ceil(clock() / step_s - 1e-9) * step_s
    while steps is None or done < steps:
        now = clock()
        while now < grid:
            sleep(grid - now)
            now = clock()
        if now >= grid + step_s:  # late by whole steps (a slow source, a suspended process): the
            grid += math.floor((now - grid) / step_s) * step_s  # forecast counts the skipped ones as missing
        demand = source.demand_gpus(grid)
        plan, state = policy(LoanContext(now_s=grid, serving_gpus=serving_gpus, demand_gpus=demand, lent_gpus=lent),
                             state)
        lent = plan.lendable_gpus
        on_step(Step(grid, demand, plan, state.z, state.shortfall_ratio))
        done += 1
        grid += step_s
    return state

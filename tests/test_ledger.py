"""The loan ledger (tidal.policy.ledger): persistence round trip and refusal of inconsistent state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tidal.model import Reclaim
from tidal.policy.ledger import LoanLedger
from tidal.policy.loan import LoanPlan, LoanTiming

TIMING = LoanTiming(notice_s=10, final_checkpoint_s=5, release_s=2, warmup_s=20, restart_cost_s=0)


def _plan(lendable: int, reclaims=(), now_gpus: int = 0) -> LoanPlan:
    return LoanPlan(now_s=0.0, lendable_gpus=lendable, reclaims=tuple(reclaims), reclaim_now_gpus=now_gpus,
                    times_s=np.zeros(0), upper_gpus=np.zeros(0), margin_gpus=0.0,
                    lead_time_s=TIMING.lead_time_s, min_loan_window_s=0.0)


def test_round_trip_keeps_loans_warming_and_reclaims():
    led = LoanLedger({"s0": 2, "s1": 2}, TIMING)
    led.apply_plan(_plan(3, [Reclaim(gpus=1, by_s=480.0, notice_s=463.0, deadline_s=500.0)]), 100.0, {})
    led.return_gpus("s0", 1, 110.0)
    state = json.loads(json.dumps(led.to_state()))  # JSON-able
    back = LoanLedger.from_state(state, TIMING)
    assert back.to_state() == led.to_state()
    assert (back.lent, back.warming, back.capacity) == (led.lent, led.warming, led.capacity)
    assert back.loans == led.loans and back.reclaims == led.reclaims
    assert math.isinf(back.loans["s1"].until_s) or back.loans["s1"].until_s == led.loans["s1"].until_s


def test_from_state_refuses_more_lent_than_the_node_has():
    led = LoanLedger({"s0": 2}, TIMING)
    led.apply_plan(_plan(2), 0.0, {})
    state = led.to_state()
    state["warming"] = {"s0": [[50.0, 1]]}
    with pytest.raises(ValueError, match="s0"):
        LoanLedger.from_state(state, TIMING)
    state = led.to_state()
    state["loans"] = [["s9", 1, None]]
    with pytest.raises(ValueError, match="s9"):
        LoanLedger.from_state(state, TIMING)


def test_loan_changes_name_every_loan_that_came_changed_or_went():
    """``take_loan_changes`` (what the simulator hints to the scheduler's index) names every node whose
    loan came, changed or went since the last call, with its loan now: the loans before, changed by
    them, are the loans after, through plans that lend, move loan ends and take back, hand-backs, a
    refused loan and a lost node."""
    rng = np.random.default_rng(0)
    nodes = {f"s{i}": 4 for i in range(6)}
    led = LoanLedger(nodes, TIMING)
    seen = dict(led.loans)
    for step in range(300):
        now = 100.0 * step
        op = rng.integers(0, 4)
        if op == 0:  # a plan: lend up to a level, reclaims with their notices
            notices = rng.choice([50, 300, 600], rng.integers(0, 3))
            reclaims = [Reclaim(gpus=int(rng.integers(1, 5)), by_s=now + 900.0, notice_s=now + float(n),
                                deadline_s=now + 1000.0) for n in notices]
            used = {n: int(rng.integers(0, 3)) for n in nodes}
            led.apply_plan(_plan(int(rng.integers(0, 25)), reclaims), now, used)
        elif op == 1 and led.loans:  # some GPUs handed back
            node = str(rng.choice(sorted(led.loans)))
            led.return_gpus(node, int(rng.integers(1, led.loans[node].gpus + 1)), now)
        elif op == 2 and led.loans:  # the serving side refused a loan just made
            node = str(rng.choice(sorted(led.loans)))
            led.cancel_loan(node, 1)
        elif op == 3 and step % 50 == 7:  # a node lost
            node = str(rng.choice(sorted(led.cap)))
            led.drop_node(node)
        for node, ln in led.take_loan_changes().items():
            if ln is None:
                seen.pop(node, None)
            else:
                seen[node] = ln
        assert seen == led.loans

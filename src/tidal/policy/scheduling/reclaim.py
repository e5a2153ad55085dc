"""The reclaim step: give loaned GPUs back as the plan's due reclaims say, before anything is admitted:
idle GPUs now, draining ones counted, then shrink and preempt spot jobs on loans (docs/scheduling.md)."""

from __future__ import annotations

import math

from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.preemption import CountNeed, Victim, find_victims
from tidal.policy.scheduling.targets import Cand
from tidal.policy.scheduling.victims import victim_index


def reclaim_step(c: Cycle) -> None:
    if not c.snap.reclaims:
        return
    now, cfg = c.now, c.cfg
    due = soon = 0
    by_s = math.inf
    for r in c.snap.reclaims:
        if r.due(now):
            due += r.gpus
            by_s = min(by_s, r.by_s)
        elif r.notice_s is not None and r.notice_s - now < cfg.min_loan_left_s:  # (due: notice_s set)
            soon += r.gpus
    if due + soon == 0:
        return
    loan = c.loan
    order = sorted((n for n, f in loan.free.items() if f > 0),
                   key=lambda n: (c.used.get(n, 0), c.loans[n].until_s))
    for node in order:
        f = loan.free[node]
        k = min(due, f)
        if k:
            c.issue_return(node, k)
            due -= k
            f -= k
        k = min(soon, f)
        if k:
            loan.take(node, k)
            c.reserved[node] = c.reserved.get(node, 0) + k
            soon -= k
        if due + soon == 0:
            break
    for node, d in list(loan.draining.items()):
        k = min(due + soon, d)
        if k:
            loan.claim_draining(node, k)
            c.claimed_draining[node] = c.claimed_draining.get(node, 0) + k
            taken = min(due, k)
            due -= taken
            soon -= k - taken
        if due + soon == 0:
            break
    if due > 0:
        _displace(c, due, max(now, by_s))


def _displace(c: Cycle, need_gpus: int, by_s: float) -> None:
    nodes = c.loan.free  # every loaned node (blocked ones too)
    idx = victim_index(c)
    on_loan, touched = idx.on_any_loan, c.touched
    shrink: list[Cand] = [
        (j, "reclaim", False) for j in idx.spot_shrink if j.id in on_loan and j.id not in touched
    ]
    pre: list[Cand] = [(j, "reclaim", False) for j in idx.spot_pre_any_loan() if j.id not in touched]
    victims = find_victims(CountNeed(nodes, need_gpus, c.used), shrink, pre)
    if victims is None:  # the reclaim asks for more than training holds on loans: clear them all
        victims = [Victim(j, dict(j.placement), True, "reclaim", False) for j, _, _ in pre]
    for v in victims:
        claimed = {n: g for n, g in v.release.items() if n in nodes}
        c.reclaim_victim_gpus += sum(claimed.values())
        if v.preempt:
            c.issue_preempt(v.job, "reclaim", by_s, None, claimed)
        else:
            c.issue_shrink(v.job, v.release, "reclaim", by_s, None, claimed)

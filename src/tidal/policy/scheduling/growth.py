"""The grow step: GPUs still free after admission go to elastic jobs below their maximum.

Runs last, so growth only ever takes GPUs that no waiting job could start on in this call. One size
step (``Job.size_step``) at a time, water-filling:

* dedicated jobs first, each within its tenant's quota and on the training pool only (their growth is
  guaranteed space; spot growth can be shrunk again by anyone);
* then spot jobs, the tenant furthest below its fair share first, then higher priority;
* on the job's own nodes first (locality), then packed like an admission.

Not grown: jobs shrunk less than ``hysteresis_s`` ago (no ping-pong), jobs with GPUs being released,
jobs acted on earlier in this call. Loaned GPUs the loan plan wants back soon are not in the views,
so nothing grows into them. Jobs admitted in this call grow inside their :class:`Admit`.
"""

from __future__ import annotations

import heapq

from tidal.model import Admit, Grow, Job
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.placement import fits, place_more


def grow_step(c: Cycle, admitted: dict[str, tuple[int, Job]]) -> None:
    """``admitted``: job id -> (index of its Admit in ``c.decisions``, job), for jobs admitted this call."""
    if c.training.total + c.loan.total == 0:
        return
    now, hyst = c.now, c.cfg.hysteresis_s
    current: dict[str, dict[str, int]] = {}
    jobs: dict[str, Job] = {}
    for j in c.growable:
        if j.id in c.touched or (j.last_shrunk_s is not None and now - j.last_shrunk_s < hyst):
            continue
        jobs[j.id] = j
        current[j.id] = dict(j.placement)
    for jid, (i, j) in admitted.items():
        if j.elastic:
            jobs[jid] = j
            current[jid] = dict(c.decisions[i].placement)  # type: ignore[union-attr]
    if not jobs:
        return

    def key(j: Job) -> tuple:
        frac = sum(current[j.id].values()) / j.max_gpus  # water-fill among a tenant's equal jobs
        if j.kind == "dedicated":
            quota = c.tenants[j.tenant].quota_gpus
            return (0, c.ded_held[j.tenant] / quota if quota else 0.0, -j.priority, frac, j.id)
        return (1, c.share(j.tenant), -j.priority, frac, j.id)

    heap = [(key(j), j.id) for j in jobs.values()]
    heapq.heapify(heap)
    added: dict[str, dict[str, int]] = {}
    while heap and c.training.total + c.loan.total > 0:
        k, jid = heap[0]
        j = jobs[jid]
        k2 = key(j)
        if k2 != k:
            heapq.heapreplace(heap, (k2, jid))
            continue
        unit, g = j.size_step, j.gpus_per_node
        size = sum(current[jid].values())
        ok = size + unit <= j.max_gpus
        views = [c.training] if j.kind == "dedicated" else [c.loan, c.training]
        if ok and j.kind == "dedicated":
            ok = c.quota_room(j.tenant) >= unit
        if ok:
            ok = fits(views, unit, g)
        if not ok:
            heapq.heappop(heap)
            continue
        add = place_more(views, unit, g, current[jid])
        if add is None:  # only nodes it already uses have room, and it needs new ones
            heapq.heappop(heap)
            continue
        c._count(j, unit)
        for node, t in add.items():
            current[jid][node] = current[jid].get(node, 0) + t
            a = added.setdefault(jid, {})
            a[node] = a.get(node, 0) + t
        heapq.heapreplace(heap, (key(j), jid))
    for jid, add in added.items():
        if jid in admitted:
            i, _ = admitted[jid]
            c.decisions[i] = Admit(jid, current[jid])
        else:
            j = jobs[jid]
            c.touched.add(jid)
            c.decisions.append(Grow(jid, j.gpus + sum(add.values()), add))

"""The grow step: GPUs still free after admission go to elastic jobs below their maximum, water-filling
in size steps, dedicated jobs first (docs/scheduling.md, step 6). With ``Cycle.why``, each job left
below its maximum gets the reason."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from tidal.model import Admit, Grow, Job
from tidal.policy.scheduling.cycle import Cycle
from tidal.policy.scheduling.placement import fits, place_more


def grow_step(c: Cycle, admitted: dict[str, tuple[int, Job]]) -> None:
    """``admitted``: job id -> (index of its Admit in ``c.decisions``, job). Each grant is a node's worth
    or a quarter of the job's room, whichever is more (in steps), or one step: few rounds."""
    spare = c.training.total + c.loan.total
    if spare == 0:
        if c.why is not None:
            for j in c.growable_jobs():
                if j.id not in c.touched:
                    c.wait(j, f"at {j.gpus} of {j.max_gpus} GPUs: no GPU free to grow into")
        return
    now, hyst = c.now, c.cfg.hysteresis_s
    size: dict[str, int] = {}
    jobs: dict[str, Job] = {}
    start: dict[str, Mapping[str, int]] = {}
    why, touched = c.why is not None, c.touched
    idx = c.index
    # With the caller's index, its groups kept sorted (a sorted list is a heap): a running job is checked
    # only when it comes to the head of its group, not every growable job every call.
    kept = idx is not None and c.used is idx.used and not why and not idx.grow_repeats
    groups: dict[tuple[int, str], list[tuple[int, float, str]]] = {}
    for j in c.growable_jobs() if not kept else ():
        if j.id in touched:
            continue
        shrunk = j.last_shrunk_s
        if shrunk is not None and now - shrunk < hyst:
            if why:
                c.wait(j, f"at {j.gpus} of {j.max_gpus} GPUs: grow held after its shrink (hysteresis_s "
                       f"{hyst:g})", until_s=shrunk + hyst)
            continue
        if j.size_step > spare:
            if why:
                c.wait(j, f"at {j.gpus} of {j.max_gpus} GPUs: grows {j.size_step} at a time, {spare} free")
            continue
        jobs[j.id], size[j.id], start[j.id] = j, j.gpus, j.placement
    if kept:
        assert idx is not None
        groups = {gk: list(h) for gk, h in idx.grow_sorted.items() if h}
    for jid, (i, j) in admitted.items():
        if j.elastic and j.size_step <= spare:
            jobs[jid], size[jid] = j, j.min_gpus
            d = c.decisions[i]
            assert isinstance(d, Admit)  # admitted: its index among the decisions
            start[jid] = d.placement
            if kept:
                heapq.heappush(groups.setdefault((int(j.kind != "dedicated"), j.tenant), []),
                               (-j.priority, j.min_gpus / j.max_gpus, jid))
    if not jobs and not kept:
        return

    def head(h: list[tuple[int, float, str]]) -> bool:
        """Drop the group's running jobs that may not grow now from its head; is anyone left?"""
        while h and h[0][2] not in jobs:
            assert idx is not None
            j = idx.grow_job[h[0][2]]
            shrunk = j.last_shrunk_s
            if j.id in touched or (shrunk is not None and now - shrunk < hyst) or j.size_step > spare:
                heapq.heappop(h)
            else:
                jobs[j.id], size[j.id], start[j.id] = j, j.gpus, j.placement
        return bool(h)

    # The order is (kind, the tenant's quota use or share, -priority, fraction of its maximum, id): a heap
    # per (kind, tenant) on the last three, and a heap of those groups by their head. A grant raises only
    # its own group's key (its tenant's use and its job's fraction), so no key in either heap goes stale.
    def tenant_key(rank: int, t: str) -> float:
        if rank == 0:
            quota = c.tenants[t].quota_gpus
            return c.ded_held[t] / quota if quota else 0.0
        return c.share(t)

    if not kept:
        for jid, j in jobs.items():
            groups.setdefault((int(j.kind != "dedicated"), j.tenant), []).append(
                (-j.priority, size[jid] / j.max_gpus, jid))
        for h in groups.values():
            heapq.heapify(h)
    top = [((g[0], tenant_key(*g), h[0]), g) for g, h in groups.items() if not kept or head(h)]
    heapq.heapify(top)
    current: dict[str, dict[str, int]] = {}  # placements of jobs granted something, copied on first grant
    added: dict[str, dict[str, int]] = {}
    node_gpus = c.max_node_gpus

    def requeue(gk: tuple[int, str]) -> None:  # the top group's key after a change in it
        h = groups[gk]
        if h and (not kept or head(h)):
            heapq.heapreplace(top, ((gk[0], tenant_key(*gk), h[0]), gk))
        else:
            heapq.heappop(top)

    while top and c.training.total + c.loan.total > 0:
        gk = top[0][1]
        h = groups[gk]
        jid = h[0][2]
        j = jobs[jid]
        unit, g = j.size_step, j.gpus_per_node
        room = j.max_gpus - size[jid]
        if j.kind == "dedicated":
            room = min(room, c.quota_room(j.tenant))
            views = [c.training]
        else:
            views = [c.loan, c.training]
        add = None
        big = max(unit, node_gpus, room // 4) // unit * unit  # a node's worth, or a quarter of the room
        for amount in sorted({min(room, big) // unit * unit, unit}, reverse=True):
            if 0 < amount <= room and fits(views, amount, g):
                add = place_more(views, amount, g, current.get(jid) or start[jid])
                if add is not None:
                    break
        if add is None:  # full, out of quota, or nothing fits it any more
            heapq.heappop(h)
            requeue(gk)
            if c.why is not None and size[jid] < j.max_gpus and jid not in admitted:
                quota = j.kind == "dedicated" and c.quota_room(j.tenant) < unit
                c.wait(j, f"at {size[jid]} of {j.max_gpus} GPUs: " + (
                    f"tenant {j.tenant}'s quota is full" if quota else
                    f"no room for {unit} more GPU{'s' if unit != 1 else ''}"
                    + (f" ({g} per node)" if g else "") + f", {sum(v.total for v in views)} free"))
            continue
        n = sum(add.values())
        size[jid] += n
        c._count(j, n)
        cur = current.setdefault(jid, dict(start[jid]))
        a = added.setdefault(jid, {})
        for node, t in add.items():
            cur[node] = cur.get(node, 0) + t
            a[node] = a.get(node, 0) + t
        heapq.heapreplace(h, (-j.priority, size[jid] / j.max_gpus, jid))
        requeue(gk)
    if c.why is not None:
        for *_, jid in (x for _, gk in top for x in groups[gk]):  # spare ran out before these were full
            j = jobs[jid]
            if size[jid] < j.max_gpus and jid not in admitted:
                c.wait(j, f"at {size[jid]} of {j.max_gpus} GPUs: no more GPU free to grow into")
    for jid, add in added.items():
        if jid in admitted:
            i, _ = admitted[jid]
            c.decisions[i] = Admit(jid, current[jid])
        else:
            c.touched.add(jid)
            c.decisions.append(Grow(jid, size[jid], add))

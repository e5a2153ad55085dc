"""Fixture builders for scheduler tests, and a reference store: apply decisions, let jobs drain.

``apply`` and ``settle`` are what the control plane's store and the simulator do with decisions,
reduced to the bookkeeping the scheduler relies on; property tests step a small world with them.
"""

from __future__ import annotations

from dataclasses import replace

from tidal.model import (
    Admit,
    Decision,
    Grow,
    Job,
    Loan,
    Node,
    Preempt,
    Reclaim,
    ReturnGpus,
    Shrink,
    Snapshot,
    Tenant,
)


def nodes(training: tuple[int, ...] = (8, 8), serving: tuple[int, ...] = ()) -> list[Node]:
    """Training nodes t0, t1, ... and serving nodes s0, s1, ... with the given GPU counts."""
    return [Node(f"t{i}", g) for i, g in enumerate(training)] + [
        Node(f"s{i}", g, "serving") for i, g in enumerate(serving)
    ]


def tenants(*specs: tuple[str, int] | tuple[str, int, float]) -> list[Tenant]:
    return [Tenant(*s) for s in specs]


def pend(id: str, tenant: str = "a", kind: str = "spot", min: int = 1, max: int | None = None, **kw) -> Job:
    return Job(id, tenant, kind, min_gpus=min, max_gpus=max, **kw)  # type: ignore[arg-type]


def run(id: str, on: dict[str, int], tenant: str = "a", kind: str = "spot", min: int | None = None,
        max: int | None = None, started_s: float = 0.0, **kw) -> Job:
    size = sum(on.values())
    return Job(id, tenant, kind, min_gpus=size if min is None else min, max_gpus=max, placement=on,  # type: ignore[arg-type]
               started_s=started_s, **kw)


def snap(now_s: float, node_list: list[Node], tenant_list: list[Tenant], jobs: list[Job],
         loans: list[Loan] | tuple = (), reclaims: list[Reclaim] | tuple = ()) -> Snapshot:
    return Snapshot.build(now_s, node_list, tenant_list, jobs, loans, reclaims)


def apply(s: Snapshot, decisions: list[Decision]) -> Snapshot:
    """The store's side of each decision, at ``s.now_s``."""
    jobs = {j.id: j for j in s.jobs()}
    loans = {ln.node: ln for ln in s.loans}
    reclaims = sorted(s.reclaims, key=lambda r: r.by_s)
    now = s.now_s
    for d in decisions:
        if isinstance(d, Admit):
            j = jobs[d.job]
            assert not j.running, f"{d}: job already running"
            jobs[d.job] = replace(j, placement=dict(d.placement), started_s=now, nominated_s=None)
        elif isinstance(d, Grow):
            j = jobs[d.job]
            p = dict(j.placement)
            for n, g in d.add.items():
                p[n] = p.get(n, 0) + g
            assert sum(p.values()) == d.to_gpus, d
            jobs[d.job] = replace(j, placement=p, last_grown_s=now)
        elif isinstance(d, Shrink):
            j = jobs[d.job]
            assert not j.releasing, f"{d}: job already releasing"
            assert j.gpus - sum(d.release.values()) == d.to_gpus, d
            jobs[d.job] = replace(j, releasing=dict(d.release), last_shrunk_s=now)
            _nominate(jobs, d.for_job, now)
        elif isinstance(d, Preempt):
            j = jobs[d.job]
            assert not j.releasing, f"{d}: job already releasing"
            jobs[d.job] = replace(j, releasing=dict(j.placement), last_preempted_s=now)
            _nominate(jobs, d.for_job, now)
        elif isinstance(d, ReturnGpus):
            ln = loans[d.node]
            if ln.gpus == d.gpus:
                del loans[d.node]
            else:
                loans[d.node] = replace(ln, gpus=ln.gpus - d.gpus)
            left = d.gpus
            while left:
                r = reclaims[0]
                k = min(left, r.gpus)
                left -= k
                if k == r.gpus:
                    reclaims.pop(0)
                else:
                    reclaims[0] = replace(r, gpus=r.gpus - k)
        else:
            raise AssertionError(f"unexpected decision {d}")
    return Snapshot.build(now, s.nodes, s.tenants, jobs.values(), loans.values(), reclaims)


def _nominate(jobs: dict, for_job: str | None, now: float) -> None:
    """The store records that others were made to give GPUs back for pending ``for_job``."""
    if for_job is not None and not jobs[for_job].running:
        jobs[for_job] = replace(jobs[for_job], nominated_s=now)


def settle(s: Snapshot, now_s: float | None = None) -> Snapshot:
    """Every releasing job has released: shrunk jobs go on smaller, preempted ones are requeued."""
    out = []
    for j in s.jobs():
        if j.releasing:
            p = {n: g - j.releasing.get(n, 0) for n, g in j.placement.items() if g - j.releasing.get(n, 0) > 0}
            started = j.started_s if p else None
            j = replace(j, placement=p, releasing={}, started_s=started)
        out.append(j)
    now = s.now_s if now_s is None else now_s
    return Snapshot.build(now, s.nodes, s.tenants, out, s.loans, s.reclaims)

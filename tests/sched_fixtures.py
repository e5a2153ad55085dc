"""Fixture builders for scheduler tests, and a reference store: apply decisions, let jobs drain.

``apply`` is :func:`tidal.policy.apply.apply`, the store's side of each decision that the simulator
shares; ``settle`` lets every releasing job finish releasing. Property tests step a small world with
them.
"""

from __future__ import annotations

from dataclasses import replace

from tidal.model import Job, Loan, Node, Reclaim, Snapshot, Tenant
from tidal.policy.apply import apply

__all__ = ["apply", "nodes", "pend", "run", "settle", "snap", "tenants"]


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


def settle(s: Snapshot, now_s: float | None = None) -> Snapshot:
    """Every releasing job has released: shrunk jobs go on smaller, preempted ones are requeued."""
    out = []
    for j in s.jobs():
        if j.releasing:
            p = {
                n: g - j.releasing.get(n, 0) for n, g in j.placement.items() if g - j.releasing.get(n, 0) > 0
            }
            started = j.started_s if p else None
            j = replace(j, placement=p, releasing={}, started_s=started)
        out.append(j)
    now = s.now_s if now_s is None else now_s
    return Snapshot.build(now, s.nodes, s.tenants, out, s.loans, s.reclaims)

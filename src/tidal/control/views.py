"""JSON views of store rows, as the REST API returns them (and the CLI and metrics read them)."""

from __future__ import annotations

from typing import Any

from tidal.control.controller import job_report
from tidal.control.states import HELD, STOPPING, State
from tidal.control.store import EventRow, JobRow
from tidal.model import Node


def job_view(j: JobRow, now_s: float, *, detail: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": j.id, "name": j.name, "tenant": j.tenant, "state": j.state, "kind": j.kind, "priority": j.priority,
        "gpus": {"min": j.min_gpus, "max": j.max_gpus, "multiple_of": j.multiple_of}, "placement": j.placement,
        "attempt": j.attempt, "restarts": j.restarts, "max_restarts": j.max_restarts,
        "preemptions": j.preemptions, "submit_s": j.submit_s, "started_s": j.started_s,
        "finished_s": j.finished_s, "cancel_requested": j.cancel_requested, "message": j.message,
        "progress": j.progress or {}, "ckpt_step": j.ckpt_step, "report": job_report(j, now_s),
    }
    if detail:
        out["spec"] = j.spec
        out["handle"] = j.handle
        out["retry_at_s"] = j.retry_at_s
    return out


def event_view(e: EventRow) -> dict[str, Any]:
    return {"id": e.id, "time_s": e.time_s, "job": e.job_id, "tenant": e.tenant, "kind": e.kind,
            "from": e.from_state, "to": e.to_state, "message": e.message, "data": e.data}


def pool_view(nodes: list[Node], jobs: list[JobRow], viewer: str | None) -> dict[str, Any]:
    """GPUs per node: allocated (by tenant; job ids only for ``viewer``'s own jobs, all for admin
    ``viewer=None``), draining (being released) and free."""
    out = []
    for n in nodes:
        holders = []
        allocated = draining = 0
        for j in jobs:
            g = (j.placement or {}).get(n.name, 0)
            if not g or State(j.state) not in HELD:
                continue
            d = g if State(j.state) in (State.PREEMPTING, State.CANCELLING) else (j.releasing or {}).get(n.name, 0)
            allocated += g
            draining += d
            mine = viewer is None or j.tenant == viewer
            holders.append({"job": j.id if mine else None, "tenant": j.tenant, "gpus": g, "draining": d,
                            "state": j.state if mine else ("stopping" if State(j.state) in STOPPING else "running")})
        out.append({"name": n.name, "pool": n.pool, "gpus": n.gpus, "allocated": allocated, "draining": draining,
                    "free": n.gpus - allocated, "jobs": holders})
    total = sum(n.gpus for n in nodes)
    alloc = sum(x["allocated"] for x in out)
    return {"nodes": out, "gpus": total, "allocated": alloc, "free": total - alloc,
            "pending": sum(1 for j in jobs if j.state == State.PENDING and (viewer is None or j.tenant == viewer))}

"""What the dashboard shows, computed from store rows and files (no HTTP here; :mod:`.dashboard` serves it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.contract import PROGRESS_DIRNAME, attempt_dirname, progress_file
from tidal.control.read_view import QueuedJob
from tidal.control.states import HELD, State
from tidal.control.store import HeldJob, JobRow, TenantRow
from tidal.files import open_plain
from tidal.model import Node

CURVE_POINTS = 1500  # points per attempt at most (evenly thinned)
CURVE_TAIL_BYTES = 8 << 20  # of each attempt's progress file, the newest bytes read at most
CURVE_ATTEMPTS = 20  # the newest attempts drawn


def gpu_map(nodes: Sequence[Node], held: Sequence[HeldJob], viewer: str | None, loans: dict[str, Any] | None
            ) -> list[dict[str, Any]]:
    """Per node, its GPUs as segments ``{"kind", "gpus", ...}`` in drawing order: ``job`` (``job``/``state``
    for the viewer's own; ``None`` viewer: admin), ``draining``, ``lent`` (no job on them yet), ``warming``,
    ``serving``, ``free``."""
    lent_on = {ln["node"]: ln["gpus"] for ln in (loans or {}).get("loans", [])}
    warming = {n: sum(g for _, g in w) for n, w in ((loans or {}).get("warming") or {}).items()}
    on: dict[str, list[HeldJob]] = {}  # node -> the jobs holding GPUs there (one pass, not one per node)
    for j in held:
        if j.state in HELD:
            for name in j.placement or {}:
                on.setdefault(name, []).append(j)
    out = []
    for n in nodes:
        segs: list[dict[str, Any]] = []
        used = 0
        for j in on.get(n.name, ()):
            g = (j.placement or {}).get(n.name, 0)
            if not g:
                continue
            stopping = State(j.state) in (State.PREEMPTING, State.CANCELLING)
            d = g if stopping else (j.releasing or {}).get(n.name, 0)
            mine = viewer is None or j.tenant == viewer
            seg = {"kind": "job", "gpus": g - d, "tenant": j.tenant, "job": j.id if mine else None,
                   "state": j.state if mine else None}
            if g - d:
                segs.append(seg)
            if d:
                segs.append({**seg, "kind": "draining", "gpus": d})
            used += g
        if n.pool == "serving":
            lent, warm = lent_on.get(n.name, 0), warming.get(n.name, 0)
            rest = n.gpus - used
            idle_lent = max(0, min(rest, lent - used))
            warm = max(0, min(rest - idle_lent, warm))
            segs += [{"kind": k, "gpus": g} for k, g in (("lent", idle_lent), ("warming", warm),
                                                         ("serving", rest - idle_lent - warm)) if g > 0]
        elif n.gpus - used > 0:
            segs.append({"kind": "free", "gpus": n.gpus - used})
        out.append({"name": n.name, "pool": n.pool, "gpus": n.gpus, "used": used, "segments": segs})
    return out


def tenant_usage(tenants: list[TenantRow], held: Sequence[HeldJob], waiting: dict[tuple[str, str], int],
                 nodes: Sequence[Node], lent_gpus: int) -> list[dict[str, Any]]:
    """Per tenant (admins left out): GPUs held, jobs running and waiting (``waiting``: (tenant, kind) ->
    jobs), quota, weight, and its fair share of spot capacity (docs/scheduling.md)."""
    rows: dict[str, dict[str, Any]]
    rows = {t.name: {"tenant": t.name, "quota_gpus": t.quota_gpus, "weight": t.weight, "dedicated_gpus": 0,
                     "spot_gpus": 0, "running": 0, "waiting": 0, "fair_share_gpus": None}
            for t in tenants if not t.admin}
    spot_active: set[str] = set()
    for j in held:
        r = rows.get(j.tenant)
        if r is None:
            continue
        r["running"] += 1
        r["dedicated_gpus" if j.kind == "dedicated" else "spot_gpus"] += j.gpus
        if j.kind != "dedicated" and j.gpus:
            spot_active.add(j.tenant)
    for (tenant, kind), n in waiting.items():
        if tenant in rows:
            rows[tenant]["waiting"] += n
            if kind != "dedicated":
                spot_active.add(tenant)
    training = sum(n.gpus for n in nodes if n.pool != "serving")
    capacity = max(0, training - sum(r["dedicated_gpus"] for r in rows.values()) + lent_gpus)
    weights = sum(rows[t]["weight"] for t in spot_active if t in rows)
    for t in spot_active:
        if t in rows and weights > 0:
            rows[t]["fair_share_gpus"] = round(capacity * rows[t]["weight"] / weights, 2)
    return list(rows.values())


def queue_view(head: Sequence[JobRow | QueuedJob], total: int, usage: list[dict[str, Any]],
               free_training: int, free_lent: int, now_s: float, viewer: str | None) -> dict[str, Any]:
    """The first waiting jobs (``head``, :meth:`~tidal.control.store.Store.waiting_head`: about the
    scheduler's order) of ``total``, each with ``position`` and ``why``. Another tenant's job shows only its
    tenant, kind, size and position (``viewer``; None: admin)."""
    by_tenant = {u["tenant"]: u for u in usage}
    rows = []
    for pos, j in enumerate(head, 1):
        mine = viewer is None or j.tenant == viewer
        rows.append({"position": pos, "job": j.id if mine else None, "tenant": j.tenant, "kind": j.kind,
                     "priority": j.priority, "state": j.state, "min_gpus": j.min_gpus, "max_gpus": j.max_gpus,
                     "waiting_s": round(max(0.0, now_s - j.submit_s), 1),
                     "why": _why(j, by_tenant.get(j.tenant), free_training, free_lent, now_s, pos, mine)})
    return {"total": total, "shown": len(rows), "jobs": rows}


def _why(j: JobRow | QueuedJob, u: dict[str, Any] | None, free_training: int, free_lent: int, now_s: float,
         pos: int, mine: bool = True) -> str:
    """Why ``j`` waits; for another tenant's job (``mine`` False) without that tenant's quota, usage,
    share or restarts."""
    if j.state == State.BACKOFF:
        if not mine:
            return "restarting after a failure"
        left = (j.retry_at_s or now_s) - now_s
        return f"restarting after a failure (restart {j.restarts}/{j.max_restarts}) in {max(0.0, left):.0f} s"
    if j.nominated_s is not None:
        return "other jobs are being stopped to make room for it"
    told = j.waiting if isinstance(j, QueuedJob) else None
    if mine and told is not None and told.reason:
        return told.reason  # the scheduler's own reason, from the checks that decided (the loop's view)
    if j.kind == "dedicated" and u is not None and u["dedicated_gpus"] + j.min_gpus > u["quota_gpus"]:
        if not mine:
            return "its tenant's quota"
        return (f"its tenant's quota: {u['dedicated_gpus']} of {u['quota_gpus']} dedicated GPUs in use, "
                f"it needs {j.min_gpus}")
    free = free_training + (free_lent if j.kind != "dedicated" else 0)
    if j.min_gpus > free:
        lent = j.kind != "dedicated" and free_lent
        where = "free" + (" (training pool and idle lent GPUs)" if lent else "")
        return f"needs {j.min_gpus} GPUs, {free} {where}"
    if u is not None and j.kind != "dedicated" and u["fair_share_gpus"] is not None \
            and u["spot_gpus"] >= u["fair_share_gpus"]:
        if not mine:
            return "its tenant is at its fair share"
        return (f"its tenant holds {u['spot_gpus']} spot GPUs, at or over its fair share of "
                f"{u['fair_share_gpus']:g}")
    return "next scheduling step" if pos == 1 else "behind the jobs ahead of it"


def curves(job_dir: Path, attempts: int, max_points: int = CURVE_POINTS) -> dict[str, Any]:
    """Rank 0's step records per attempt (``[time, step, loss, step_time_s, samples_per_s]``) thinned to
    ``max_points``, with each attempt's restore and checkpoints. Files are opened without following links,
    only their newest ``CURVE_TAIL_BYTES`` read; a damaged line is skipped."""
    out: list[dict[str, Any]] = []
    first = max(1, attempts - CURVE_ATTEMPTS + 1)
    for a in range(first, attempts + 1):
        path = job_dir / attempt_dirname(a) / PROGRESS_DIRNAME / progress_file(0)
        points: list[list[Any]] = []
        restore = None
        ckpts: list[list[Any]] = []
        truncated = False
        for r in _records(path):
            if r is _TRUNCATED:
                truncated = True
                continue
            ev = r.get("event")
            if ev == "step" and isinstance(r.get("step"), int):
                points.append([_num(r.get("time")), r["step"], _num(r.get("loss")),
                               _num(r.get("step_time_s")), _num(r.get("samples_per_s"))])
            elif ev == "restore":
                fallbacks = r.get("fallbacks")
                restore = {"step": r.get("step"), "tier": _text(r.get("tier")),
                           "duration_s": _num(r.get("duration_s")),
                           "fallbacks": fallbacks if isinstance(fallbacks, int) else None}
            elif ev == "checkpoint" and isinstance(r.get("step"), int):
                ckpts.append([_num(r.get("time")), r["step"], _num(r.get("stall_s")), _text(r.get("reason"))])
        n = len(points)
        if n > max_points:
            stride = n / max_points
            points = [points[int(i * stride)] for i in range(max_points - 1)] + [points[-1]]
        out.append({"attempt": a, "points": points, "steps_recorded": n, "restore": restore,
                    "checkpoints": ckpts[-200:], "truncated": truncated})
    return {"attempts": out, "first_attempt": first}


_TRUNCATED: dict = {}


def _records(path: Path):
    try:
        f = open_plain(path)
    except OSError:
        return
    with f:
        st = os.fstat(f.fileno())
        start = max(0, st.st_size - CURVE_TAIL_BYTES)
        f.seek(start)
        data = f.read(CURVE_TAIL_BYTES)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first one is cut
        yield _TRUNCATED
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            yield r


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _text(x: Any) -> str | None:
    return str(x)[:200] if x is not None else None

"""Store rows as the REST API answers them, each built as its :mod:`tidal.control.schemas` model."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.control import schemas as sc
from tidal.control.accounting import job_report
from tidal.control.read_view import PlaneView
from tidal.control.schemas import answer
from tidal.control.states import HELD, STOPPING, State
from tidal.control.store import EventRow, HeldJob, JobRow
from tidal.model import Node

_COMPUTED = frozenset({"gpus", "progress", "report", "waiting"})
"""Fields of :class:`~tidal.control.schemas.Job` that are not a ``JobRow`` attribute of the same name."""


def job_view(j: JobRow, now_s: float, *, detail: bool = False,
             view: PlaneView | None = None) -> dict[str, Any]:
    """The API's job (:class:`~tidal.control.schemas.Job`, :class:`~tidal.control.schemas.JobDetail`
    with ``detail``): the model's fields read from the row, but for those computed here; why it waits from
    the reconcile loop's newest ``view`` (none without one)."""
    model = sc.JobDetail if detail else sc.Job
    w = view.why(j) if view is not None else None
    waiting = (sc.Waiting(reason=w.reason, until_s=w.until_s)
               if w is not None and State(j.state) in (State.PENDING, State.RUNNING) else None)
    return answer(model(
        **{f: getattr(j, f) for f in model.model_fields if f not in _COMPUTED},
        gpus=sc.Gpus(min=j.min_gpus, max=j.max_gpus, multiple_of=j.multiple_of), progress=j.progress or {},
        report=sc.Report.model_validate(job_report(j, now_s)), waiting=waiting))


def event_view(e: EventRow) -> dict[str, Any]:
    """:class:`~tidal.control.schemas.Event`."""
    return answer(sc.Event.model_validate({
        "id": e.id, "time_s": e.time_s, "job": e.job_id, "tenant": e.tenant, "kind": e.kind,
        "from": e.from_state, "to": e.to_state, "message": e.message, "data": e.data}))


def pool_view(nodes: Sequence[Node], jobs: Sequence[HeldJob | JobRow], viewer: str | None,
              pending: int | None = None, *, offset: int = 0, limit: int | None = None,
              as_of_s: float | None = None) -> dict[str, Any]:
    """:class:`~tidal.control.schemas.Pool`: GPUs per node: allocated (by tenant; job ids only for
    ``viewer``'s own jobs, all for admin ``viewer=None``), draining (being released) and free; the nodes from
    ``offset``, ``limit`` of them, the totals over all, as of ``as_of_s``. ``pending``: the viewer's pending
    jobs (None: counted in ``jobs``). Work follows the nodes listed and the held jobs."""
    on: dict[str, list[HeldJob | JobRow]] = {}
    for j in jobs:
        if State(j.state) in HELD:
            for name in j.placement or {}:
                on.setdefault(name, []).append(j)
    out = []
    for n in nodes[offset:None if limit is None else offset + limit]:
        holders = []
        allocated = draining = 0
        for j in on.get(n.name, ()):
            g = (j.placement or {}).get(n.name, 0)
            if not g:
                continue
            d = (g if State(j.state) in (State.PREEMPTING, State.CANCELLING)
                 else (j.releasing or {}).get(n.name, 0))
            allocated += g
            draining += d
            mine = viewer is None or j.tenant == viewer
            holders.append(sc.PoolHolder(
                job=j.id if mine else None, tenant=j.tenant, gpus=g, draining=d,
                state=j.state if mine else ("stopping" if State(j.state) in STOPPING else "running")))
        out.append(sc.PoolNode(name=n.name, pool=n.pool, gpus=n.gpus, allocated=allocated, draining=draining,
                               free=n.gpus - allocated, jobs=holders))
    total = sum(n.gpus for n in nodes)
    names = {n.name for n in nodes}
    alloc = sum(g for j in jobs if j.state in HELD for n, g in (j.placement or {}).items() if n in names)
    if pending is None:
        pending = sum(1 for j in jobs if j.state == State.PENDING and (viewer is None or j.tenant == viewer))
    return answer(sc.Pool(nodes=out, gpus=total, allocated=alloc, free=total - alloc, pending=pending,
                          nodes_total=len(nodes), offset=offset, as_of_s=as_of_s))


def checkpoint_view(job_id: str, url: str | None, now_s: float, *, tiers: list | None = None,
                    shm_base: str | None = None) -> dict[str, Any]:
    """:class:`~tidal.control.schemas.Checkpoints`: a job's committed steps per tier. Directory and shm tiers
    are listed on local storage; ``s3://`` and ``peer`` ones come from the job's status file, never from a
    connection (the API makes no outbound call a tenant chose). A tier that cannot be listed carries its
    ``error``.
    """
    from tidal.ckpt.engine.status import read_status
    from tidal.ckpt.errors import CheckpointError
    from tidal.ckpt.tiers.config import build, kind_of, normalize, resolve
    from tidal.ckpt.tiers.directory import SHM_BASE_ENV, DirTier, shm_root_for

    out: dict[str, Any] = {"job": job_id, "url": url, "tiers": [], "steps": [], "newest_step": None,
                           "newest_durable_step": None, "newest_durable_s": None, "durable_age_s": None,
                           "status_file": None, "status_updated_s": None}
    saved: dict[int, float] = {}
    rows: list[dict[str, Any]] = []
    listed: list = []
    remote: list[tuple[str, str, str]] = []  # (name, kind, location): from the status file only
    try:
        if tiers:
            url, cfgs = resolve(tiers, default_keep=0)
            listed = [build(c, url) for c in cfgs if c.kind == "dir"]
            remote = [(c.name, c.kind, c.location) for c in cfgs if c.kind in ("s3", "peer")]
        elif url is not None:
            kind = kind_of(url, "checkpoint.url")
            if kind == "dir":
                listed = [DirTier("disk", normalize(url, kind), fsync=False)]
            else:
                remote = [(kind, kind, normalize(url, kind))]
    except (CheckpointError, OSError, ValueError) as e:
        rows = [{"name": "?", "kind": "?", "location": str(url or tiers), "durable": True, "steps": [],
                 "committed_s": {}, "source": "storage", "error": f"{type(e).__name__}: {e}"}]
    out["url"] = url
    if url is None:
        return _checkpoints(out, rows)
    base = shm_base or os.environ.get(SHM_BASE_ENV) or "/dev/shm"
    shm_root = Path(base) / "tidal" / shm_root_for(url).name
    if shm_root.is_dir():
        listed.insert(0, DirTier("shm", shm_root, fsync=False))
    for t in listed:
        row: dict[str, Any] = {"name": t.name, "kind": t.kind, "location": t.location, "durable": t.durable,
                               "steps": [], "committed_s": {}, "source": "storage", "error": None}
        try:
            committed = t.committed()
            row["steps"] = sorted(committed)
            row["committed_s"] = {str(k): v for k, v in sorted(committed.items())}
        except (CheckpointError, OSError, ValueError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    status_path = shm_root / "status.json"
    if status_path.is_file():
        try:
            st = read_status(status_path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # the job wrote it
            out["status_error"] = f"{status_path}: {e}"
        else:
            out["status_file"], out["status_updated_s"] = str(status_path), st.updated_unix_s
            saved = {s.step: s.saved_unix_s for s in st.steps if s.saved_unix_s is not None}
            seen = {(r["kind"], _where(r["kind"], r["location"])) for r in rows}
            for ts in st.tiers:
                if ts.kind == "shm" or (ts.kind, _where(ts.kind, ts.location)) in seen:
                    continue
                rows.append({"name": ts.name, "kind": ts.kind, "location": ts.location, "durable": ts.durable,
                             "steps": list(ts.steps), "committed_s": {}, "source": "status",
                             "error": ts.last_error})
    seen = {(r["kind"], _where(r["kind"], r["location"])) for r in rows}
    for name, kind, location in remote:
        if (kind, _where(kind, location)) not in seen:
            rows.append({"name": name, "kind": kind, "location": location, "durable": True, "steps": [],
                         "committed_s": {}, "source": "spec", "error": None})
    steps = sorted(set().union(*(r["steps"] for r in rows))) if rows else []
    out["steps"] = steps
    out["newest_step"] = steps[-1] if steps else None
    durable = [r for r in rows if r["durable"] and r["steps"]]
    if durable:
        step = max(r["steps"][-1] for r in durable)
        when = saved.get(step)
        if when is None:
            times = [r["committed_s"][str(step)] for r in durable if str(step) in r["committed_s"]]
            when = min(times) if times else None
        out["newest_durable_step"], out["newest_durable_s"] = step, when
        out["durable_age_s"] = round(max(0.0, now_s - when), 3) if when is not None else None
    return _checkpoints(out, rows)


def _checkpoints(out: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return answer(sc.Checkpoints(**{**out, "tiers": [sc.CheckpointTier(**r) for r in rows]}))


def _where(kind: str, location: str) -> str:
    return os.path.normpath(location) if kind == "dir" else location.rstrip("/")

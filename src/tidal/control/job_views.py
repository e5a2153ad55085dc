"""The store's job rows as the scheduler sees them (:func:`scheduler_view`) and an attempt's environment for
the executor (:func:`job_env`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

from tidal import contract as c
from tidal.contract import DEFAULT_GRACE_S
from tidal.control.states import HELD, TERMINAL
from tidal.control.states import State as S
from tidal.control.store import JobRow, Store
from tidal.model import Job, Kind, Tenant


def scheduler_view(store: Store, rows: list[JobRow] | None = None) -> tuple[list[Tenant], list[Job]]:
    """The scheduler's view of the store (or of its active ``rows``): pending jobs queue, held ones run,
    stopping ones release all."""
    tenants = [Tenant(t.name, t.quota_gpus, t.weight) for t in store.tenants()]
    jobs = []
    for j in store.jobs(states={S.PENDING} | HELD) if rows is None else rows:
        st = S(j.state)
        held = st in HELD
        if not held and st != S.PENDING:
            continue
        releasing = dict(j.placement) if st in (S.PREEMPTING, S.CANCELLING) else dict(j.releasing or {})
        jobs.append(Job(  # (Job checks the kind)
            j.id, j.tenant, cast(Kind, j.kind), j.priority, j.min_gpus, j.max_gpus, j.multiple_of,
            submit_s=j.submit_s, placement=dict(j.placement) if held else {},
            releasing=releasing if held else {}, started_s=j.started_s if held else None,
            last_preempted_s=j.last_preempted_s, last_grown_s=j.last_grown_s, last_shrunk_s=j.last_shrunk_s,
            last_ckpt_s=j.last_ckpt_s, ckpt_stall_s=j.ckpt_stall_s, ckpt_interval_s=j.ckpt_interval_s,
            nominated_s=None if held else j.nominated_s))
    return tenants, jobs


def default_ckpt(ckpt_root: Path | None, job: JobRow) -> str | None:
    """The job's checkpoint location when its spec names none: ``<ckpt_root>/<job>/ckpt``."""
    return str(ckpt_root / job.id / "ckpt") if ckpt_root else None


def own_dirs(job: JobRow, ckpt_root: Path | None) -> tuple[str, ...]:
    """The checkpoint directories the executor makes for the job before its ranks start (its uid cannot create
    them in the state dir): its default location when used (or that of the job it resumes), and each directory
    of its spec under ``<state dir>/tenants/<tenant>/``."""
    ck = job.spec.get("checkpoint") or {}
    default = default_ckpt(ckpt_root, job)
    if ck.get("tiers") is None and ck.get("url") in (None, default):
        return (default,) if default else ()
    if ckpt_root is None:
        return ()
    resumed = str(ckpt_root / ck["resume_from"] / "ckpt") if ck.get("resume_from") else None
    if resumed is not None and ck.get("tiers") is None and ck.get("url") == resumed:
        return (resumed,)  # the default location of the job it resumes: made here if that job never ran
    from tidal.control.locations import TENANTS_DIRNAME, locations

    prefix = (ckpt_root.parent / TENANTS_DIRNAME / job.tenant).resolve()
    try:
        _, locs = locations(ck)
    except ValueError:
        return ()
    return tuple(loc for kind, loc, _ in locs if kind == "dir" and Path(loc).resolve().is_relative_to(prefix))


def taken_over(job: JobRow, store: Store) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The directories ``job`` took over with ``resume_from`` and the ended jobs of its tenant at them; ``((),
    ())`` for a job that resumes nothing."""
    ck = job.spec.get("checkpoint") or {}
    rid = ck.get("resume_from")
    if not rid:
        return (), ()
    from tidal.control.locations import locations, overlaps

    try:
        _, locs = locations(ck)
    except ValueError:
        return (), ()
    dirs = tuple(loc for kind, loc, _ in locs if kind == "dir")
    earlier = {rid} | {jid for jid, tenant, loc, state in store.ckpt_locations()
                       if jid != job.id and tenant == job.tenant and S(state) in TERMINAL
                       and any(overlaps(loc, d) for d in dirs)}
    return (dirs, tuple(sorted(earlier))) if dirs else ((), ())


def job_env(job: JobRow, ckpt_root: Path | None, max_interval_s: float) -> dict[str, str]:
    """The job's own variables plus the runtime's: checkpoint interval (``auto``: the policy's once the
    stall is measured, until then ``max_interval_s``), grace, and the checkpoint tiers or location."""
    spec = job.spec
    ck = spec.get("checkpoint") or {}
    url = ck.get("url") or default_ckpt(ckpt_root, job)
    env = dict(spec.get("env") or {})
    interval = ck.get("interval_s", "auto")
    if interval == "auto":
        interval = job.ckpt_interval_s or max_interval_s
    env[c.ENV_CKPT_INTERVAL_S] = f"{float(interval):g}"
    env[c.ENV_GRACE_S] = f"{float(spec.get('grace_s', DEFAULT_GRACE_S)):g}"
    if ck.get("tiers"):
        env[c.ENV_CKPT_TIERS] = json.dumps(ck["tiers"])
    elif url:
        env[c.ENV_CKPT_URL] = url
    return env

"""Freeing jobs' node-memory checkpoint tiers (shared-memory directories) and the steps the checkpoint agents
keep of them, once nobody needs them: at once when the newest checkpoint is in a tier that outlives them, else
``isolation.shm_retention_s`` after the job ended. The controller calls :func:`sweep` and
:func:`sweep_agents`.
"""

from __future__ import annotations

import functools
import json
import logging

from tidal.control.states import TERMINAL
from tidal.control.states import State as S
from tidal.control.store import JobRow, NotFound, Store
from tidal.exec.protocol import AgentMemory, NodeMemory

log = logging.getLogger(__name__)


def sweep(store: Store, executor: NodeMemory, retention_s: float, now_s: float) -> list[str]:
    """Free the directories of ended jobs (an unknown job's at once); returns the jobs freed, each an
    ``shm_freed`` event."""
    freed = []
    for job_id in executor.shm_jobs():
        try:
            job = store.job(job_id)
        except NotFound:
            job, why = None, "the store does not know the job"
        if job is not None:
            if S(job.state) not in TERMINAL:
                continue
            p = job.progress or {}
            ckpt, durable = job.ckpt_step, p.get("durable_ckpt_step")
            if ckpt is None or (durable is not None and durable >= ckpt):
                why = f"{job.state}; its newest checkpoint (step {ckpt}) is durable" if ckpt is not None \
                    else f"{job.state} without a checkpoint"
            elif (age_s := now_s - (job.finished_s or now_s)) >= retention_s:
                why = (f"{job.state} {age_s:.0f} s ago (retention "
                       f"{retention_s:g} s); step {ckpt} was only in node memory")
            else:
                continue
        if executor.free_shm(job_id):
            freed.append(job_id)
            if job is not None:
                store.record("shm_freed", f"shared-memory tier freed: {why}", now_s, job=job)
            else:
                log.info("freed the orphan shared-memory directory of %s: %s", job_id, why)
    return freed


def agent_namespaces(spec: dict) -> dict[str, list[str]]:
    """A job's peer namespaces in the executor's own agents, each with the names of the job's tiers that
    outlive the agents; {} without a peer tier or for a refused spec."""
    tiers = (spec.get("checkpoint") or {}).get("tiers")
    return _namespaces(json.dumps(tiers, sort_keys=True)) if tiers else {}


@functools.lru_cache(maxsize=4096)
def _namespaces(tiers_json: str) -> dict[str, list[str]]:  # every sweep reads every job's spec
    from tidal.ckpt.errors import TierSpecError
    from tidal.ckpt.tiers.config import resolve

    try:
        _, cfgs = resolve(json.loads(tiers_json), default_keep=0)
    except (TierSpecError, ValueError, TypeError):
        return {}
    durable = [c.name for c in cfgs if c.kind in ("dir", "s3")]
    own = [c for c in cfgs if c.kind == "peer" and not c.options.get("agent")]
    return {c.location[len("peer://"):]: durable for c in own}


def _agent_why(job: JobRow, durable: list[str], retention_s: float, now_s: float) -> str | None:
    """Why the agents' copy of an ended job may go now, or None (it runs, or may still be restored from)."""
    if S(job.state) not in TERMINAL:
        return None
    ckpt, tiers = job.ckpt_step, (job.progress or {}).get("tiers") or {}
    also = [t for t in durable if isinstance(tiers.get(t), list) and ckpt is not None and tiers[t][0] >= ckpt]
    if ckpt is None or also:
        return (f"{job.state}; its newest checkpoint (step {ckpt}) is also in tier {also[0]}" if also
                else f"{job.state} without a checkpoint")
    if (age_s := now_s - (job.finished_s or now_s)) >= retention_s:
        return (f"{job.state} {age_s:.0f} s ago (retention {retention_s:g} s); step "
                f"{ckpt} was only in the agents' memory")
    return None


def sweep_agents(store: Store, executor: AgentMemory, retention_s: float, now_s: float) -> list[str]:
    """Free the steps ended jobs keep in the executor's agents, by :func:`sweep`'s rule. A namespace no job
    names is left alone; one several jobs name is freed once none needs it. Returns the namespaces freed
    (``agent_freed`` events)."""
    named: dict[str, list[tuple[JobRow, list[str]]]] = {}
    for job in store.jobs():
        for ns, durable in agent_namespaces(job.spec).items():
            named.setdefault(ns, []).append((job, durable))
    if not any(S(job.state) in TERMINAL for jobs in named.values() for job, _ in jobs):
        return []  # nothing to free: the agents are not even asked
    held = set(executor.agent_jobs())
    freed = []
    for ns, jobs in sorted((ns, jobs) for ns, jobs in named.items() if ns in held):
        whys = [_agent_why(job, durable, retention_s, now_s) for job, durable in jobs]
        if None in whys or not executor.free_agent_job(ns):
            continue
        freed.append(ns)
        for (job, _), why in zip(jobs, whys, strict=True):
            store.record("agent_freed", f"checkpoint agents' memory ({ns}) freed: {why}", now_s, job=job)
    return freed

"""Freeing jobs' node-memory checkpoint tiers (shared-memory directories) once nobody needs them.

The controller calls :func:`sweep` every ``SHM_SWEEP_S`` at most (and once at the end of a step that
ended an attempt), for an executor that keeps node memory (:class:`~tidal.exec.protocol.NodeMemory`:
the local executor, and the Ray executor on each of its nodes).
"""

from __future__ import annotations

import logging

from tidal.control.states import TERMINAL
from tidal.control.states import State as S
from tidal.control.store import NotFound, Store
from tidal.exec.protocol import NodeMemory

log = logging.getLogger(__name__)


def sweep(store: Store, executor: NodeMemory, retention_s: float, now_s: float) -> list[str]:
    """Free the directories of ended jobs: once the newest checkpoint is in a durable tier (or there is
    none), else ``retention_s`` after the job ended; a directory of a job the store does not know is an
    orphan, freed at once. Returns the jobs freed; each freeing is an ``shm_freed`` event."""
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
            elif now_s - (job.finished_s or now_s) >= retention_s:
                why = (f"{job.state} {now_s - job.finished_s:.0f} s ago (retention "  # type: ignore[operator]
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

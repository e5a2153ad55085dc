"""What a job's attempts cost and earned: held, productive and lost seconds, restarts, ETTR. The controller
adds each finished attempt (:func:`account`); views and metrics report the attempt in flight too
(:func:`job_report`)."""

from __future__ import annotations

from typing import Any

from tidal.control.states import HELD
from tidal.control.states import State as S
from tidal.control.store import HeldJob, JobRow
from tidal.exec.protocol import Observation, RankState


def account(job: JobRow, ob: Observation, now_s: float, success: bool) -> dict[str, Any]:
    """Add one attempt to the job's totals: seconds held, productive, lost (steps re-run next time)."""
    p = ob.progress
    start = p.start_step if p.start_step is not None else (job.ckpt_step or 0)
    reached = p.step if p.step is not None else start
    kept = reached if success else min(reached, max(start, p.ckpt_step if p.ckpt_step is not None else start))
    mean = p.mean_step_s or 0.0
    return {"held_s": job.held_s + max(0.0, now_s - ob.launched_s),
            "productive_s": job.productive_s + (kept - start) * mean,
            "lost_s": job.lost_s + (reached - kept) * mean, "lost_steps": job.lost_steps + (reached - kept)}


def job_report(job: JobRow | HeldJob, now_s: float) -> dict[str, Any]:
    """Restarts, lost work and ETTR (productive seconds / seconds holding GPUs) of a job, including the
    attempt in flight; steps past the newest checkpoint of a failed attempt are lost."""
    held, productive = job.held_s, job.productive_s
    if S(job.state) in HELD and job.attempt_launched_s is not None:
        held += max(0.0, now_s - job.attempt_launched_s)
        p = job.progress or {}
        mean = p.get("steps_per_s") and 1.0 / p["steps_per_s"]
        if p.get("step") is not None and mean:
            productive += (p["step"] - (p.get("start_step") or 0)) * mean
    return {"restarts": job.restarts, "preemptions": job.preemptions, "lost_work_s": round(job.lost_s, 3),
            "lost_steps": job.lost_steps, "held_s": round(held, 3), "productive_s": round(productive, 3),
            "ettr": round(productive / held, 4) if held > 0 else None}


def rank_code(r: RankState) -> int | None:
    """The rank's exit code as the platform counts it: a rank whose runtime closed cleanly first
    (``RankState.ended``) exited 0, whatever signal the interpreter's teardown raised after."""
    return 0 if r.ended else r.exit_code


def describe_rank(r: RankState) -> str:
    """One line on how a rank ended, for the job's message and events."""
    if r.vanished:
        return f"rank {r.rank} (pid {r.pid}) vanished without an exit code"
    c = r.exit_code
    if c is not None and c < 0:
        return f"rank {r.rank} was killed by signal {-c}"
    return f"rank {r.rank} exited with code {c}"

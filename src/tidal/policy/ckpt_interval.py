"""How often each running job should checkpoint: Young/Daly from its save stall and its risk. Pure.

A save costs its stall ``δ``; interruptions (failures per GPU-hour × GPUs, plus the surprise-reclaim
risk of each loaned node the job runs on) come at rate ``1 / M``. Daly's optimum of compute time
between saves, ``τ = sqrt(2 δ M) · (1 + (1/3)·sqrt(δ / 2M) + (1/9)·(δ / 2M)) − δ`` (``M`` if ``δ >=
2M``); the interval returned is ``τ + δ``, clamped to ``[max(min_interval_s, persist_s), max_interval_s]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tidal.model import Job, Loan, SetCkptInterval, Snapshot

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (16_384 * 54 * 24)  # 419 interruptions, 16,384 GPUs, 54 days


@dataclass(frozen=True)
class CkptIntervalConfig:
    """Knobs of the checkpoint-interval policy: failures per GPU-hour (default Llama 3's), the bounds of
    the interval (s), and ``change_ratio``: a job is told a new interval only when it differs from its
    current one by more than this fraction (no chatter from a noisy stall)."""

    failure_rate_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    min_interval_s: float = 30.0
    max_interval_s: float = 3600.0
    change_ratio: float = 0.2

    def __post_init__(self) -> None:
        for name in ("failure_rate_per_gpu_hour", "min_interval_s", "change_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"CkptIntervalConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError(f"CkptIntervalConfig: need 0 < min_interval_s ({self.min_interval_s}) <= "
                             f"max_interval_s ({self.max_interval_s})")


def mtti_s(gpus: int, failure_rate_per_gpu_hour: float, reclaim_risk_per_hour: float = 0.0) -> float:
    """Mean time to interruption of a gang of ``gpus`` GPUs, seconds (``inf`` if nothing can interrupt it)."""
    if gpus < 0 or failure_rate_per_gpu_hour < 0 or reclaim_risk_per_hour < 0:
        raise ValueError(f"mtti_s: gpus ({gpus}) and rates must be >= 0")
    rate_per_hour = gpus * failure_rate_per_gpu_hour + reclaim_risk_per_hour
    return math.inf if rate_per_hour == 0 else 3600.0 / rate_per_hour


def daly_interval_s(stall_s: float, mtti_s: float) -> float:
    """Daly's higher-order optimum, ``τ + δ`` seconds between save starts (unclamped; see the module doc)."""
    _check(stall_s, mtti_s)
    d, m = stall_s, mtti_s
    if m == math.inf:
        return math.inf
    if d >= 2.0 * m:
        return m + d
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0)


def _check(stall_s: float, mtti_s: float) -> None:
    if not stall_s >= 0 or not mtti_s > 0:
        raise ValueError(f"need stall_s >= 0 and mtti_s > 0, got stall_s={stall_s}, mtti_s={mtti_s}")


def checkpoint_interval_s(stall_s: float, mtti_s: float, config: CkptIntervalConfig | None = None,
                          persist_s: float = 0.0) -> float:
    """Daly's interval for this stall and risk, clamped to the configured bounds (seconds)."""
    cfg = config or CkptIntervalConfig()
    lo = max(cfg.min_interval_s, persist_s)
    hi = max(cfg.max_interval_s, lo)
    return min(hi, max(lo, daly_interval_s(stall_s, mtti_s)))


def job_mtti_s(job: Job, loans: Mapping[str, Loan], config: CkptIntervalConfig | None = None) -> float:
    """A running job's mean time to interruption: its GPUs' failures plus the surprise-reclaim risk of
    every loaned node it runs on."""
    cfg = config or CkptIntervalConfig()
    risk = sum(loans[n].reclaim_risk_per_hour for n in job.placement if n in loans)
    return mtti_s(job.gpus, cfg.failure_rate_per_gpu_hour, risk)


def plan_ckpt_intervals(snapshot: Snapshot, config: CkptIntervalConfig | None = None,
                        persist_s: Mapping[str, float] | None = None) -> list[SetCkptInterval]:
    """A :class:`~tidal.model.SetCkptInterval` for each running, not stopping job that measured its stall
    and has no interval yet or one off by more than ``change_ratio``. ``persist_s``: job id -> seconds to
    persist one checkpoint, where measured. Separate from ``schedule()``; O(running jobs)."""
    cfg = config or CkptIntervalConfig()
    loans = {ln.node: ln for ln in snapshot.loans}
    out = []
    for job, stall_s in _measured(snapshot.running):
        interval = checkpoint_interval_s(stall_s, job_mtti_s(job, loans, cfg), cfg,
                                         (persist_s or {}).get(job.id, 0.0))
        cur = job.ckpt_interval_s
        if cur is None or abs(interval - cur) > cfg.change_ratio * cur:
            out.append(SetCkptInterval(job.id, interval))
    return out


def _measured(jobs: Iterable[Job]) -> Iterable[tuple[Job, float]]:
    """(job, its measured stall) for the jobs that measured one and are not stopping."""
    return ((j, j.ckpt_stall_s) for j in jobs if j.ckpt_stall_s is not None and not j.stopping)

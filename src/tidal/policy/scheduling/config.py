"""The scheduler's knobs: one table, units in the names."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tidal.contract import DEFAULT_GRACE_S


@dataclass(frozen=True)
class SchedulerConfig:
    """Every knob of :func:`tidal.policy.scheduler.schedule` (docs/scheduling.md has the prose).

    * ``aging_per_s``: whole priority levels a pending job gains per second waiting, at most
      ``aging_max_levels``; aging only orders the queue, it never lets a job preempt.
    * ``nomination_ttl_s``: a job others were stopped for (``Job.nominated_s``) goes first this long.
    * ``preempt_priority_gap``: a job may preempt jobs at least this far below its priority.
    * ``min_runtime_before_preempt_s``: a job (re)started less than this ago is not preempted for
      priority or fair share (reclaims and quotas still may, taking older victims first).
    * ``preempt_grace_s``: a victim's time to checkpoint and leave (a reclaim sets its own).
    * ``hysteresis_s``: no grow this soon after a shrink, no shrink for demand this soon after a grow.
    * ``min_loan_left_s``: nothing starts or grows on a loaned GPU wanted back within this; keep it
      equal to ``LoanTiming.min_loan_window_s``.
    * ``max_skips_per_cycle`` (per phase) and ``max_preemption_attempts_per_cycle``: the work bounds
      that keep a call within milliseconds at 10,000 pending jobs.
    """

    aging_per_s: float = 1.0 / 3600.0
    aging_max_levels: int = 2
    nomination_ttl_s: float = 1800.0
    preempt_priority_gap: int = 1
    min_runtime_before_preempt_s: float = 900.0
    preempt_grace_s: float = DEFAULT_GRACE_S
    hysteresis_s: float = 300.0
    min_loan_left_s: float = 600.0
    max_skips_per_cycle: int = 64
    max_preemption_attempts_per_cycle: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v < 0:
                raise ValueError(f"SchedulerConfig.{f.name} must be >= 0, got {v}")
        if self.preempt_priority_gap < 1:
            raise ValueError(
                f"SchedulerConfig.preempt_priority_gap must be >= 1, got {self.preempt_priority_gap}"
            )

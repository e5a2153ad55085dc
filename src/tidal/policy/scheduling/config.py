"""The scheduler's knobs: one table, units in the names."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tidal.contract import DEFAULT_GRACE_S


@dataclass(frozen=True)
class SchedulerConfig:
    """Every knob of :func:`tidal.policy.scheduler.schedule`; docs/scheduling.md has the table. Keep
    ``min_loan_left_s`` equal to ``LoanTiming.min_loan_window_s``."""

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
            raise ValueError("SchedulerConfig.preempt_priority_gap must be >= 1, got "
                             f"{self.preempt_priority_gap}")

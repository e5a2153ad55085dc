"""The scheduler's knobs: one table, units in the names."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tidal.contract import DEFAULT_GRACE_S


@dataclass(frozen=True)
class SchedulerConfig:
    """Every knob of :func:`tidal.policy.scheduler.schedule`. Defaults suit a pool of 8-GPU nodes.

    Ordering
        ``aging_per_s``: priority levels a pending job gains per second of waiting (whole levels:
        ``floor(wait_s * aging_per_s)``), at most ``aging_max_levels``. Aging only orders the queue
        (no starvation behind a stream of newer equal-priority work); it never makes a job eligible to
        preempt, so a requeued victim cannot preempt its preemptor back. ``nomination_ttl_s``: a pending
        job for which others were shrunk or preempted (``Job.nominated_s``) is considered first, ahead
        of aged priority, for this long: the GPUs its victims free go to it and not to whoever ranks
        first by the time they have drained (with aging, that could be a job it may preempt, and the
        two would take turns preempting each other).

    Preemption
        ``preempt_priority_gap``: a pending job may preempt running jobs whose priority is at least
        this far below its own. ``min_runtime_before_preempt_s``: a job (re)started less than this
        ago is not preempted for priority or fair share (a reclaim and a guaranteed quota override
        it, but still take older victims first). ``preempt_grace_s``: how long a victim has to write
        its final checkpoint and leave (``by_s = now + grace``; a reclaim sets its own); default the
        platform's grace, :data:`tidal.contract.DEFAULT_GRACE_S`.

    Hysteresis
        ``hysteresis_s``: a job shrunk less than this ago does not grow again, and one grown less than
        this ago is not shrunk for another job's demand (reclaims and quotas still shrink it).
        ``min_loan_left_s``: no job starts or grows on a loaned GPU that the loan plan wants back
        (``Loan.until_s`` or a :class:`~tidal.model.Reclaim` notice) within this many seconds. Keep
        it equal to the loan plan's ``LoanTiming.min_loan_window_s`` (default 600 s), or loans the
        plan found worth making go unused.

    Work bounds (what keeps one call within milliseconds at 10,000 pending jobs)
        ``max_skips_per_cycle``: pending jobs that neither fit nor preempt before the cycle stops
        looking further down the queues (counted separately for dedicated and spot jobs; queues of a
        tenant whose quota is full are dropped without counting). ``max_preemption_attempts_per_cycle``:
        pending jobs per cycle for which victims are searched (each search is O(running jobs));
        dedicated jobs, coming first, use them first.
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

"""Every knob of a simulation run, with units in the names; :func:`make_config` builds a consistent one
(the scheduler's ``min_loan_left_s`` is the loan plan's minimum window, the interval policy's failure
rate the simulated one) from the numbers a person types."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from tidal.policy.ckpt_interval import LLAMA3_FAILURES_PER_GPU_HOUR, CkptIntervalConfig
from tidal.policy.loan import LoanTiming
from tidal.policy.scheduling.config import SchedulerConfig

CkptMode = Literal["sync", "concurrent"]
ResizeMode = Literal["reshard", "restart-full"]
CKPT_MODES: tuple[CkptMode, ...] = get_args(CkptMode)  # ("sync", "concurrent")
RESIZE_MODES: tuple[ResizeMode, ...] = get_args(ResizeMode)  # ("reshard", "restart-full")

SIM_NOTICE_S = 120.0
"""The simulated fleet's notice (``LoanTiming.notice_s`` and ``preempt_grace_s``), as in the published
results: the simulated jobs are large and get longer than the platform's default grace."""


def sim_timing(**changes: float) -> LoanTiming:
    """The simulated fleet's loan timing: :class:`LoanTiming` with ``notice_s = SIM_NOTICE_S``."""
    return LoanTiming(**{"notice_s": SIM_NOTICE_S, **changes})


def sim_scheduler(**changes: Any) -> SchedulerConfig:
    """The simulated fleet's scheduler: :class:`SchedulerConfig` with ``preempt_grace_s = SIM_NOTICE_S``."""
    return SchedulerConfig(**{"preempt_grace_s": SIM_NOTICE_S, **changes})


@dataclass(frozen=True)
class CheckpointModel:
    """What a checkpoint and a restart cost a training job, in seconds (``sync``: the stall is the whole
    write; ``concurrent``: the copy to host memory, durable ``persist_s`` later; docs/simulator.md)."""

    mode: CkptMode = "concurrent"
    persist_s: float = 300.0
    stage_s: float = 5.0
    restart_s: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in CKPT_MODES:
            raise ValueError(f"CheckpointModel.mode must be one of {CKPT_MODES}, got {self.mode!r}")
        for name in ("persist_s", "stage_s", "restart_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"CheckpointModel.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def stall_s(self) -> float:
        """Training stops this long per checkpoint (periodic or final)."""
        return self.persist_s if self.mode == "sync" else self.stage_s

    @property
    def durable_lag_s(self) -> float:
        """From the end of a capture until the checkpoint survives a failure."""
        return 0.0 if self.mode == "sync" else self.persist_s


@dataclass(frozen=True)
class SimConfig:
    """A simulation run; seconds and GPUs (the options of ``tidal sim``, docs/simulator.md). ``step_s``:
    the serving grid (``None``: the trace's); ``sched_period_s``: between grid steps and notices the
    scheduler runs at most this often after a change."""

    serving_gpus: int
    training_gpus: int = 0
    gpus_per_node: int = 8
    days: float = 7.0
    warmup_days: float = 0.0
    step_s: float | None = None
    timing: LoanTiming = field(default_factory=sim_timing)
    ckpt: CheckpointModel = field(default_factory=CheckpointModel)
    resize: ResizeMode = "reshard"
    failure_rate_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    scaling_exponent: float = 1.0
    sched_period_s: float = 120.0
    scheduler: SchedulerConfig = field(default_factory=sim_scheduler)
    ckpt_interval: CkptIntervalConfig = field(default_factory=CkptIntervalConfig)
    seed: int = 0
    record_timeline: bool = True
    release_when_captured: bool = False
    """A job told to shrink or stop leaves once its final checkpoint is captured (as ``tidal.train`` does),
    instead of training on until the deadline (the published results)."""
    lend_to_takers: bool = False
    """Lend at most what spot jobs can use now beyond what they hold on loans, as the live plane does
    (:func:`tidal.policy.ledger.for_takers`); off: every lendable GPU has a taker (a saturated spot queue)."""

    def __post_init__(self) -> None:
        for name, ok, want in (
                ("serving_gpus", self.serving_gpus >= 1, ">= 1"),
                ("training_gpus", self.training_gpus >= 0, ">= 0"),
                ("gpus_per_node", self.gpus_per_node >= 1, ">= 1"), ("days", self.days > 0, "> 0"),
                ("warmup_days", 0 <= self.warmup_days < self.days, f"in [0, days={self.days:g})"),
                ("resize", self.resize in RESIZE_MODES, f"one of {RESIZE_MODES}"),
                ("scaling_exponent", 0 < self.scaling_exponent <= 1, "in (0, 1]"),
                ("failure_rate_per_gpu_hour", self.failure_rate_per_gpu_hour >= 0, ">= 0"),
                ("sched_period_s", self.sched_period_s >= 0, ">= 0")):
            if not ok:
                v = getattr(self, name)
                raise ValueError(f"SimConfig.{name} must be {want}, got {v!r}")

    @property
    def end_s(self) -> float:
        return self.days * 86400.0

    @property
    def score_from_s(self) -> float:
        return self.warmup_days * 86400.0


def make_config(*, serving_gpus: int, training_gpus: int = 0, gpus_per_node: int = 8, days: float = 7.0,
                warmup_days: float = 0.0, ckpt_mode: CkptMode = "concurrent", resize: ResizeMode = "reshard",
                persist_s: float = 300.0, stage_s: float = 5.0, restart_s: float = 300.0,
                notice_s: float = SIM_NOTICE_S, final_checkpoint_s: float = 120.0, release_s: float = 60.0,
                warmup_s: float = 900.0, failure_rate_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR,
                scaling_exponent: float = 1.0, sched_period_s: float = 120.0, seed: int = 0,
                step_s: float | None = None, record_timeline: bool = True) -> SimConfig:
    """A :class:`SimConfig` whose parts agree (the loan timing's ``restart_cost_s`` is ``restart_s``)."""
    timing = LoanTiming(notice_s=notice_s, final_checkpoint_s=final_checkpoint_s, release_s=release_s,
                        warmup_s=warmup_s, restart_cost_s=restart_s)
    return SimConfig(
        serving_gpus=serving_gpus, training_gpus=training_gpus, gpus_per_node=gpus_per_node, days=days,
        warmup_days=warmup_days, step_s=step_s, timing=timing,
        ckpt=CheckpointModel(mode=ckpt_mode, persist_s=persist_s, stage_s=stage_s, restart_s=restart_s),
        resize=resize, failure_rate_per_gpu_hour=failure_rate_per_gpu_hour, scaling_exponent=scaling_exponent,
        sched_period_s=sched_period_s, scheduler=sim_scheduler(min_loan_left_s=timing.min_loan_window_s),
        ckpt_interval=CkptIntervalConfig(failure_rate_per_gpu_hour=failure_rate_per_gpu_hour),
        seed=seed, record_timeline=record_timeline)


def with_modes(config: SimConfig, ckpt_mode: CkptMode, resize: ResizeMode) -> SimConfig:
    """``config`` with another checkpoint mode and resize mode."""
    return replace(config, ckpt=replace(config.ckpt, mode=ckpt_mode), resize=resize)

"""What a run measured: integrals over the scored time (from ``warmup_days``) of the serving side, the
jobs' accounts, and the summary. Every key is defined in docs/simulator.md, "Metrics"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRIC_KEYS = (
    "idle_serving_gpu_hours", "loaned_gpu_hours", "harvested_gpu_hours", "harvest_ratio",
    "serving_shortfall_gpu_hours", "shortfall_ratio", "reclaims", "lost_gpu_hours", "pool_goodput",
    "ettr_mean", "ettr_p10", "jain_fairness", "mean_queue_s", "p95_queue_s", "mean_jct_s", "wall_s",
    "decision_p99_ms",
)
"""The keys every policy's result has; results carry a few more."""


@dataclass
class Meter:
    """Integrates the serving side between events. ``advance(t)`` first, then change the state."""

    serving_gpus: int
    score_from_s: float
    last_s: float = 0.0
    demand: float = math.nan
    idle_gpu_s: float = 0.0
    demand_gpu_s: float = 0.0
    short_gpu_s: float = 0.0
    met_gpu_s: float = 0.0
    lent_gpu_s: float = 0.0
    held_on_loans_gpu_s: float = 0.0
    held_gpu_s: float = 0.0
    scored_s: float = 0.0

    def advance(self, t: float, capacity: int, lent: int, held_serving: int, held_total: int) -> None:
        a = max(self.last_s, self.score_from_s)
        if t > a:
            dt = t - a
            self.scored_s += dt
            d = self.demand
            if d == d:  # not NaN
                n = self.serving_gpus
                self.idle_gpu_s += max(0.0, n - d) * dt
                self.demand_gpu_s += d * dt
                self.short_gpu_s += max(0.0, d - capacity) * dt
                self.met_gpu_s += min(d, capacity) * dt
            self.lent_gpu_s += lent * dt
            self.held_on_loans_gpu_s += held_serving * dt
            self.held_gpu_s += held_total * dt
        self.last_s = max(self.last_s, t)


@dataclass
class JobTotals:
    """Per-job accounts summed at one moment (see :func:`job_totals`)."""

    kept_gpu_s: float = 0.0
    harvested_gpu_s: float = 0.0
    lost_gpu_s: float = 0.0
    held_by_tenant: dict[str, float] = field(default_factory=dict)


def job_totals(jobs: Any, t: float) -> JobTotals:
    """Kept progress (a running job's too), its share on loans, lost work and GPU-seconds held per tenant,
    up to ``t``."""
    out = JobTotals()
    held = out.held_by_tenant
    for sj in jobs:
        if sj.state == "new":
            continue
        p = sj.progress(t)
        loan, _ = sj.kept_split(p)
        out.kept_gpu_s += p
        out.harvested_gpu_s += loan
        out.lost_gpu_s += sj.lost_gpu_s
        h = sj.held_gpu_s + sj.job.gpus * max(0.0, t - sj.held_since)
        held[sj.spec.tenant] = held.get(sj.spec.tenant, 0.0) + h
    return out


def _pct(xs: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else math.nan


def jain(xs: list[float]) -> float:
    xs = [x for x in xs if x >= 0]
    if not xs or sum(xs) == 0:
        return math.nan
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def summarize(*, meter: Meter, start: JobTotals, end: JobTotals, jobs: Any, end_s: float, score_from_s: float,
              serving_gpus: int, training_gpus: int, weights: dict[str, float], counts: dict[str, int],
              decision_ms: list[float], plan_ms: list[float], wall_s: float) -> dict[str, Any]:
    """The metrics of one run (see the module docstring)."""
    h = 3600.0
    idle = meter.idle_gpu_s / h
    harvested = (end.harvested_gpu_s - start.harvested_gpu_s) / h
    kept = (end.kept_gpu_s - start.kept_gpu_s) / h
    demanded = meter.demand_gpu_s / h
    short = meter.short_gpu_s / h
    pool_h = (serving_gpus + training_gpus) * meter.scored_s / h
    ettr = []
    waits, jcts = [], []
    trace_jobs = [sj for sj in jobs if not sj.spec.synthetic]
    population = trace_jobs if trace_jobs else [sj for sj in jobs if sj.spec.synthetic]
    for sj in jobs:
        if math.isnan(sj.first_start_s):
            continue
        stop = sj.end_s if not math.isnan(sj.end_s) else end_s
        wall = stop - sj.first_start_s
        if wall >= 3600.0:
            _, secs = sj.kept_split(sj.progress(stop))
            ettr.append(min(1.0, secs / wall))
    for sj in population:
        if sj.spec.submit_s < score_from_s or sj.state == "new":
            continue
        start_s = sj.first_start_s if not math.isnan(sj.first_start_s) else end_s
        waits.append(start_s - sj.spec.submit_s)
        if not math.isnan(sj.end_s):
            jcts.append(sj.end_s - sj.spec.submit_s)
    tenants = sorted(set(end.held_by_tenant) | set(weights))
    fair = [(end.held_by_tenant.get(t, 0.0) - start.held_by_tenant.get(t, 0.0)) / weights.get(t, 1.0)
            for t in tenants if t in end.held_by_tenant]
    return {
        "idle_serving_gpu_hours": idle,
        "loaned_gpu_hours": meter.lent_gpu_s / h,
        "harvested_gpu_hours": harvested,
        "harvest_ratio": harvested / idle if idle > 0 else math.nan,
        "serving_shortfall_gpu_hours": short,
        "shortfall_ratio": short / demanded if demanded > 0 else math.nan,
        "reclaims": counts.get("reclaim_interruptions", 0),
        "lost_gpu_hours": (end.lost_gpu_s - start.lost_gpu_s) / h,
        "pool_goodput": (meter.met_gpu_s / h + kept) / pool_h if pool_h > 0 else math.nan,
        "ettr_mean": float(np.mean(ettr)) if ettr else math.nan,
        "ettr_p10": _pct(ettr, 10),
        "jain_fairness": jain(fair),
        "mean_queue_s": float(np.mean(waits)) if waits else math.nan,
        "p95_queue_s": _pct(waits, 95),
        "mean_jct_s": float(np.mean(jcts)) if jcts else math.nan,
        "wall_s": wall_s,
        "decision_p99_ms": _pct(decision_ms, 99),
        # extras
        "demanded_gpu_hours": demanded,
        "training_kept_gpu_hours": kept,
        "trained_on_loans_held_gpu_hours": meter.held_on_loans_gpu_s / h,
        "decision_p50_ms": _pct(decision_ms, 50),
        "schedule_calls": len(decision_ms),
        "loan_plan_p99_ms": _pct(plan_ms, 99),
        "jobs_completed": sum(1 for sj in jobs if not math.isnan(sj.end_s)),
        "jobs_submitted": sum(1 for sj in jobs if sj.state != "new"),
        "ettr_jobs": len(ettr),
        **{k: v for k, v in counts.items() if k != "reclaim_interruptions"},
    }

"""The live plane at pool scale: one workload through the real store, reconcile loop and scheduler over the
virtual executor (:func:`run_plane`) and through the simulator (:func:`run_sim`), and ``tidal bench plane``
(:func:`bench_plane`: step, submit, read and ``/metrics`` latencies, memory, database size, restart after a
kill -9, and parity with the simulator). A face: it drives the control plane and the simulator, which never
import each other. Figures and commands: docs/benchmarks.md.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidal.model import Admit, Grow, Preempt, Shrink, Tenant
from tidal.policy.scheduler import SchedulerConfig
from tidal.sim.jobs import JobSpec

T0 = 1_700_000_000.0  # the plane's clock at simulated time 0
SIZES = (1, 2, 4, 8, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Workload:
    """Jobs (the simulator's :class:`JobSpec`), their tenants and the pool they run on."""

    jobs: tuple[JobSpec, ...]
    tenants: tuple[Tenant, ...]
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def workload(n_jobs: int, nodes: int, gpus_per_node: int, *, span_s: float = 4 * 3600.0,
             tenants: int = 8, minutes: tuple[float, float] = (10.0, 120.0), dedicated: float = 0.25,
             seed: int = 0) -> Workload:
    """``n_jobs`` submitted uniformly over ``span_s``: sizes 1..512 GPUs (within the pool), durations
    log-uniform in ``minutes``, a ``dedicated`` fraction at priority 1 (fixed size), the rest spot and elastic
    (half to all of their size); each tenant's quota is an equal share of the pool."""
    rng = np.random.default_rng(seed)
    total = nodes * gpus_per_node
    sizes = [s for s in SIZES if s <= total] or [1]
    out = []
    for i, t in enumerate(np.sort(rng.uniform(0.0, span_s, n_jobs))):
        g = int(sizes[rng.integers(len(sizes))])
        dur_s = 60.0 * math.exp(rng.uniform(math.log(minutes[0]), math.log(minutes[1])))
        ded = bool(rng.random() < dedicated)
        out.append(JobSpec(id=f"j{i:06d}", tenant=f"team{rng.integers(tenants)}", kind="dedicated" if ded
                           else "spot", priority=1 if ded else 0, min_gpus=g if ded else max(1, g // 2),
                           max_gpus=g, work_gpu_s=round(g * dur_s), submit_s=float(t)))
    teams = tuple(Tenant(f"team{k}", total // tenants, 1.0) for k in range(tenants))
    return Workload(tuple(out), teams, nodes, gpus_per_node)


def spec_of(j: JobSpec, interval_s: float) -> dict[str, Any]:
    """The job spec (as submitted to the API) of a workload's job, its work in the virtual executor's env."""
    from tidal.exec.virtual import WORK_ENV

    return {"name": j.id, "command": ["virtual"], "kind": j.kind, "priority": j.priority,
            "gpus": {"min": j.min_gpus, "max": j.max_gpus}, "env": {WORK_ENV: f"{j.work_gpu_s:g}"},
            "checkpoint": {"interval_s": interval_s}}


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def run_plane(w: Workload, horizon_s: float, *, step_s: float = 10.0, notice_s: float = 30.0,
              interval_s: float = 600.0, db_url: str | None = None, state_dir: Path | None = None,
              scheduler: SchedulerConfig | None = None) -> dict[str, Any]:
    """Step the real plane (store, controller, scheduler) over the virtual executor on a simulated clock, from
    0 to ``horizon_s`` every ``step_s``, submitting each job at its time. Returns the GPU-hours held, the
    decisions counted, jobs succeeded, step latencies and a check that no node was ever over-committed."""
    from tidal.control.auth import create_tenant
    from tidal.control.config import ControlConfig
    from tidal.control.controller import Controller
    from tidal.control.spec import parse_spec
    from tidal.control.states import State
    from tidal.control.store import Store
    from tidal.exec.virtual import VirtualExecutor

    tmp = tempfile.TemporaryDirectory() if state_dir is None else None
    root = Path(tmp.name) if tmp is not None else Path(state_dir or ".")
    store = Store(db_url or f"sqlite:///{root}/tidal.db")
    try:
        for tenant in w.tenants:
            create_tenant(store, tenant.name, quota_gpus=tenant.quota_gpus, weight=tenant.weight,
                          max_priority=1)
        ex = VirtualExecutor(w.nodes, w.gpus_per_node, beat_s=step_s, notice_s=notice_s)
        cfg = ControlConfig(scheduler=scheduler or SchedulerConfig(preempt_grace_s=notice_s))
        ctl = Controller(store, ex, cfg)
        specs = [parse_spec(spec_of(j, interval_s)).model_dump() for j in w.jobs]
        cap = {n.name: n.gpus for n in ex.nodes()}
        nxt, held_gpu_s, over = 0, 0.0, 0
        counts = {"admissions": 0, "admitted_gpus": 0, "shrinks": 0, "preemptions": 0, "grows": 0}
        step_wall: list[float] = []
        for k in range(int(horizon_s // step_s) + 1):
            t = k * step_s
            while nxt < len(w.jobs) and w.jobs[nxt].submit_s <= t:
                store.submit(w.jobs[nxt].tenant, specs[nxt], T0 + t)
                nxt += 1
            t0 = time.perf_counter()
            decisions = ctl.step(T0 + t)
            step_wall.append(time.perf_counter() - t0)
            for d in decisions:
                if isinstance(d, Admit):
                    counts["admissions"] += 1
                    counts["admitted_gpus"] += sum(d.placement.values())
                counts["shrinks"] += isinstance(d, Shrink)
                counts["preemptions"] += isinstance(d, Preempt)
                counts["grows"] += isinstance(d, Grow)
            used = ex.used()
            over += any(g > cap.get(n, 0) for n, g in used.items())
            held_gpu_s += sum(used.values()) * step_s
        by_state = store.count_by_state()
        return {"held_gpu_hours": held_gpu_s / 3600.0, **counts, "over_committed_steps": over,
                "succeeded": by_state.get(State.SUCCEEDED.value, 0),
                "failed": by_state.get(State.FAILED.value, 0),
                "steps": len(step_wall), "step_p50_s": _pct(step_wall, 50), "step_p99_s": _pct(step_wall, 99)}
    finally:
        store.close()
        if tmp is not None:
            tmp.cleanup()


def run_sim(w: Workload, horizon_s: float, *, sched_period_s: float = 10.0, notice_s: float = 30.0,
            scheduler: SchedulerConfig | None = None) -> dict[str, Any]:
    """The same workload through the simulator, costs that the virtual executor does not model set to zero (no
    failures, no checkpoint stall, no restart time), no serving pool lent."""
    from tidal.sim.config import CheckpointModel, SimConfig
    from tidal.sim.engine import Engine
    from tidal.sim.policies import PolicySpec

    cfg = SimConfig(serving_gpus=1, training_gpus=w.gpus, gpus_per_node=w.gpus_per_node,
                    days=horizon_s / 86400, step_s=3600.0,
                    ckpt=CheckpointModel(persist_s=0.0, stage_s=0.0, restart_s=0.0),
                    failure_rate_per_gpu_hour=0.0, sched_period_s=sched_period_s,
                    scheduler=scheduler or SchedulerConfig(preempt_grace_s=notice_s), record_timeline=False)
    eng = Engine(np.zeros(1), 3600.0, PolicySpec("none"), cfg, list(w.jobs), None, list(w.tenants))
    res = eng.run()
    m = res.metrics
    return {"held_gpu_hours": eng.meter.held_gpu_s / 3600.0, "shrinks": m.get("shrinks", 0),
            "preemptions": m.get("preemptions", 0), "succeeded": m.get("jobs_completed", 0)}


def parity(w: Workload, horizon_s: float, **kw: Any) -> dict[str, Any]:
    """Plane and simulator side by side; ``ratio``: live / simulated GPU-hours held."""
    live, sim = run_plane(w, horizon_s, **kw), run_sim(w, horizon_s)
    return {"live": live, "sim": sim, "ratio": live["held_gpu_hours"] / sim["held_gpu_hours"]
            if sim["held_gpu_hours"] else math.nan}

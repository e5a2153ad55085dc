"""Simulator at datacenter scale: wall time of a month, and scheduling-call latency with a deep queue.

    python lab/sim_scale.py [--nodes 2048] [--days 30] [--jobs 10000] [--policy tidal] [--json]

The pool: ``--nodes`` nodes of 8 GPUs, a quarter of them serving (sized for the peak of the serving
trace, ServeGen m-large by default, repeated to ``--days``), the rest a training pool. The jobs:
``--jobs`` synthetic jobs (:func:`synthetic_trace`: heavy-tailed gang sizes 1-64 GPUs and
durations, 20 tenants, a fifth of them dedicated), all submitted within the first ``--submit-hours``
(so the queue starts about ``--jobs`` deep), their work scaled to ``--load`` x the pool's GPU-time
over the run. One simulation per policy in ``--policy`` (``tidal+clients``: the tidal policy given the
per-client breakdown of a per-client ``--traffic``, where plain ``tidal`` sees only its total); prints
wall seconds, scheduling calls, the p50 / p99 CPU milliseconds of ``schedule()`` (once per call in the
run; also over the calls made while at least 90 % of the jobs were pending), the deepest queue seen and
the headline metrics.
Targets: a 30-day month with 10,000 jobs on 2,048 x 8 GPUs in <= 30 s;
``decision_p99_ms`` <= 10 with 10,000 pending.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tidal.sim.config import make_config
from tidal.sim.engine import Engine
from tidal.sim.jobs import BacklogSource, JobSpec, SpotBacklog
from tidal.sim.policies import PolicySpec
from tidal.sim.report import clean
from tidal.sim.traffic import traffic_gpus

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "servegen-language-m-large.csv"
SHOW = ("wall_s", "cpu_s", "schedule_calls", "schedule_cpu_s", "decision_p50_ms", "decision_p99_ms",
        "decision_wall_p99_ms", "max_pending_jobs", "jobs_completed", "harvest_ratio", "shortfall_ratio",
        "pool_goodput", "ettr_mean")


def synthetic_trace(n_jobs: int, *, days: float, gpus_per_node: int, seed: int, tenants: int = 20,
                    submit_within_days: float | None = None, dedicated_fraction: float = 0.2,
                    total_work_gpu_s: float | None = None) -> list[JobSpec]:
    """``n_jobs`` jobs by the spot backlog's laws over ``tenants`` tenants, submitted uniformly over
    ``submit_within_days`` (default: the run), ``dedicated_fraction`` dedicated (priority 1), the work
    scaled to add up to ``total_work_gpu_s`` if given."""
    rng = np.random.default_rng(seed)
    src = BacklogSource(SpotBacklog(tenants=tenants), gpus_per_node, rng)
    span = (submit_within_days if submit_within_days is not None else days) * 86400.0
    times = np.sort(rng.uniform(0.0, span, n_jobs))
    out = []
    for i, t in enumerate(times):
        s = src.draw(float(t))
        ded = rng.random() < dedicated_fraction
        out.append(JobSpec(id=f"j{i:06d}", tenant=f"team{s.tenant[4:]}", kind="dedicated" if ded else "spot",
                           priority=1 if ded else 0, min_gpus=s.min_gpus,
                           max_gpus=s.min_gpus if ded else s.max_gpus, work_gpu_s=s.work_gpu_s,
                           submit_s=s.submit_s, gpus_per_node=s.gpus_per_node))
    if total_work_gpu_s is not None and out:
        k = total_work_gpu_s / sum(j.work_gpu_s for j in out)
        out = [replace(j, work_gpu_s=j.work_gpu_s * k) for j in out]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--submit-hours", type=float, default=1.0)
    ap.add_argument("--load", type=float, default=0.9, help="total work / (pool GPUs x run time)")
    ap.add_argument("--policy", default="tidal", help="comma-separated loan policies")
    ap.add_argument("--traffic", type=Path, default=TRACE)
    ap.add_argument("--sched-period-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    g = args.gpus_per_node
    serving = args.nodes // 4 * g
    training = args.nodes * g - serving
    demand, clients, step, name = traffic_gpus(args.traffic, serving)
    t0 = time.perf_counter()
    jobs = synthetic_trace(args.jobs, days=args.days, gpus_per_node=g, seed=args.seed,
                           submit_within_days=args.submit_hours / 24.0,
                           total_work_gpu_s=args.load * (serving + training) * args.days * 86400.0)
    gen_s = time.perf_counter() - t0
    cfg = make_config(serving_gpus=serving, training_gpus=training, gpus_per_node=g, days=args.days,
                      sched_period_s=args.sched_period_s, seed=args.seed, record_timeline=False)
    out = {"nodes": args.nodes, "serving_gpus": serving, "training_gpus": training, "days": args.days,
           "jobs": args.jobs, "trace": name, "sched_period_s": args.sched_period_s, "job_generation_s": gen_s,
           "policies": {}}
    metrics: dict[str, dict] = {}
    for p in args.policy.split(","):
        print(f"running {p} ...", file=sys.stderr, flush=True)
        with_clients = p.endswith("+clients")
        if with_clients and clients is None:
            sys.exit(f"--policy {p}: --traffic {args.traffic} is not a per-client trace")
        e = Engine(demand, step, PolicySpec(p.removesuffix("+clients")), cfg, jobs, None,
                   clients=clients if with_clients else None)
        r = e.run()
        deep = np.array(e.decision_ms)[np.array(e.pending_per_call) >= 0.9 * args.jobs]
        out["policies"][p] = {k: r.metrics[k] for k in SHOW}
        out["policies"][p]["calls_with_90pct_pending"] = int(deep.size)
        out["policies"][p]["decision_p99_ms_90pct_pending"] = (
            float(np.percentile(deep, 99)) if deep.size else None
        )
        metrics[p] = r.metrics
    if args.json:
        for p, m in metrics.items():  # every metric (a change meant to be faster must leave them all equal)
            out["policies"][p]["metrics"] = m
        print(json.dumps(clean(out), indent=2))
        return
    print(
        f"{args.nodes} nodes x {g} GPUs ({serving} serving, {training} training), {args.days:g} days, "
        f"{args.jobs} jobs submitted within {args.submit_hours:g} h, "
        f"scheduler period {args.sched_period_s:g} s"
    )
    names = list(out["policies"])
    print(f"{'':<30}" + "".join(f"{p:>14}" for p in names))
    for k in (*SHOW, "calls_with_90pct_pending", "decision_p99_ms_90pct_pending"):
        vals = [out["policies"][p][k] for p in names]
        print(f"{k:<30}" + "".join(f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}" for v in vals))
    for p, m in out["policies"].items():
        deep = m["decision_p99_ms_90pct_pending"]
        print(
            f"{p}: wall {m['wall_s']:.1f} s "
            f"(target <= 30: {'PASS' if m['wall_s'] <= 30 else 'MISS'}); decision "
            f"p99 {m['decision_p99_ms']:.1f} ms over the run, "
            f"{deep if deep is None else round(deep, 1)} ms over the "
            f"{m['calls_with_90pct_pending']} calls with >= 90% of the jobs pending "
            f"(target <= 10 with 10,000 pending); deepest queue {m['max_pending_jobs']} jobs"
        )


if __name__ == "__main__":
    main()

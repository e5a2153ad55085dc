"""The reconcile loop's step, two or more source trees side by side: ``tidal bench plane``'s plane phase
(``run_plane``: the real store, loop and scheduler over the virtual executor, its view published at every
step as ``tidal up`` does) on one workload, 2,048 x 8 GPUs, 200 tenants, 25,000 jobs over 96 simulated
minutes, stepped every 60 simulated seconds for two hours (peak ~21,000 waiting, ~1,800 running). Each run is
a process of its own with ``PYTHONPATH=<tree>/src``; runs alternate (A B A B ...); one JSON line a run (the
step's wall and CPU percentiles, the admissions and GPU-hours held, which must agree between trees), then the
medians and their ratios to the first tree.

    PYTHONPATH=src python lab/step_ab.py --tree /path/to/before --tree . [--rounds 3] [--pg] [--json]

``--jobs 50000 --nodes 4096``: the target load instead (peak ~43,000 waiting, ~2,850 running).

``--together``: a round's trees run at once, one core each, on a machine loaded by other work (compare the
CPU figures).

``--pg``: the store on a local PostgreSQL (pgserver on the same cores, as tests/test_control_postgres.py),
its schema dropped before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ONE_RUN = """
import json, os, time
import numpy as np
from tidal.control.controller import Controller
from tidal.demo.plane_bench import run_plane, workload

cpu = []
step = Controller.step
def timed(self, now_s):
    t = time.process_time()
    try:
        return step(self, now_s)
    finally:
        cpu.append(time.process_time() - t)
Controller.step = timed
w = workload(int(os.environ["STEP_AB_JOBS"]), int(os.environ["STEP_AB_NODES"]), 8, span_s=5760, tenants=200,
             skew=0.5)
out = run_plane(w, 7200, step_s=60, t0=time.time() - 7200, db_url=os.environ.get("STEP_AB_DB") or None)
r = {k: out[k] for k in ("step_p50_s", "step_p99_s", "admissions", "held_gpu_hours", "peak_waiting",
                        "peak_running")}
r |= {"step_cpu_p50_s": float(np.percentile(cpu, 50)), "step_cpu_p99_s": float(np.percentile(cpu, 99))}
print(json.dumps(r))
"""
FIGURES = ("step_p50_s", "step_p99_s", "step_cpu_p50_s", "step_cpu_p99_s")


def start(tree: Path, db: str | None, jobs: int = 25000, nodes: int = 2048) -> subprocess.Popen:
    """One run of ``tree`` started (its database emptied first)."""
    if db is not None:
        import sqlalchemy as sa

        eng = sa.create_engine(db)
        with eng.begin() as c:
            c.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        eng.dispose()
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "STEP_AB_DB": db or "", "STEP_AB_JOBS": str(jobs),
           "STEP_AB_NODES": str(nodes)}
    return subprocess.Popen([sys.executable, "-c", ONE_RUN], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(tree: Path, proc: subprocess.Popen) -> dict:
    """The run's JSON line, with its tree."""
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"run of {tree} failed:\n{stderr[-3000:]}")
    return {"tree": str(tree), **json.loads(stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, required=True, help="a source tree (repeat)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pg", action="store_true", help="the store on a local PostgreSQL (pgserver)")
    ap.add_argument("--jobs", type=int, default=25000, help="the workload's jobs (50,000: the target load)")
    ap.add_argument("--nodes", type=int, default=2048, help="nodes of 8 GPUs (4,096: the target pool)")
    ap.add_argument("--json", action="store_true", help="the runs and medians as one JSON document")
    ap.add_argument("--together", action="store_true",
                    help="a round's trees run at once, one core each (a machine loaded by other work: both "
                         "sides see the same load; compare the CPU figures); not with --pg")
    a = ap.parse_args()
    if a.together and a.pg:
        ap.error("--together runs on SQLite only (the runs would share one PostgreSQL database)")
    srv, base, db = None, None, None
    if a.pg:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pgserver
        base = Path(tempfile.mkdtemp(prefix="tidal-step-ab-"))
        srv = pgserver.get_server(base / "pgdata", cleanup_mode="stop")
        db = srv.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    runs: list[dict] = []
    try:
        for _ in range(a.rounds):
            if a.together:
                procs = [(t.resolve(), start(t.resolve(), db, a.jobs, a.nodes)) for t in a.tree]
                done = [result(t, proc) for t, proc in procs]
            else:
                done = [result(t.resolve(), start(t.resolve(), db, a.jobs, a.nodes)) for t in a.tree]
            runs += done
            if not a.json:
                for r in done:
                    print(json.dumps(r), flush=True)
    finally:
        if srv is not None:
            srv.cleanup()
            shutil.rmtree(base, ignore_errors=True)
    med = {str(t.resolve()): {k: statistics.median(r[k] for r in runs if r["tree"] == str(t.resolve()))
                              for k in FIGURES} for t in a.tree}
    first = med[str(a.tree[0].resolve())]
    ratios = {t: {k: m[k] / first[k] for k in FIGURES} for t, m in med.items()}
    if a.json:
        print(json.dumps({"runs": runs, "medians": med, "ratios": ratios}))
        return
    for t, m in med.items():
        print(t, " ".join(f"{k} {m[k]:.3f} ({ratios[t][k]:.2f})" for k in FIGURES))


if __name__ == "__main__":
    main()

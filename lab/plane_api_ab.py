"""The API of a loaded plane, two or more source trees side by side: ``tidal bench plane``'s API phase
(submissions from 8 clients, then reads of each kind from one, ``/metrics`` last) against ``tidal up
--executor virtual:NODESxGPUS`` started from each tree in turn (``PYTHONPATH=<tree>/src``), every time on a
fresh copy of one loaded state (the bench's workload stepped by the real loop, with the first tree's
code: ~20,000 waiting, ~2,000 running at 2048x8 and 24,000 jobs). Runs alternate (A B A B ...); one JSON
line a run, then a table of medians and their ratios to the first tree.

    PYTHONPATH=src python lab/plane_api_ab.py --tree /path/to/before --tree . [--rounds 2] [--pg] [--json]

``--state DIR`` (SQLite): the loaded state kept in ``DIR``, made there if it is not yet, else used as it is
(runs of several invocations on the same state; the virtual jobs' work is timed by the wall clock, so a kept
state ages: its running jobs end as if the plane had been down meanwhile).

``--pg``: the store on a local PostgreSQL (pgserver, as tests/test_control_postgres.py), a copy of the
loaded database (``CREATE DATABASE ... TEMPLATE``) for each run.
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
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from tidal.demo.plane_bench import published, spec_of, tenant_clients, workload

KINDS = {"jobs_page": lambda i, ids: ("/v1/dashboard/jobs", {"limit": 50, "offset": 50 * (i % 20)}),
         "api_jobs": lambda i, ids: ("/v1/jobs", {"limit": 50, "offset": 50 * (i % 20)}),
         "status": lambda i, ids: (f"/v1/jobs/{ids[i % len(ids)]}", None),
         "events": lambda i, ids: ("/v1/events", {"job": ids[i % len(ids)]}),
         "pool": lambda i, ids: ("/v1/pool", None),
         "dashboard_pool": lambda i, ids: ("/v1/dashboard/pool", None),
         "metrics": lambda i, ids: ("/metrics", None)}


MAKE_STATE = """
import json, sys, time
from tidal.demo.plane_bench import run_plane, workload
jobs, nodes, state, db = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] or None
w = workload(jobs, nodes, 8, span_s=0.8 * 3600, tenants=200, skew=0.5)
live = run_plane(w, 3600.0, step_s=60.0, state_dir=state, t0=time.time() - 3600.0, db_url=db)
print(json.dumps({k: live[k] for k in ("peak_waiting", "peak_running", "step_p99_s")}), file=sys.stderr)
"""


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def api_phase(tree: Path, state: Path, shape: str, db: str | None, submits: int, reads: int,
              as_tenants: bool = False) -> dict:
    """One run: ``tidal up`` from ``tree`` on a copy of ``state``, the API phase, then SIGKILL."""
    tmp = Path(tempfile.mkdtemp(prefix="plane-api-"))
    shutil.copytree(state, tmp / "s")
    state = tmp / "s"
    with open(state / "up.log", "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from tidal.cli import main; main()", "up", "--port", "0", "--executor",
             f"virtual:{shape}", "--state-dir", str(state), *(["--db", db] if db else [])],
            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONPATH": f"{tree}/src"})
    out: dict = {"tree": str(tree)}
    try:
        while not (state / "api.url").exists():
            if proc.poll() is not None:
                raise RuntimeError((state / "up.log").read_text()[-2000:])
            time.sleep(0.05)
        url = (state / "api.url").read_text().strip()
        token = (state / "admin.token").read_text().strip()
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        published(c)
        time.sleep(2.0)  # (the loop's first steps after the start)
        out["states"] = c.get("/v1/dashboard/pool").json()["states"]
        spec = {"name": "burst", "command": ["virtual"], "kind": "spot", "priority": 0,
                "gpus": {"min": 4, "max": 8}, **{k: v for k, v in spec_of(workload(1, 1, 8).jobs[0], 600.0)
                                                 .items() if k in ("env", "checkpoint")}}

        posters = tenant_clients(c, 8) if as_tenants else [c]

        def post(i: int) -> float:
            t = time.perf_counter()
            r = posters[i % len(posters)].post("/v1/jobs", json=spec)
            r.raise_for_status()
            return time.perf_counter() - t

        cpu, t = _cpu_s(proc.pid), time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            lat = list(pool.map(post, range(submits)))
        out["submits_per_s"] = submits / (time.perf_counter() - t)
        out["server_cpu_ms_per_submit"] = (_cpu_s(proc.pid) - cpu) * 1000 / submits
        out["submit_p50_s"], out["submit_p99_s"] = np.percentile(lat, 50), np.percentile(lat, 99)
        ids = [j["id"] for j in c.get("/v1/dashboard/jobs", params={"limit": 100}).json()["jobs"]]
        for name, make in KINDS.items():
            xs = []
            for i in range(reads):
                path, params = make(i, ids)
                t = time.perf_counter()
                r = c.get(path, params=params)
                xs.append(time.perf_counter() - t)
                r.raise_for_status()
            out[f"{name}_p50_s"], out[f"{name}_p99_s"] = np.percentile(xs, 50), np.percentile(xs, 99)
        out["metrics_bytes"] = len(r.content)
        return {k: float(v) if isinstance(v, np.floating) else v for k, v in out.items()}
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True, help="a source tree (its src/ is run)")
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--jobs", type=int, default=24000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--submits", type=int, default=2000)
    ap.add_argument("--reads", type=int, default=100)
    ap.add_argument("--pg", action="store_true")
    ap.add_argument("--as-tenants", action="store_true",
                    help="submit as 8 tenants of their own (their limits and checks), not as the admin")
    ap.add_argument("--state", type=Path, help="keep the loaded state here (made if absent; not with --pg)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    trees = [Path(t).resolve() for t in a.tree]
    work = Path(tempfile.mkdtemp(prefix="plane-api-state-"))
    srv, db_url = None, None
    try:
        if a.pg:
            import psycopg

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import pgserver

                srv = pgserver.get_server(work / "pgdata", cleanup_mode="stop")
            admin = srv.get_uri()
            with psycopg.connect(admin, autocommit=True) as cx:
                cx.execute("CREATE DATABASE loaded")
            db_url = admin.replace("postgresql://", "postgresql+psycopg://", 1)
        state = a.state.resolve() if a.state is not None and not a.pg else work / "state"
        if not (state / "tidal.db").exists() or a.pg:
            state.mkdir(parents=True, exist_ok=True)
            # the loaded state, made by the first tree's code (the others open an older schema, not newer)
            subprocess.run([sys.executable, "-c", MAKE_STATE, str(a.jobs), str(a.nodes), str(state),
                            db_url.replace("/postgres?", "/loaded?") if db_url else ""], check=True,
                           env={**os.environ, "PYTHONPATH": f"{trees[0]}/src"})
        runs: list[dict] = []
        for _ in range(a.rounds):
            for tree in trees:
                db = None
                if db_url:
                    name = "run_" + uuid.uuid4().hex[:8]
                    with psycopg.connect(admin, autocommit=True) as cx:
                        cx.execute(f"CREATE DATABASE {name} TEMPLATE loaded")
                    db = db_url.replace("/postgres?", f"/{name}?")
                runs.append(api_phase(tree, state, f"{a.nodes}x8", db, a.submits, a.reads, a.as_tenants))
                print(json.dumps(runs[-1]), file=sys.stderr)
        keys = [k for k in runs[0] if k.endswith(("_s", "_per_s", "_per_submit", "_bytes"))]
        med = {str(t): {k: statistics.median(r[k] for r in runs if r["tree"] == str(t)) for k in keys}
               for t in trees}
        if a.json:
            print(json.dumps({"runs": runs, "median": med}, indent=2))
            return
        first = med[str(trees[0])]
        print(f"{'':28}" + "".join(f"{t.name[-18:]:>20}" for t in trees))
        for k in keys:
            print(f"{k:28}" + "".join(f"{med[str(t)][k]:>12.4g} ({med[str(t)][k] / first[k]:4.2f})"
                                      if first[k] else f"{med[str(t)][k]:>20.4g}" for t in trees))
    finally:
        if srv is not None:
            srv.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

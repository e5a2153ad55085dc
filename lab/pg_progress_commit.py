"""A step's progress on PostgreSQL: the commit of ``--rows`` documents copied in and upserted, waiting for
the log (``synchronous_commit`` on, as every other transaction of the plane) and not (off for that
transaction, as the loop's progress), alternating, ``--times`` each; a local PostgreSQL from the
``pgserver`` wheel on the same cores, ``fsync`` on. Prints the commit's p50 and max and the whole write's p50.

    PYTHONPATH=src python lab/pg_progress_commit.py [--rows 1500] [--times 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import psycopg

DOC = json.dumps({"step": 12345, "steps_per_s": 1.5, "start_step": 100, "mean_step_s": 0.66,
                  "tiers": {"memory": {"step": 12000, "time": 1.0e9}, "disk": {"step": 11000, "time": 1.0e9}},
                  "heartbeat_s": 1.0e9, "heartbeats": 8, "phase": "training", "durable_ckpt_s": 1.0e9,
                  "ckpt_stall_s": 0.5, "ckpt_step": 11000})


def run(cx: psycopg.Connection, rows: list[tuple[str, str]], wait: bool, times: int) -> dict[str, float]:
    commits, writes = [], []
    with cx.cursor() as cur:
        for _ in range(times):
            t0 = time.perf_counter()
            if not wait:
                cur.execute("SET LOCAL synchronous_commit TO OFF")
            with cur.copy("COPY progress_in (job_id, doc) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row(r)
            cur.execute("INSERT INTO progress (job_id, doc) SELECT job_id, doc FROM progress_in "
                        "ON CONFLICT (job_id) DO UPDATE SET doc = excluded.doc")
            cur.execute("DELETE FROM progress_in")
            t1 = time.perf_counter()
            cx.commit()
            commits.append(time.perf_counter() - t1)
            writes.append(time.perf_counter() - t0)
    return {"commit_p50_ms": statistics.median(commits) * 1e3, "commit_max_ms": max(commits) * 1e3,
            "write_p50_ms": statistics.median(writes) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1500)
    ap.add_argument("--times", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver

        srv = pgserver.get_server(Path(tempfile.mkdtemp(prefix="pg-commit-")) / "pgdata", cleanup_mode="stop")
    try:
        with psycopg.connect(srv.get_uri()) as cx:
            cx.execute("CREATE TABLE progress (job_id VARCHAR(80) PRIMARY KEY, doc JSON)")
            cx.execute("CREATE TEMPORARY TABLE progress_in (job_id VARCHAR(80), doc JSON) "
                       "ON COMMIT DELETE ROWS")
            cx.commit()
            rows = [(f"job-{i}", DOC) for i in range(a.rows)]
            out = [{"wait": wait, **run(cx, rows, wait, a.times)}
                   for _ in range(a.rounds) for wait in (True, False)]
    finally:
        srv.cleanup()
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for r in out:
        print(f"{'waiting' if r['wait'] else 'not waiting':12} commit p50 {r['commit_p50_ms']:6.2f} ms, "
              f"max {r['commit_max_ms']:6.2f} ms; write p50 {r['write_p50_ms']:6.2f} ms")


if __name__ == "__main__":
    main()

"""Database size per job: ``--jobs`` jobs of ``tidal bench plane``'s workload, each through a typical life
(submitted, admitted with its launch event, running, its progress written, succeeded) in the reconcile
loop's batches, in a fresh SQLite store; its size (WAL checkpointed) printed at a few counts as JSON.

    PYTHONPATH=src python lab/plane_db_size.py [--jobs 50000]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
from pathlib import Path

from tidal.control.auth import create_tenant
from tidal.control.spec import parse_spec
from tidal.control.states import State
from tidal.control.store import Store
from tidal.demo.plane_bench import spec_of, workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=50000)
    n = ap.parse_args().jobs
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        st = Store(f"sqlite:///{root}/tidal.db")
        w = workload(n, 4096, 8, tenants=200, skew=0.5)
        for t in w.tenants:
            create_tenant(st, t.name, quota_gpus=t.quota_gpus, max_priority=1)
        sizes = {}
        for k in range(0, n, 1000):
            with st.batch():
                for i, j in enumerate(w.jobs[k:k + 1000]):
                    row = st.submit(j.tenant, parse_spec(spec_of(j, 600)).model_dump(), 1.0)
                    g = j.min_gpus
                    pl = {f"v{(k + i + m) % 4096:04d}": min(g, 8) for m in range(max(1, g // 8))}
                    st.transition(row.id, State.ADMITTED, 2.0, f"admitted on {g} GPUs; launching attempt 1",
                                  placement=pl, attempt=1, attempt_launched_s=2.0)
                    st.update(row.id, handle={"virtual": True, "ranks": g})
                    st.record("launch", f"attempt 1: {g} ranks started", 2.0, job=row, data={"ranks": g})
                    st.transition(row.id, State.RUNNING, 3.0, f"{g} ranks running")
                    prog = {"start_step": 0, "step": 3600, "step_s": 3603.0, "first_step": 0,
                            "first_step_s": 2.0, "step_time_s": 1.0 / g, "heartbeat_s": 3603.0,
                            "heartbeats": g, "phase": "training", "ckpt_step": 3000, "ckpt_s": 3000.0,
                            "durable_ckpt_step": 3000, "durable_ckpt_s": 3000.0,
                            "tiers": {"dir": [3000, 3000.0]}, "ended": True}
                    st.update_many({row.id: {"progress": prog, "last_ckpt_s": 3000.0}}, mark=False)
                    st.transition(row.id, State.SUCCEEDED, 3700.0, f"all {g} ranks exited 0 at step 3600",
                                  finished_s=3700.0, placement={}, held_s=3698.0, productive_s=3600.0)
            if k + 1000 in (10000, 25000, 50000, n):
                c = sqlite3.connect(root / "tidal.db")
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                c.close()
                sizes[k + 1000] = sum(p.stat().st_size for p in root.glob("tidal.db*"))
        st.close()
    print(json.dumps({"jobs": sizes, "bytes_per_job": sizes[n] / n}))


if __name__ == "__main__":
    main()

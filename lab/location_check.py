"""What a non-admin submit's checkpoint-location check costs in a store of many located jobs: the jobs
whose location may overlap the new one, from the store's index (``Store.ckpt_locations(near)``), against
every located job read and filtered in Python (what it did before). Both must find the same jobs.

    PYTHONPATH=src python lab/location_check.py [--jobs 25000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tidal.control.auth import create_tenant
from tidal.control.locations import overlaps
from tidal.control.spec import parse_spec
from tidal.control.store import Store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=25000)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        store = Store(f"sqlite:///{Path(d) / 'tidal.db'}")
        create_tenant(store, "a")
        spec = parse_spec({"name": "l", "command": ["true"], "gpus": {"min": 1, "max": 1}}).model_dump()
        with store.batch():
            for i in range(a.jobs):
                store.submit("a", spec, float(i), ckpt_location=f"/ckpt/t{i % 200}/job{i}")
        mine = {"/ckpt/t7/new-run"}

        def every() -> list:
            return [r for r in store.ckpt_locations() if any(overlaps(m, r[2]) for m in mine)]

        def near() -> list:
            return [r for r in store.ckpt_locations(mine) if any(overlaps(m, r[2]) for m in mine)]

        assert every() == near()
        out: dict[str, list[float]] = {}
        for name, f in (("every_job_ms", every), ("index_ms", near)) * 2:  # (alternating)
            ts = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
            out.setdefault(name, []).append(round(statistics.median(ts) * 1e3, 3))
        store.close()
    print(json.dumps({"jobs": a.jobs, **out}))


if __name__ == "__main__":
    main()

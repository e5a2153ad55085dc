"""Dashboard load and refresh times with many jobs in the store, in headless Chromium.

    python lab/dashboard_load.py [--jobs 1000] [--active 100] [--repeat 7] [--json]

A program, not a test. It fills a fresh SQLite store (a temporary directory) with ``--jobs`` jobs of
three tenants, ``--active`` of them active (half running on a pool of 8 nodes x 8 GPUs with progress,
half waiting), the rest ended, and two events each; serves the real API and dashboard
(:func:`tidal.control.api.create_app`) with uvicorn on a loopback port in this process, and drives
the system's ``chromium`` (``TIDAL_CHROMIUM`` to pick another) with Playwright:

* **load**: a new tab (token already in its sessionStorage) opens ``/dashboard#/<page>`` until the
  page's content is drawn (pool: the GPU map; jobs: the first page of the table; job: its events),
  ``--repeat`` times per page;
* **refresh**: on each open page, one poll cycle (the page's JSON calls and redrawing), timed in the
  page, ``--repeat`` times;
* **JSON**: each endpoint a refresh calls, timed from this process with httpx (server time plus loopback).

Medians and maxima in milliseconds; ``--json`` prints one JSON object. The browser, the server and
this client share the machine's cores: read the figures as upper bounds on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tidal.control.api import ApiContext, create_app
from tidal.control.auth import create_tenant, ensure_admin
from tidal.control.states import State
from tidal.control.store import Store
from tidal.model import Node

READY = {"pool": "#gpu-map .node", "jobs": "#jobs-range", "job": "#job-events table"}


def fill(store: Store, n: int, active: int) -> str:
    """``n`` jobs; returns the id of a running one (for the job page)."""
    t0 = time.time() - 3600
    running = None
    for i in range(n):
        tenant = ("alpha", "beta", "gamma")[i % 3]
        spec = {"name": f"train{i % 7}", "kind": "spot", "priority": 0,
                "gpus": {"min": 1, "max": 2, "multiple_of": 1}, "max_restarts": 3,
                "command": ["python", "x.py"]}
        j = store.submit(tenant, spec, t0 + i)
        k = n - i  # the newest ``active`` are active
        if k <= active // 2:
            node = f"node{i % 8}"
            store.transition(j.id, State.ADMITTED, t0 + i + 1, "admitted", placement={node: 1}, attempt=1,
                             attempt_launched_s=t0 + i + 1)
            store.transition(j.id, State.RUNNING, t0 + i + 2, "running",
                             progress={"step": i, "loss": 1.0 / (i + 1), "steps_per_s": 3.0})
            running = j.id
        elif k > active:
            store.transition(j.id, State.CANCELLED, t0 + i + 1, "cancelled")
    return running or ""


def serve(app) -> tuple[str, object]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise SystemExit("dashboard_load: the server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server


def ms(xs: list[float]) -> dict:
    return {"median_ms": round(statistics.median(xs) * 1000, 1), "max_ms": round(max(xs) * 1000, 1),
            "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--active", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    chromium = os.environ.get("TIDAL_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        raise SystemExit("dashboard_load: no chromium on PATH (apt-get install chromium, or "
                         "TIDAL_CHROMIUM=...)")
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="tidal-dash-bench-"))
    try:
        store = Store(f"sqlite:///{tmp}/tidal.db")
        token, _ = ensure_admin(store, tmp, time.time())
        for t in ("alpha", "beta", "gamma"):
            create_tenant(store, t, quota_gpus=8)
        t = time.perf_counter()
        job = fill(store, a.jobs, a.active)
        fill_s = time.perf_counter() - t
        nodes = [Node(f"node{i}", 8) for i in range(8)]
        app = create_app(ApiContext(store, nodes, lambda j, r: None, time.time, ckpt_root=tmp / "jobs",
                                    job_dir=lambda j: tmp / "jobs" / j))
        url, server = serve(app)
        hdr = {"Authorization": f"Bearer {token}"}
        calls = {"pool": "/v1/dashboard/pool", "jobs page": "/v1/dashboard/jobs?limit=50",
                 "jobs page, filtered": "/v1/dashboard/jobs?limit=50&state=running&q=train3",
                 "job": f"/v1/jobs/{job}", "job curves": f"/v1/dashboard/jobs/{job}/curves",
                 "job events": f"/v1/events?limit=1000&job={job}"}
        api: dict[str, dict] = {}
        with httpx.Client(base_url=url, headers=hdr) as c:
            for name, path in calls.items():
                c.get(path).raise_for_status()
                lat = []
                for _ in range(a.repeat * 3):
                    t = time.perf_counter()
                    c.get(path).raise_for_status()
                    lat.append(time.perf_counter() - t)
                api[name] = ms(lat)
        pages = {"pool": "#/pool", "jobs": "#/jobs", "job": f"#/job/{job}"}
        load: dict[str, dict] = {}
        refresh: dict[str, dict] = {}
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
            for name, route in pages.items():
                lt, rt = [], []
                for _ in range(a.repeat):
                    ctx = b.new_context(viewport={"width": 1300, "height": 900})
                    ctx.add_init_script(f"sessionStorage.setItem('tidal.token', {json.dumps(token)})")
                    page = ctx.new_page()
                    t = time.perf_counter()
                    page.goto(url + "/dashboard" + route)
                    page.wait_for_selector(READY[name])
                    lt.append(time.perf_counter() - t)
                    rt.append(page.evaluate("async () => { busy = false; const t = performance.now(); "
                                            "await refresh(); return (performance.now() - t) / 1000; }"))
                    ctx.close()
                load[name], refresh[name] = ms(lt), ms(rt)
            b.close()
        server.should_exit = True
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"jobs": a.jobs, "active": a.active, "fill_s": round(fill_s, 2), "load": load, "refresh": refresh,
           "json": api, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{a.jobs} jobs ({a.active} active) in the store; {os.cpu_count()} CPUs; "
          f"median / max ms over {a.repeat}")
    for what in ("load", "refresh"):
        for name, r in out[what].items():
            print(f"  {what:8} {name:22} {r['median_ms']:8.1f} {r['max_ms']:8.1f}")
    for name, r in api.items():
        print(f"  {'json':8} {name:22} {r['median_ms']:8.1f} {r['max_ms']:8.1f}")


if __name__ == "__main__":
    sys.exit(main())

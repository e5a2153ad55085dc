"""The dashboard in headless Chromium against a real ``tidal up`` that lends serving GPUs (the shipped daily
profile replayed at 600x on two virtual serving nodes): every page loads with no console error, a submitted
job appears and changes state without a reload, a tenant's token never shows another tenant's job, and the
loan timeline draws the replayed trace's points. A screenshot of each page goes to test-artifacts/dashboard/.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path

import httpx
import pytest

from browser import Tab, browser  # noqa: F401  (the fixture; tests take it first: no plane without a browser)
from plane_proc import Plane, lending_config, wait_until
from tidal.control.client import TidalClient
from tidal.control.dashboard import dashboard_url

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
CONFIG = lending_config("2x2")
HOSTILE = "<img src=x onerror=\"document.title='owned'\">"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(tmp_path_factory.mktemp("dash"), CONFIG, gpus=2)
    try:
        p.start()
        yield p
    finally:
        p.stop()


def _state_cell(page, job_id: str):
    return page.locator("#jobs-table tr", has=page.locator(f"a[href='#/job/{job_id}']")).locator(".state")


def test_pages_load_and_a_job_changes_state_live(browser, plane):  # noqa: F811
    lab = TidalClient(plane.url, plane.admin.create_tenant("lab", quota_gpus=1)["token"])
    assert f"dashboard: {dashboard_url(plane.url)}" in plane.outputs[-1].read_text()  # tidal up prints it
    tab = Tab(browser, plane.url)
    try:
        tab.sign_in(plane.admin.token)
        tab.go("#/jobs", "#jobs-range")
        job = lab.submit({"name": "mlp", "gpus": 1, "workdir": str(plane.tmp),
                          "command": [sys.executable, str(WORKER), "--steps", "150", "--pad-mib", "1"],
                          "env": {"TIDAL_CKPT_INTERVAL_STEPS": "25",
                                  "TIDAL_SHM_DIR": str(plane.tmp / "shm")}})["id"]
        seen: set[str] = set()

        def state_shown() -> str | None:  # the page is never reloaded: its own polling brings each change
            cell = _state_cell(tab.page, job)
            text = cell.inner_text() if cell.count() else None
            if text:
                seen.add(text)
            return text

        wait_until("the job in the table", state_shown, timeout_s=30)
        wait_until("the job shown succeeded", lambda: state_shown() == "succeeded", timeout_s=90,
                   explain=lambda: f"; seen {seen}, job {lab.job(job)['state']}")
        assert len(seen) >= 2 and "succeeded" in seen, seen  # seen in another state before, in the same page
        tab.screenshot("jobs")

        # a job writes its own progress records: one crafted as HTML stays text (and the CSP would stop it)
        records = plane.state / "jobs" / job / "attempt-1" / "progress" / "progress-r00000.jsonl"
        with open(records, "a") as f:
            f.write(json.dumps({"event": "restore", "step": 0, "time": 1.0, "tier": HOSTILE}) + "\n")
        tab.go(f"#/job/{job}", "#job-events table")
        tab.page.wait_for_selector("#job-restarts td:has-text('onerror')")
        assert HOSTILE in tab.page.inner_text("#job-restarts")
        assert tab.page.locator("#job-restarts img").count() == 0 and tab.page.title() == "Tidal"
        wait_until("the loss curve",
                   lambda: int(tab.page.get_attribute("#loss-chart", "data-points") or 0) >= 100)
        assert tab.page.locator("#loss-chart canvas").count() == 1
        assert "disk" in tab.page.inner_text("#job-ckpt") and "150" in tab.page.inner_text("#job-ckpt")
        assert "submitted" in tab.page.inner_text("#job-events")
        tab.screenshot("job")

        tab.go("#/pool", "#gpu-map .node")
        assert {n.get_attribute("data-node") for n in tab.page.query_selector_all("#gpu-map .node")} \
            == {"local", "serve-0", "serve-1"}
        assert "lab" in tab.page.inner_text("#tenants")
        tab.screenshot("pool")
        tab.go("#/serving", "#serving-stats .stat")
        tab.screenshot("serving")
        assert tab.errors == []
        # a bad token goes back to the sign-in form with a clear line
        tab.page.evaluate("() => { sessionStorage.setItem('tidal.token', 'tidal_wrong'); "
                          "location.reload(); }")
        tab.page.wait_for_selector("#login:not([hidden])")
        assert "not known" in tab.page.inner_text("#login-error")
    finally:
        tab.close()


def test_a_tenant_never_sees_another_tenants_job(browser, plane):  # noqa: F811
    a = TidalClient(plane.url, plane.admin.create_tenant("alice")["token"])
    b = TidalClient(plane.url, plane.admin.create_tenant("bob")["token"])
    mine = a.submit({"name": "alices", "gpus": 1, "command": SLEEPER})["id"]
    theirs = b.submit({"name": "bobs", "gpus": 1, "command": SLEEPER})["id"]
    tab = Tab(browser, plane.url)
    try:
        wait_until("both running", lambda: a.job(mine)["state"] == b.job(theirs)["state"] == "running")
        tab.sign_in(a.token)
        assert "tenant alice" in tab.page.inner_text("#who")
        for route, ready in (("#/pool", "#gpu-map .node"), ("#/jobs", f"a[href='#/job/{mine}']"),
                             ("#/serving", "#serving-stats .stat"), (f"#/job/{mine}", "#job-events table")):
            tab.go(route, ready)
            tab.page.wait_for_selector("#live:has-text('updated')")
            html = tab.page.content()
            assert theirs not in html and "bobs" not in html, route
        tab.go("#/pool", "#gpu-map .gpu.other")  # bob's GPU is drawn, not named
        assert tab.page.locator(f"[data-job='{theirs}']").count() == 0
        tab.screenshot("pool-as-tenant")
        assert tab.errors == []
        # asking for it by id: "not found", as the API answers (never "forbidden")
        tab.go(f"#/job/{theirs}", "h1:has-text('Not found')")
        assert theirs not in json.dumps(tab.page.evaluate("() => sessionStorage.getItem('tidal.token')"))
        assert all("404" in e for e in tab.errors), tab.errors
    finally:
        tab.close()
        a.cancel(mine)
        b.cancel(theirs)


def test_loan_timeline_draws_the_replayed_trace(browser, plane):  # noqa: F811
    tab = Tab(browser, plane.url)
    try:
        tab.sign_in(plane.admin.token)
        tab.go("#/serving", "#loan-chart canvas")

        def points() -> int:
            return int(tab.page.get_attribute("#loan-chart", "data-points") or 0)

        wait_until("five points of the replayed trace on the timeline", lambda: points() >= 5, timeout_s=60)
        shown = points()
        history = httpx.get(plane.url + "/v1/dashboard/serving",
                            headers={"Authorization": f"Bearer {plane.admin.token}"}).json()["history"]
        assert len([h for h in history if h["demand"] is not None]) >= shown  # each point drawn is a step's
        assert tab.page.locator("#loan-chart .u-legend").inner_text().count("demand") == 1
        assert "next reclaim" in tab.page.inner_text("#serving-stats")
        tab.screenshot("serving-timeline")
        assert tab.errors == []
    finally:
        tab.close()


def test_the_serving_page_shows_a_real_engines_figures(browser, tmp_path):  # noqa: F811
    """A plane serving through two llama.cpp replicas (``adapter: llama.cpp``): the page draws TTFT,
    requests running and waiting and replicas routed beside demand, from ``GET /v1/serving``'s engine."""
    pytest.importorskip("gguf", reason="the gguf package writes the tiny model")
    from plane_proc import engine_figures, stop_engine_plane
    from tidal.serving.engine_replicas import EngineError, llama_server
    from tidal.serving.tiny_gguf import write_tiny_gguf

    try:
        llama_server()
    except EngineError as e:
        pytest.skip(str(e))
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    p = Plane(tmp_path, f"serving:\n  adapter: llama.cpp\n  nodes: 2x1\n  engine: {{model: {model}}}\n"
              "  latency_target_s: 0.5\n  rate_window_s: 2\n", gpus=1)
    pids: set[int] = set()
    tab = None
    asking = threading.Event()

    def keep_asking(url: str) -> None:  # (the figures cover the last 2 s: traffic while the page loads)
        i = 0
        while not asking.wait(0.2):
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{url}/v1/completions", timeout=30,
                           json={"prompt": f"The tide {i}", "max_tokens": 4})
            i += 1

    asker = None
    try:
        p.start()
        url = wait_until("the engine's router", lambda: engine_figures(p, pids).get("url"), 30)
        for i in range(6):
            assert httpx.post(f"{url}/v1/completions", timeout=30,
                              json={"prompt": f"The tide {i}", "max_tokens": 4}).status_code == 200
        asker = threading.Thread(target=keep_asking, args=(url,), daemon=True)
        asker.start()
        figures = wait_until("TTFT at the router", lambda: (e := engine_figures(p, pids)).get("ttft_p99_s")
                             and e, 10)
        assert figures["engine"] == "llama.cpp" and figures["routed"] == 2 and figures["warming"] == 0
        tab = Tab(browser, p.url)
        tab.sign_in(p.admin.token)
        tab.go("#/serving", "#engine-stats .stat")
        shown = tab.page.inner_text("#engine-stats")
        for what in ("llama.cpp: TTFT p50 / p99", "requests running / waiting", "replicas routed / warming",
                     "2 / 0 of 2", "replicas needed", "(measured)"):
            assert what in shown, shown
        assert " ms / " in shown and "— / —" not in shown, shown
        tab.screenshot("serving-engine")
        assert tab.errors == []
    finally:
        asking.set()
        if asker is not None:
            asker.join()
        if tab is not None:
            tab.close()
        stop_engine_plane(p, pids)

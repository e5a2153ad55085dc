"""The dashboard's JSON and assets in-process (Starlette's TestClient): paging and filters over many jobs,
tenant isolation, the GPU map and queue, curves from progress files (bounded, damaged lines, no links
followed), the loan timeline's bound, assets (no path reaches the filesystem, security headers) and the
vendored chart library's pinned hashes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():  # starlette 1.x suggests another httpx package for its test client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from control_fakes import FakeClock
from tidal.contract import PROGRESS_DIRNAME, attempt_dirname, progress_file
from tidal.control import dashboard, dashboard_views
from tidal.control.api import ApiContext, create_app
from tidal.control.auth import create_tenant, ensure_admin
from tidal.control.read_view import QueuedJob
from tidal.control.states import State
from tidal.control.store import Store
from tidal.model import Node, Waiting

SPEC = {"name": "job", "kind": "spot", "priority": 0, "gpus": {"min": 1, "max": 2, "multiple_of": 1},
        "max_restarts": 3, "command": ["python", "train.py"]}


@pytest.fixture
def dash(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    admin, _ = ensure_admin(store, tmp_path, 0.0)
    jobs_root = tmp_path / "jobs"
    app = create_app(ApiContext(store, [Node("n1", 4), Node("n2", 4)], lambda j, r: None, FakeClock(),
                                ckpt_root=jobs_root, job_dir=lambda j: jobs_root / j))
    http = TestClient(app)
    tokens = {"admin": admin, "a": create_tenant(store, "a", quota_gpus=2),
              "b": create_tenant(store, "b", weight=3)}

    def get(who: str, path: str, status: int = 200, **params):
        r = http.get(path, params=params, headers={"Authorization": f"Bearer {tokens[who]}"})
        assert r.status_code == status, r.text
        return r.json()

    yield store, get, http, jobs_root, tokens
    store.close()


def _submit(store: Store, tenant: str, name: str, **kw) -> str:
    spec = {**SPEC, "name": name, **kw}
    return store.submit(tenant, spec, 1.0).id


def test_jobs_are_paged_filtered_and_counted(dash):
    store, get, _, _, _ = dash
    ids = [_submit(store, "a" if i % 3 else "b", f"train{i % 2}") for i in range(250)]
    store.transition(ids[10], State.ADMITTED, 2.0, "x", placement={"n1": 1})
    page = get("admin", "/v1/dashboard/jobs", limit=100)
    assert page["total"] == 250 and len(page["jobs"]) == 100
    assert [j["id"] for j in page["jobs"]] == ids[::-1][:100]  # newest first
    last = get("admin", "/v1/dashboard/jobs", limit=100, offset=200)
    assert [j["id"] for j in last["jobs"]] == ids[::-1][200:]
    assert get("admin", "/v1/dashboard/jobs", state="admitted")["jobs"][0]["id"] == ids[10]
    assert get("admin", "/v1/dashboard/jobs", state=["admitted", "pending"])["total"] == 250
    assert get("admin", "/v1/dashboard/jobs", tenant="b")["total"] == sum(1 for i in range(250) if i % 3 == 0)
    assert get("admin", "/v1/dashboard/jobs", q="train1", limit=200)["total"] == 125
    assert get("admin", "/v1/dashboard/jobs", kind="dedicated")["total"] == 0
    # LIKE's wildcards are taken literally
    assert get("admin", "/v1/dashboard/jobs", q="%")["total"] == 0
    assert get("admin", "/v1/dashboard/jobs", q="train_")["total"] == 0
    # bad input: one clear error, the service stays up
    assert "kind" in get("admin", "/v1/dashboard/jobs", 422, kind="x")["detail"]
    get("admin", "/v1/dashboard/jobs", 422, limit=10_000)
    get("admin", "/v1/dashboard/jobs", 422, state="nonsense")
    get("admin", "/v1/dashboard/jobs", 422, q="x" * 81)
    # a NUL would end SQLite's LIKE pattern early and match every job: refused (and matches nothing below)
    refused = get("admin", "/v1/dashboard/jobs", 422, q="a\x00")["detail"]
    assert "q: must not hold a control character" in refused
    get("admin", "/v1/dashboard/jobs", 422, tenant="a\nb")
    assert store.jobs_page(match="\x00") == ([], 0)


def test_a_tenant_sees_only_its_own(dash):
    store, get, _, jobs_root, _ = dash
    a = _submit(store, "a", "mine")
    b = _submit(store, "b", "theirs")
    store.transition(b, State.ADMITTED, 2.0, "x", placement={"n1": 2})
    page = get("a", "/v1/dashboard/jobs", tenant="b")  # the tenant filter is the admin's only
    assert [j["id"] for j in page["jobs"]] == [a] and page["total"] == 1
    get("a", f"/v1/dashboard/jobs/{b}/curves", 404)
    get("a", "/v1/dashboard/jobs/nope/curves", 404)
    pool = get("a", "/v1/dashboard/pool")
    text = json.dumps(pool)
    assert b not in text and a in text  # a's waiting job is listed, b's running one is not named
    held = [s for n in pool["nodes"] for s in n["segments"] if s["kind"] == "job"]
    assert held == [{"kind": "job", "gpus": 2, "tenant": "b", "job": None, "state": None}]
    assert [t["tenant"] for t in pool["tenants"]] == ["a"]
    assert pool["states"] == {"pending": 1}
    admin = get("admin", "/v1/dashboard/pool")
    assert b in json.dumps(admin) and {t["tenant"] for t in admin["tenants"]} == {"a", "b"}
    assert dash[2].get("/v1/dashboard/pool").status_code == 401  # no token: nothing


def test_gpu_map_queue_and_fair_share(dash):
    store, get, _, _, _ = dash
    run = _submit(store, "b", "run")
    store.transition(run, State.ADMITTED, 2.0, "x", placement={"n1": 3})
    store.update(run, releasing={"n1": 1})
    ded = _submit(store, "a", "ded", kind="dedicated", gpus={"min": 3, "max": 3, "multiple_of": 1})
    big = _submit(store, "b", "big", gpus={"min": 6, "max": 6, "multiple_of": 1}, priority=5)
    small = _submit(store, "a", "small")
    p = get("admin", "/v1/dashboard/pool")
    n1 = p["nodes"][0]
    assert [(s["kind"], s["gpus"]) for s in n1["segments"]] == [("job", 2), ("draining", 1), ("free", 1)]
    assert p["totals"]["free"] == 5 and p["totals"]["job"] == 2 and p["gpus"] == 8
    q = p["queue"]
    assert [r["job"] for r in q["jobs"]] == [ded, big, small] and q["total"] == 3
    assert "quota" in q["jobs"][0]["why"]  # 3 dedicated GPUs, quota 2
    assert "needs 6 GPUs, 5 free" in q["jobs"][1]["why"]
    # another tenant sees the queue's positions, not that tenant's quota and usage
    seen_by_b = get("b", "/v1/dashboard/pool")["queue"]["jobs"]
    assert [r["job"] for r in seen_by_b] == [None, big, None] and seen_by_b[0]["why"] == "its tenant's quota"
    # once the scheduler has said why (the reconcile loop's view), its owner and the admin read that, others
    # do not
    told = "waiting: quota of tenant a full (2 of 2 GPUs)"
    head = [QueuedJob.of(store.job(ded), Waiting(told))]
    for viewer, why in ((None, told), ("a", told), ("b", "its tenant's quota")):
        assert dashboard_views.queue_view(head, 3, p["tenants"], 5, 0, 2.0, viewer)["jobs"][0]["why"] == why
    usage = {t["tenant"]: t for t in p["tenants"]}
    # spot capacity 8 (no dedicated held) split 1:3 between a and b, both with spot jobs running or waiting
    assert usage["a"]["fair_share_gpus"] == 2.0 and usage["b"]["fair_share_gpus"] == 6.0
    assert usage["b"]["spot_gpus"] == 3 and usage["b"]["running"] == 1 and usage["a"]["waiting"] == 2


def _progress(jobs_root: Path, job: str, attempt: int, lines: list) -> Path:
    d = jobs_root / job / attempt_dirname(attempt) / PROGRESS_DIRNAME
    d.mkdir(parents=True, exist_ok=True)
    p = d / progress_file(0)
    p.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return p


def test_curves_from_progress_records(dash):
    store, get, _, jobs_root, _ = dash
    j = _submit(store, "a", "curvy")
    store.update(j, attempt=2)
    _progress(jobs_root, j, 1, [{"event": "restore", "step": 0, "time": 1.0, "tier": None},
                               *({"event": "step", "step": s, "time": 1.0 + s, "loss": 1 / s,
                                  "step_time_s": 0.5} for s in range(1, 11)),
                               {"event": "checkpoint", "step": 10, "time": 11.0, "stall_s": 0.01,
                                "reason": "steps"},
                               b"{not json", b"\x00\xff", {"event": "step", "step": "x"},
                               {"event": "step", "step": 11, "time": 12.0, "loss": float("nan")}])
    _progress(jobs_root, j, 2, [{"event": "restore", "step": 10, "time": 20.0, "tier": "shm",
                                 "duration_s": 0.2}])
    cv = get("a", f"/v1/dashboard/jobs/{j}/curves")
    a1, a2 = cv["attempts"]
    assert a1["steps_recorded"] == 11 and a1["points"][0] == [2.0, 1, 1.0, 0.5, None]
    assert a1["points"][-1][2] is None  # NaN loss: null, never a broken response
    assert a1["checkpoints"] == [[11.0, 10, 0.01, "steps"]]
    assert a2["restore"] == {"step": 10, "tier": "shm", "duration_s": 0.2, "fallbacks": None}
    # thinned to the cap, first and last kept
    out = dashboard_views.curves(jobs_root / j, 1, max_points=4)["attempts"][0]["points"]
    assert len(out) == 4 and out[0][1] == 1 and out[-1][1] == 11


def test_curves_read_no_link_and_only_the_tail(dash, monkeypatch):
    store, get, _, jobs_root, _ = dash
    j = _submit(store, "a", "linky")
    store.update(j, attempt=1)
    secret = jobs_root.parent / "secret.jsonl"
    secret.write_text(json.dumps({"event": "step", "step": 1, "time": 1, "loss": 42}) + "\n")
    d = jobs_root / j / attempt_dirname(1) / PROGRESS_DIRNAME
    d.mkdir(parents=True)
    os.symlink(secret, d / progress_file(0))
    assert get("a", f"/v1/dashboard/jobs/{j}/curves")["attempts"][0]["points"] == []
    (d / progress_file(0)).unlink()
    monkeypatch.setattr(dashboard_views, "CURVE_TAIL_BYTES", 1000)
    _progress(jobs_root, j, 1, [{"event": "step", "step": s, "time": s, "loss": 1.0} for s in range(1, 500)])
    a = get("a", f"/v1/dashboard/jobs/{j}/curves")["attempts"][0]
    assert a["truncated"] and 0 < a["steps_recorded"] < 30 and a["points"][-1][1] == 499


def test_serving_when_none_configured_and_history_bound(dash):
    _, get, _, _, _ = dash
    none = {"configured": False, "lending": False, "view": None, "history": []}
    assert get("b", "/v1/dashboard/serving") == none
    for bad in ("nan", "inf", "x"):
        get("b", "/v1/dashboard/serving", 422, after=bad)
    from tidal.control import loans
    assert loans.HISTORY_STEPS <= 5000  # the timeline is bounded in memory


def test_assets_and_headers(dash):
    _, _, http, _, _ = dash
    r = http.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/dashboard"
    page = http.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["referrer-policy"] == "no-referrer"
    for src in re.findall(r'(?:src|href)="(/dashboard/assets/[^"]+)"', page.text):
        a = http.get(src)
        assert a.status_code == 200 and a.content, src
    assert "javascript" in http.get("/dashboard/assets/app.js").headers["content-type"]
    for bad in ("../api.py", "..%2Fapi.py", "/etc/passwd", "vendor/../../api.py", "index.html", "nope.js",
                "%00", "vendor/uplot/README.md"):
        assert http.get(f"/dashboard/assets/{bad}").status_code == 404, bad
    # the page holds no token and no data; the JSON behind it is the API's, token-checked
    assert "tidal_" not in page.text.replace("tidal_...", "")


def test_vendored_chart_library_matches_its_pins():
    d = dashboard.WEB_DIR / "vendor" / "uplot"
    readme = (d / "README.md").read_text()
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((d / name).read_bytes()).hexdigest()
        assert f"`{name}` | `{digest}`" in readme, name
    assert "MIT" in (d / "LICENSE").read_text()
    assert "v1.6.32" in (d / "uPlot.iife.min.js").read_text()[:100]


@pytest.mark.slow
def test_fuzzed_queries_never_fail_the_service(dash):
    """Random filters and page numbers, and stored values JSON cannot hold as they are (a NaN loss, a lone
    surrogate): always an answer under 500, never another tenant's job."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    store, _, http, _, tokens = dash
    theirs = _submit(store, "b", "theirs")
    odd = _submit(store, "a", "odd", command=["python", "\ud800"])
    store.update(odd, progress={"loss": float("nan"), "step": 3})
    odd_text = ["\x00", "%", "_", "\\", "'", "running", "-1", "1e9"]
    text = st.one_of(st.text(max_size=12), st.sampled_from(odd_text))

    def as_a(path: str, params: dict):
        return http.get(path, params=params, headers={"Authorization": f"Bearer {tokens['a']}"})

    names = ["state", "kind", "tenant", "q", "offset", "limit", "after"]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(params=st.dictionaries(st.sampled_from(names), text, max_size=4))
    def fuzz(params):
        for path in ("/v1/dashboard/jobs", "/v1/dashboard/pool", "/v1/dashboard/serving"):
            r = as_a(path, params)
            assert r.status_code < 500, (path, params, r.text[:200])
            assert theirs not in r.text

    fuzz()
    row = next(j for j in as_a("/v1/dashboard/jobs", {}).json()["jobs"] if j["id"] == odd)
    assert row["loss"] is None and row["step"] == 3

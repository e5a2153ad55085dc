"""The REST API in-process (the client over Starlette's TestClient: our transport seam): auth,
tenant isolation as a full matrix, 422 naming the field, logs, checkpoints, pool, metrics, OpenAPI."""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():  # starlette 1.x suggests another httpx package for its test client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from control_fakes import FakeClock
from tidal.control.api import ApiContext, create_app
from tidal.control.auth import create_tenant, ensure_admin, token_hash
from tidal.control.client import ApiError, TidalClient
from tidal.control.locations import LocationPolicy
from tidal.control.store import Store
from tidal.model import Node

SPEC = {"name": "job", "gpus": 1, "command": ["python", "train.py"], "workdir": "/tmp"}


@pytest.fixture
def api(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    admin_token, created = ensure_admin(store, tmp_path, 0.0)
    assert created
    logs = tmp_path / "logs"

    def log_path(job_id: str, rank: int) -> str:
        return str(logs / job_id / f"rank-{rank}.log")

    app = create_app(ApiContext(store, [Node("local", 4)], log_path, FakeClock(), ckpt_root=tmp_path / "jobs",
                                locations=LocationPolicy(tmp_path / "tenants")))
    http = TestClient(app)
    tokens = {"admin": admin_token,
              "a": create_tenant(store, "a", quota_gpus=2, weight=1.0),
              "b": create_tenant(store, "b", quota_gpus=0, weight=2.0)}
    clients = {k: TidalClient(http=http, token=t) for k, t in tokens.items()}
    jobs = {k: clients[k].submit({**SPEC, "name": f"job-{k}"})["id"] for k in ("a", "b")}
    for k, j in jobs.items():
        (logs / j).mkdir(parents=True)
        (logs / j / "rank-0.log").write_text(f"secret of {k}\n")
    yield clients, jobs, store, http, tmp_path
    store.close()


def test_admin_token_file_and_hashes_only(api):
    clients, jobs, store, _, tmp_path = api
    token = (tmp_path / "admin.token").read_text().strip()
    assert (tmp_path / "admin.token").stat().st_mode & 0o777 == 0o600
    assert store.admin().token_hash == token_hash(token)
    assert all(t.token_hash != clients[t.name].token for t in store.tenants())  # never in clear
    assert ensure_admin(store, tmp_path, 1.0) == (token, False)  # second start: same token
    assert clients["a"].whoami() == {
        "tenant": "a",
        "admin": False,
        "quota_gpus": 2,
        "weight": 1.0,
        "max_priority": 0,
    }


@pytest.mark.parametrize("token", [None, "", "tidal_wrong"])
def test_unauthenticated_is_401(api, token):
    clients, jobs, _, http, _ = api
    c = TidalClient(http=http, token=token)
    for call in (c.whoami, c.jobs, c.pool, lambda: c.job(jobs["a"]), lambda: c.submit(SPEC), c.events):
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 401
    assert http.get("/v1/jobs", headers={"Authorization": f"Basic {clients['a'].token}"}).status_code == 401


def _job_calls(c: TidalClient, job_id: str):
    return {"get": lambda: c.job(job_id), "logs": lambda: c.logs(job_id), "events": lambda: c.events(job_id),
            "cancel": lambda: c.cancel(job_id), "checkpoints": lambda: c.checkpoints(job_id)}


@pytest.mark.slow
@pytest.mark.parametrize("caller", ["a", "b", "admin"])
@pytest.mark.parametrize("owner", ["a", "b"])
@pytest.mark.parametrize("endpoint", ["get", "logs", "events", "cancel", "checkpoints"])
def test_isolation_matrix(api, caller, owner, endpoint):
    clients, jobs, store, _, _ = api
    call = _job_calls(clients[caller], jobs[owner])[endpoint]
    if caller in (owner, "admin"):
        out = call()
        if endpoint == "logs":
            assert out["data"] == f"secret of {owner}\n"
        if endpoint == "cancel":
            assert store.job(jobs[owner]).cancel_requested
        if endpoint == "checkpoints":
            assert out["job"] == jobs[owner] and out["url"].endswith(f"/jobs/{jobs[owner]}/ckpt")
    else:
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 404 and "not found" in str(e.value)
        assert not store.job(jobs[owner]).cancel_requested


def test_lists_show_only_own_objects(api):
    clients, jobs, _, _, _ = api
    assert [j["id"] for j in clients["a"].jobs()] == [jobs["a"]]
    assert [j["id"] for j in clients["b"].jobs(tenant="a")] == [jobs["b"]]  # tenant filter is admin-only
    assert [j["id"] for j in clients["admin"].jobs()] == [jobs["a"], jobs["b"]]
    assert [j["id"] for j in clients["admin"].jobs(tenant="b")] == [jobs["b"]]
    assert {e["tenant"] for e in clients["a"].events()} == {"a"}
    assert {e["job"] for e in clients["a"].events() if e["job"]} == {jobs["a"]}
    assert clients["a"].jobs(states=["running"]) == []


def test_tenants_are_admin_only(api):
    clients, _, _, _, _ = api
    for who in ("a", "b"):
        with pytest.raises(ApiError) as e:
            clients[who].create_tenant("c", quota_gpus=1)
        assert e.value.status == 403
        with pytest.raises(ApiError):
            clients[who].tenants()
    made = clients["admin"].create_tenant("c", quota_gpus=1, weight=0.5)
    assert made["token"].startswith("tidal_")
    assert TidalClient(http=clients["a"].http, token=made["token"]).whoami()["tenant"] == "c"
    with pytest.raises(ApiError) as e:
        clients["admin"].create_tenant("c")
    assert e.value.status == 409
    with pytest.raises(ApiError) as e:
        clients["admin"].create_tenant("d", weight=0)
    assert e.value.status == 422 and e.value.errors == ["weight: Input should be greater than 0"]


def test_bad_spec_is_422_naming_the_field(api):
    clients, _, _, http, _ = api
    r = http.post("/v1/jobs", json={**SPEC, "gpus": {"min": 0}, "bogus": 1},
                  headers={"Authorization": f"Bearer {clients['a'].token}"})
    assert r.status_code == 422
    body = r.json()
    assert {d["field"] for d in body["detail"]} == {"gpus.min", "bogus"}
    assert ["body", "gpus", "min"] in [d["loc"] for d in body["detail"]]
    with pytest.raises(ApiError) as e:
        clients["a"].submit({**SPEC, "command": "python train.py"})
    assert e.value.status == 422 and e.value.errors[0].startswith("command: expected a list of arguments")
    with pytest.raises(ApiError) as e:
        clients["a"].submit({**SPEC, "gpus": 5})
    assert e.value.errors == ["gpus.min: 5 GPUs requested, the pool has 4"]
    with pytest.raises(ApiError) as e:
        clients["b"].submit({**SPEC, "kind": "dedicated"})
    assert "tenant b has a quota of 0" in e.value.errors[0]


@pytest.mark.parametrize("path, param", [("/v1/jobs", "offset"), ("/v1/events", "after")])
def test_an_offset_past_what_the_store_counts_is_422_naming_it(api, path, param):
    """(Past a SQL INTEGER the driver could not bind it, nor PostgreSQL compare it: a 500 the API fuzz test
    found.)"""
    clients, _, _, http, _ = api
    for who in ("admin", "a"):
        auth = {"Authorization": f"Bearer {clients[who].token}"}
        r = http.get(path, params={param: str(1 << 31)}, headers=auth)
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == f"query.{param}", r.text
        assert http.get(path, params={param: str((1 << 31) - 1)}, headers=auth).json() == []


def test_cancel_twice_and_after_the_end(api):
    clients, jobs, store, _, _ = api
    clients["a"].cancel(jobs["a"])
    clients["a"].cancel(jobs["a"])
    assert sum(e["kind"] == "cancel" for e in clients["a"].events(jobs["a"])) == 1
    from tidal.control.states import State

    store.transition(jobs["a"], State.CANCELLED, 1.0, "cancelled")
    with pytest.raises(ApiError) as e:
        clients["a"].cancel(jobs["a"])
    assert e.value.status == 409


def test_logs_by_offset_and_missing_rank(api):
    clients, jobs, _, _, _ = api
    first = clients["a"].logs(jobs["a"], offset=0, limit=7)
    assert first["data"] == "secret " and first["offset"] == 7 and first["size"] == 12
    rest = clients["a"].logs(jobs["a"], offset=first["offset"])
    assert rest["data"] == "of a\n" and rest["offset"] == 12
    with pytest.raises(ApiError) as e:
        clients["a"].logs(jobs["a"], rank=3)
    assert e.value.status == 404


def test_pool_hides_other_tenants_job_ids(api):
    clients, jobs, store, _, _ = api
    from tidal.control.states import State

    assert clients["a"].pool()["pending"] == 1 and clients["admin"].pool()["pending"] == 2
    for j in jobs.values():
        store.transition(j, State.ADMITTED, 1.0, "x", placement={"local": 1}, attempt=1)
    pool_a = clients["a"].pool()
    assert pool_a["allocated"] == 2 and pool_a["free"] == 2
    assert {(h["job"], h["tenant"]) for h in pool_a["nodes"][0]["jobs"]} == {(jobs["a"], "a"), (None, "b")}
    assert {h["job"] for h in clients["admin"].pool()["nodes"][0]["jobs"]} == set(jobs.values())


def test_metrics_and_openapi(api):
    clients, jobs, store, http, _ = api
    from tidal.control.states import State

    store.transition(jobs["a"], State.ADMITTED, 1.0, "x", placement={"local": 1}, attempt=1,
                     progress={"step": 7, "steps_per_s": 2.0, "tiers": {"shm": [6, 0.5]}})
    text = clients["admin"].metrics()
    assert 'tidal_pool_gpus{pool="training",state="allocated",tenant="a"} 1.0' in text
    assert 'tidal_pool_gpus{pool="training",state="free",tenant=""} 3.0' in text
    assert 'tidal_jobs{state="pending"} 1.0' in text and 'tidal_jobs{state="admitted"} 1.0' in text
    assert f'tidal_job_step{{job_id="{jobs["a"]}",tenant="a"}} 7.0' in text
    assert f'tidal_job_steps_per_second{{job_id="{jobs["a"]}",tenant="a"}} 2.0' in text
    assert f'tidal_job_checkpoint_age_seconds{{job_id="{jobs["a"]}",tenant="a",tier="shm"}}' in text
    assert f'tidal_job_restarts_total{{job_id="{jobs["a"]}",tenant="a"}} 0.0' in text
    assert "tidal_job_ettr_ratio" in text and "tidal_job_lost_work_seconds_total" in text
    doc = http.get("/openapi.json").json()
    assert {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/logs",
        "/v1/events",
        "/v1/pool",
        "/v1/tenants",
        "/metrics",
    } <= set(doc["paths"])
    assert "JobSpec" in doc["components"]["schemas"]


def test_token_change_is_seen_at_once(api):
    clients, _, store, http, _ = api
    assert clients["a"].whoami()["tenant"] == "a"  # now remembered by the store
    store.set_tenant_token("a", token_hash("tidal_new"))
    with pytest.raises(ApiError) as e:
        clients["a"].whoami()
    assert e.value.status == 401
    assert TidalClient(http=http, token="tidal_new").whoami()["tenant"] == "a"


def test_logs_never_split_a_character(api, tmp_path):
    clients, jobs, _, _, _ = api
    text = "rank 0 \u2192 \u00e9t\u00e9 \U0001f600 ok\n"
    (tmp_path / "logs" / jobs["a"] / "rank-0.log").write_bytes(text.encode())
    got, offset = "", 0
    for _ in range(100):  # 3-byte chunks: most multi-byte characters are cut by the limit
        c = clients["a"].logs(jobs["a"], offset=offset, limit=3)
        got, offset = got + c["data"], c["offset"]
        if offset >= c["size"]:
            break
    assert got == text and "\ufffd" not in got


def test_checkpoints_reports_real_steps(api, tmp_path, monkeypatch):
    """Steps written by tidal.ckpt.Checkpointer into the job's default location (and its shm tier,
    with the status file) come back per tier, with the newest durable step and its age."""
    import time

    import torch

    from tidal import ckpt

    clients, jobs, store, http, _ = api
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))
    empty = clients["a"].checkpoints(jobs["a"])
    assert (
        empty["steps"] == [] and empty["newest_durable_step"] is None and empty["tiers"][0]["kind"] == "dir"
    )
    url = tmp_path / "jobs" / jobs["a"] / "ckpt"
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 0}
    t0 = time.time()
    cp = ckpt.Checkpointer(str(url), keep=2)
    try:
        for step in (10, 20, 30):
            state["step"] = step
            cp.save(step, state).wait()
    finally:
        cp.close()
    t1 = time.time()
    out = clients["admin"].checkpoints(jobs["a"])
    by_kind = {t["kind"]: t for t in out["tiers"]}
    assert by_kind["dir"]["steps"] == ckpt.steps(str(url)) == [20, 30] and by_kind["dir"]["durable"]
    assert by_kind["shm"]["steps"] and not by_kind["shm"]["durable"] and by_kind["shm"]["steps"][-1] == 30
    assert out["steps"] == sorted(set(by_kind["dir"]["steps"]) | set(by_kind["shm"]["steps"]))
    assert out["newest_step"] == out["newest_durable_step"] == 30
    assert out["status_file"] and t0 <= out["newest_durable_s"] <= t1
    assert out["durable_age_s"] == 0.0  # the fixture's fake clock is before the save: never negative
    later = create_app(ApiContext(store, [Node("local", 4)], lambda j, r: None, FakeClock(t1 + 5.0),
                                  ckpt_root=tmp_path / "jobs"))
    aged = TidalClient(http=TestClient(later), token=clients["a"].token).checkpoints(jobs["a"])
    assert 5.0 <= aged["durable_age_s"] <= 5.0 + (t1 - t0)

    # A spec's own checkpoint.url (under the tenant's prefix) is where the endpoint looks; nothing there yet.
    elsewhere = tmp_path / "tenants" / "b" / "elsewhere"
    other = clients["b"].submit({**SPEC, "name": "own-url", "checkpoint": {"url": str(elsewhere)}})
    assert clients["b"].checkpoints(other["id"])["url"] == str(elsewhere)
    assert clients["b"].checkpoints(other["id"])["steps"] == []
    with pytest.raises(ApiError) as e:
        clients["a"].checkpoints(other["id"])
    assert e.value.status == 404
    # A tier list: its first non-shm tier is the location; each tier is listed (the admin may name any).
    listed = clients["admin"].submit(
        {**SPEC, "name": "tiered", "checkpoint": {"tiers": ["shm", str(url), str(tmp_path / "t2")]}}
    )
    out = clients["admin"].checkpoints(listed["id"])
    assert out["url"] == str(url) and [t["location"] for t in out["tiers"] if t["kind"] == "dir"] == [
        str(url), str(tmp_path / "t2")]
    assert out["newest_durable_step"] == 30 and [t["steps"] for t in out["tiers"]][-1] == []


def test_a_spec_cannot_point_the_checkpoints_view_at_another_tenants_steps(api, tmp_path):
    """A tenant names ``TIDAL_SHM_DIR`` in its spec's env (a directory its job writes) and plants there,
    where the view looks for its job's shm tier, a link to another tenant's checkpoints: the API, which
    reads as the plane, would list that tenant's steps (and read its status file) for it. The view looks
    for a job's shared memory only where the plane put it."""
    from tidal.ckpt.format import manifest as mf
    from tidal.ckpt.tiers.directory import shm_root_for

    clients, jobs, *_ = api
    victim = tmp_path / "jobs" / jobs["a"] / "ckpt"
    for step in (7, 9):
        (victim / mf.step_dirname(step)).mkdir(parents=True)
        (victim / mf.step_dirname(step) / mf.MANIFEST).write_text("{}")
    planted = tmp_path / "written-by-b"
    job = clients["b"].submit({**SPEC, "name": "peek", "env": {"TIDAL_SHM_DIR": str(planted)}})["id"]
    link = planted / "tidal" / shm_root_for(clients["b"].checkpoints(job)["url"]).name
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    got = clients["b"].checkpoints(job)
    assert got["steps"] == [] and [t["kind"] for t in got["tiers"]] == ["dir"], got


def test_a_checkpoint_location_swapped_for_a_link_is_not_listed(api, tmp_path):
    """A tenant's job that owns the parent of its checkpoint location (made for its uid under a granted
    prefix) swaps the location for a link to another tenant's: the view, read as the plane, would list
    that tenant's steps. A location that no longer resolves where it was recorded is refused (409)."""
    from tidal.ckpt.format import manifest as mf

    clients, jobs, *_ = api
    victim = tmp_path / "jobs" / jobs["a"] / "ckpt"
    (victim / mf.step_dirname(7)).mkdir(parents=True)
    (victim / mf.step_dirname(7) / mf.MANIFEST).write_text("{}")
    own = tmp_path / "tenants" / "b" / "run" / "ck"
    job = clients["b"].submit({**SPEC, "name": "swap", "checkpoint": {"url": str(own)}})["id"]
    own.parent.mkdir(parents=True)
    own.symlink_to(victim)
    with pytest.raises(ApiError) as e:
        clients["b"].checkpoints(job)
    assert e.value.status == 409 and "symbolic link" in str(e.value)

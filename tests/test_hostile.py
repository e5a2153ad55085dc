"""Hostile tenants: input that must not get past validation, ids that must not be reused,
checkpoint locations that belong to a tenant, no outbound calls chosen by tenants from the API,
``/metrics`` behind the admin token, per-tenant priority limits and no cross-tenant preemption by
priority. Each test reproduces something the control plane did before; a fuzz run of the API checks
that no input makes it answer 500 or store a refused job."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import urllib.parse
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from control_fakes import FakeClock
from tidal.control.api import MAX_BODY_BYTES, UNDECLARED_RULES, ApiContext, create_app
from tidal.control.auth import create_tenant, ensure_admin
from tidal.control.locations import LocationPolicy
from tidal.control.states import State
from tidal.control.store import Store
from tidal.model import Node

SPEC = {"name": "job", "gpus": 1, "command": ["python", "train.py"], "workdir": "/tmp"}


class Api:
    def __init__(self, tmp_path: Path, policy: LocationPolicy | None = None) -> None:
        self.dir = tmp_path
        self.store = Store(f"sqlite:///{tmp_path}/tidal.db")
        self.admin, _ = ensure_admin(self.store, tmp_path, 0.0)
        self.tokens = {"admin": self.admin, "a": create_tenant(self.store, "a", quota_gpus=2),
                       "b": create_tenant(self.store, "b", max_priority=5)}
        policy = policy or LocationPolicy(tmp_path / "tenants")
        self.clock = FakeClock()
        app = create_app(ApiContext(self.store, [Node("local", 4)], lambda j, r: None, self.clock,
                                    ckpt_root=tmp_path / "jobs", locations=policy))
        self.http = TestClient(app, raise_server_exceptions=True)

    def h(self, who: str) -> dict:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def post(self, who: str, body, **kw):
        if not isinstance(body, bytes) and not hasattr(body, "__next__"):
            return self.http.post("/v1/jobs", json=body, headers=self.h(who), **kw)
        return self.http.post(
            "/v1/jobs", content=body, headers={**self.h(who), "Content-Type": "application/json"}, **kw
        )

    def count(self) -> int:
        return len(self.store.jobs())


@pytest.fixture
def api(tmp_path):
    a = Api(tmp_path)
    yield a
    a.store.close()


def _errors(r) -> list[str]:
    return r.json()["errors"]


# ------------------------------------------------------------------------------------------- A: input
def test_lone_surrogate_is_422_and_stores_nothing(api):
    body = b'{"name": "x", "gpus": 1, "command": ["python", "\\ud800"]}'
    r = api.post("a", body)
    assert r.status_code == 422 and _errors(r) == ["command[1]: lone UTF-16 surrogate (not valid Unicode)"]
    r = api.post("a", b'{"name": "x", "gpus": 1, "command": ["python"], "env": {"A": "\\udfff"}}')
    assert r.status_code == 422 and "env.A" in _errors(r)[0]
    assert api.count() == 0


def test_nul_bytes_are_422_naming_the_field(api):
    r = api.post("a", {**SPEC, "command": ["python", "x\x00y"]})
    assert r.status_code == 422 and _errors(r) == ["command[1]: NUL byte"]
    r = api.post("a", {**SPEC, "env": {"K": "v\x00"}})
    assert r.status_code == 422 and _errors(r) == ["env.K: NUL byte"]
    r = api.post("a", {**SPEC, "checkpoint": {"tiers": ["shm", {"url": "/x/y", "name": "a\x00"}]}})
    assert r.status_code == 422 and _errors(r)[0].startswith("checkpoint.tiers[1].name: NUL byte")
    r = api.post("a", {**SPEC, "checkpoint": {"tiers": ["shm", {"url": "/x/y", "a\x00b": 1}]}})
    assert r.status_code == 422 and _errors(r) == ["checkpoint.tiers[1]: key: NUL byte"]
    assert {e["type"] for e in r.json()["detail"]} <= UNDECLARED_RULES  # (a free-form key: no schema says)
    assert api.count() == 0


def test_body_size_limit_is_413_while_reading(api):
    big = {**SPEC, "env": {"BIG": "x" * (20 << 20)}}
    r = api.post("a", big)  # with a Content-Length: refused before reading
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["detail"]
    sent = []

    def chunks():  # no Content-Length (chunked): refused once the bytes read pass the limit
        data = json.dumps(big).encode()
        for i in range(0, len(data), 64 << 10):
            sent.append(i)
            yield data[i:i + (64 << 10)]

    r = api.post("a", chunks())
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    assert api.count() == 0


def test_field_limits_are_422_naming_the_field(api):
    cases = {"command": {**SPEC, "command": ["python"] + ["a"] * 2000},
             "command[1]": {**SPEC, "command": ["python", "a" * 40000]},
             "env": {**SPEC, "env": {f"K{i}": "v" for i in range(300)}},
             "env.K": {**SPEC, "env": {"K": "v" * 40000}},
             "workdir": {**SPEC, "workdir": "/" + "a" * 5000},
             "gpus.max": {**SPEC, "gpus": {"min": 1, "max": 10 ** 30}},
             "checkpoint.interval_s": {**SPEC, "checkpoint": {"interval_s": 1e300}},
             "checkpoint.tiers": {**SPEC, "checkpoint": {"tiers": ["shm"] + [f"/d/{i}" for i in range(20)]}}}
    for field, spec in cases.items():
        r = api.post("a", spec)
        assert r.status_code == 422, (field, r.status_code, r.text[:200])
        assert any(e.startswith(field + ":") for e in _errors(r)), (field, _errors(r))
    assert api.count() == 0


def test_invalid_utf8_and_json_are_400_saying_so(api):
    r = api.post("a", b'{"name": "\xff\xfe", "gpus": 1, "command": ["x"]}')
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["detail"]
    r = api.post("a", b'{"name": "x", "gpus": 1,')
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = api.post("a", b'{"name": "x", "gpus": 1, "command": ["x"], "grace_s": NaN}')
    assert r.status_code == 400 and "NaN" in r.json()["detail"]
    assert api.count() == 0


@pytest.mark.parametrize("depth", [3000, 200_000])
def test_a_deeply_nested_body_is_400_and_the_api_answers_the_next_request(api, depth):
    """``[`` x 3,000 (6 KB) overflowed the JSON parser: a 500, once a reset connection."""
    for body in (b"[" * depth, b'{"name": "x", "gpus": 1, "command": ["python"], "env": ' + b"[" * depth):
        r = api.post("a", body)
        assert r.status_code == 400 and "nested too deeply" in r.json()["detail"], r.text
        r = api.http.post("/v1/tenants", content=b'{"name": ' + b"[" * depth,
                          headers={**api.h("admin"), "Content-Type": "application/json"})
        assert r.status_code in (400, 422) and r.status_code != 500, r.text
    assert api.count() == 0
    assert api.post("a", SPEC).status_code == 201


def test_a_log_the_job_swapped_for_a_link_or_a_fifo_is_never_read_through(tmp_path):
    """The plane created rank logs with O_NOFOLLOW but read them with a plain open: a job that replaced
    its log with a link to the admin token got the token back from ``GET /v1/jobs/{id}/logs``."""
    logs = tmp_path / "logs"
    logs.mkdir()
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    try:
        ensure_admin(store, tmp_path, 0.0)
        token = create_tenant(store, "a", quota_gpus=2)
        app = create_app(ApiContext(store, [Node("local", 4)], lambda j, r: str(logs / f"{j}-{r}.log"),
                                    FakeClock()))
        http = TestClient(app, raise_server_exceptions=False)
        h = {"Authorization": f"Bearer {token}"}
        jid = http.post("/v1/jobs", json={**SPEC, "gpus": {"min": 1, "max": 4}}, headers=h).json()["id"]
        (logs / f"{jid}-0.log").write_text("step 1\n")
        (logs / f"{jid}-1.log").symlink_to(tmp_path / "admin.token")
        os.mkfifo(logs / f"{jid}-2.log")
        other = tmp_path / "another-tenants-file"  # owned by another uid: as root, a hard link to it
        other.write_text((tmp_path / "admin.token").read_text())
        if os.geteuid() == 0:
            os.chown(other, 4242, -1)
        os.link(other, logs / f"{jid}-3.log")
        r = http.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}, headers=h)
        assert r.status_code == 200 and r.json()["data"] == "step 1\n"
        secret = (tmp_path / "admin.token").read_text().strip()
        # a link (to the admin token), a FIFO (would block the reader), a hard link to another uid's file
        for rank in (1, 2, 3) if os.geteuid() == 0 else (1, 2):
            r = http.get(f"/v1/jobs/{jid}/logs", params={"rank": rank}, headers=h)
            assert r.status_code == 404 and "not a regular file" in r.json()["detail"], r.text
            assert secret not in r.text
        assert http.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}, headers=h).status_code == 200
    finally:
        store.close()


def test_storage_error_while_submitting_is_500_and_stores_nothing(api):
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    def fail(conn, cursor, statement, *args):
        if statement.startswith("INSERT INTO events"):
            raise OperationalError(statement, {}, Exception("disk I/O error"))

    event.listen(api.store.engine, "before_cursor_execute", fail)
    try:
        r = api.post("a", SPEC)
    finally:
        event.remove(api.store.engine, "before_cursor_execute", fail)
    assert r.status_code == 500 and "nothing was changed" in r.json()["detail"]
    assert api.count() == 0
    assert api.post("a", SPEC).json()["id"] == "job-1"  # the number was not used either


def test_a_stored_spec_that_cannot_be_encoded_never_makes_get_fail(api):
    """A job stored before validation refused such specs (a lone surrogate; a NaN loss in progress)."""
    row = api.store.submit(
        "a",
        {
            **SPEC,
            "name": "old",
            "command": ["python", "\ud800"],
            "kind": "spot",
            "priority": 0,
            "gpus": {"min": 1, "max": 1, "multiple_of": 1},
            "max_restarts": 3,
        },
        0.0,
    )
    api.store.update(row.id, progress={"loss": float("nan")})
    r = api.http.get(f"/v1/jobs/{row.id}", headers=api.h("a"))
    assert (
        r.status_code == 200
        and r.json()["spec"]["command"][1] == "\ud800"
        and r.json()["progress"]["loss"] is None
    )
    assert api.http.get("/v1/jobs", headers=api.h("a")).status_code == 200


_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "\x00",
            "\ud800",
            "a\udfffb",
            "x" * 40000,
            "",
            "shm",
            "/tmp/x",
            "s3://b/x",
            "peer",
            "peer://n",
            "..",
            "RANK",
        ]
    ),
)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 20, 10 ** 20), st.floats(), _text)
_value = st.recursive(
    _scalar,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(_text, c, max_size=4)),
    max_leaves=12,
)
_spec = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.sampled_from(["job", "a.b-c", ""]), _text),
        "kind": st.one_of(st.sampled_from(["spot", "dedicated"]), _value),
        "priority": st.one_of(st.integers(-2000, 2000), _value),
        "gpus": st.one_of(
            st.integers(-2, 10),
            st.fixed_dictionaries(
                {"min": st.integers(-1, 5)},
                optional={"max": st.integers(-1, 10**19), "multiple_of": st.integers(0, 3)},
            ),
            _value,
        ),
        "command": st.one_of(st.lists(_text, max_size=5), _value),
        "workdir": st.one_of(st.just("/tmp"), _value),
        "env": st.one_of(st.dictionaries(_text, _text, max_size=4), _value),
        "checkpoint": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "url": _text,
                    "tiers": st.lists(
                        st.one_of(_text, st.dictionaries(_text, _value, max_size=3)), max_size=3
                    ),
                    "interval_s": st.one_of(st.floats(), _text),
                    "resume_from": _text,
                },
            ),
            _value,
        ),
        "max_restarts": _value,
        "grace_s": st.one_of(st.floats(), _value),
        "extra": _value,
    },
)


@pytest.mark.slow
def test_fuzz_the_api_no_500_and_no_refused_job_stored(tmp_path):
    """Thousands of generated specs and raw bodies: never a 500, and a job is stored only with a 201."""
    api = Api(tmp_path)
    calls = {"n": 0, "created": 0}

    def check(r, who: str = "a") -> None:
        calls["n"] += 1
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if r.status_code == 201:  # stored, and its submitter sees it (another tenant would get a 404)
            calls["created"] += 1
            got = api.http.get(f"/v1/jobs/{r.json()['id']}", headers=api.h(who))
            assert got.status_code == 200
        assert api.count() == calls["created"]

    @settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(spec=st.one_of(_spec, _value), raw=st.booleans(), who=st.sampled_from(["a", "b", "admin"]))
    def fuzz_specs(spec, raw, who):
        if raw:  # as JSON text that Python can write (NaN, lone surrogates as escapes)
            check(api.post(who, json.dumps(spec, ensure_ascii=True, allow_nan=True).encode()), who)
        else:
            with contextlib.suppress(ValueError):  # httpx refuses to send a NaN itself
                check(api.post(who, spec), who)

    @settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        body=st.binary(max_size=64),
        path=st.sampled_from(
            [
                "/v1/jobs/{}",
                "/v1/jobs/{}/logs",
                "/v1/events?job={}",
                "/v1/jobs/{}/checkpoints",
                "/v1/jobs?state={}",
            ]
        ),
        arg=st.text(max_size=10),
    )
    def fuzz_requests(body, path, arg):
        check(api.post("a", body))
        r = api.http.get(path.format(urllib.parse.quote(arg, safe="")), headers=api.h("a"))
        check(r)

    try:
        fuzz_specs()
        fuzz_requests()
    finally:
        api.store.close()
    assert (
        calls["n"] >= 1500
    )  # examples hypothesis generated as duplicates or NaN bodies httpx refuses are not sent


# ------------------------------------------------------------------------------- B: ids and the store
def test_job_numbers_are_never_reused(api):
    first = api.post("a", SPEC).json()["id"]
    api.post("a", SPEC)
    db = sqlite3.connect(api.dir / "tidal.db")
    db.execute("DELETE FROM events")
    db.execute("DELETE FROM jobs")
    db.commit()
    db.close()
    assert api.post("a", SPEC).json()["id"] == "job-3" != first


def test_schema_3_database_is_migrated_and_numbers_continue(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    create_tenant(store, "a")
    spec = {
        **SPEC,
        "kind": "spot",
        "priority": 0,
        "gpus": {"min": 1, "max": 1, "multiple_of": 1},
        "max_restarts": 3,
    }
    store.submit("a", spec, 0.0)
    store.submit("a", spec, 0.0)
    store.close()
    db = sqlite3.connect(tmp_path / "tidal.db")
    db.execute("DROP INDEX ix_jobs_ckpt_location")
    db.execute("ALTER TABLE jobs DROP COLUMN ckpt_location")
    db.execute("ALTER TABLE tenants DROP COLUMN max_priority")
    db.execute("DELETE FROM meta WHERE key IN ('job_seq', 'db_id')")
    db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    assert store.submit("a", spec, 0.0).id == "job-3"
    assert store.tenant("a").max_priority in (None, 0) and store.db_id
    store.close()


def _state_with_jobs(tmp_path: Path) -> Path:
    from tidal.control.server import open_checked

    state = tmp_path / "state"
    store = open_checked(state if state.mkdir() is None else state, f"sqlite:///{state}/tidal.db")
    create_tenant(store, "a")
    spec = {
        **SPEC,
        "kind": "spot",
        "priority": 0,
        "gpus": {"min": 1, "max": 1, "multiple_of": 1},
        "max_restarts": 3,
    }
    for _ in range(2):
        j = store.submit("a", spec, 0.0)
        (state / "jobs" / j.id / "logs").mkdir(parents=True)
    store.close()
    return state


def test_start_refuses_missing_corrupt_or_foreign_database(tmp_path):
    from tidal.control.server import open_checked

    state = _state_with_jobs(tmp_path)
    url = f"sqlite:///{state}/tidal.db"
    open_checked(state, url).close()  # consistent: starts
    (state / "jobs" / "stranger-9").mkdir()
    with pytest.raises(SystemExit) as e:
        open_checked(state, url)
    msg = str(e.value)
    assert "\n" not in msg and "stranger-9" in msg and "does not know" in msg
    (state / "jobs" / "stranger-9").rmdir()
    os.rename(state / "tidal.db", state / "tidal.db.bak")
    with pytest.raises(SystemExit) as e:
        open_checked(state, url)
    msg = str(e.value)
    assert "\n" not in msg and f"{state}/tidal.db is missing" in msg and "restore" in msg
    assert not (state / "tidal.db").exists()  # no silent fresh start
    (state / "tidal.db").write_bytes(b"this is not a database" * 1000)
    with pytest.raises(SystemExit) as e:
        open_checked(state, url)
    msg = str(e.value)
    assert "\n" not in msg and "cannot read the database" in msg and str(state / "tidal.db") in msg
    assert len(msg) < 400


def test_database_deleted_while_running_is_503_not_201(api):
    assert api.post("a", SPEC).status_code == 201
    os.remove(api.dir / "tidal.db")
    r = api.post("a", SPEC)
    assert r.status_code == 503 and "deleted" in r.json()["detail"] and "tidal.db" in r.json()["detail"]
    assert api.http.get("/v1/jobs", headers=api.h("a")).status_code == 503


# ------------------------------------------------------------------------- C: checkpoint locations
def test_another_tenants_checkpoint_location_is_refused(api):
    a_job = api.post("a", SPEC).json()["id"]
    for url in (str(api.dir / "jobs" / a_job / "ckpt"), str(api.dir / "tenants" / "a" / "run"),
                str(api.dir / "tenants" / "b" / ".." / "a" / "run"), "/tmp/anywhere"):
        r = api.post("b", {**SPEC, "checkpoint": {"url": url}})
        assert r.status_code == 422 and _errors(r)[0].startswith("checkpoint.url:"), (url, r.text)
    r = api.post("b", {**SPEC, "checkpoint": {"tiers": ["shm", str(api.dir / "jobs" / a_job / "ckpt")]}})
    assert r.status_code == 422 and _errors(r)[0].startswith("checkpoint.tiers:")
    link = api.dir / "tenants" / "b" / "link"
    link.parent.mkdir(parents=True)
    link.symlink_to(api.dir / "jobs")
    r = api.post("b", {**SPEC, "checkpoint": {"url": str(link / a_job / "ckpt")}})
    assert r.status_code == 422  # a symbolic link out of the prefix does not count
    assert api.count() == 1


def test_two_jobs_share_a_location_only_by_resume_from(api):
    own = str(api.dir / "tenants" / "b" / "gpt")
    first = api.post("b", {**SPEC, "checkpoint": {"url": own}}).json()["id"]
    for url in (own, own + "/inner", str(api.dir / "tenants" / "b")):
        r = api.post("b", {**SPEC, "checkpoint": {"url": url}})
        assert r.status_code == 422 and "resume_from" in _errors(r)[0], url
    r = api.post("b", {**SPEC, "checkpoint": {"resume_from": first}})
    assert r.status_code == 422 and "checkpoint.resume_from" in _errors(r)[0]  # still pending
    r = api.post("a", {**SPEC, "checkpoint": {"resume_from": first}})
    assert r.status_code == 422 and "no job" in _errors(r)[0]  # another tenant's: as if it did not exist
    api.store.transition(first, State.CANCELLED, 1.0, "cancelled")
    second = api.post("b", {**SPEC, "checkpoint": {"resume_from": first}})
    assert second.status_code == 201 and second.json()["spec"]["checkpoint"]["url"] == own
    r = api.post("b", {**SPEC, "checkpoint": {"resume_from": first}})
    assert r.status_code == 422  # the second one (pending) holds it now
    # a default location is taken over the same way
    a1 = api.post("a", SPEC).json()["id"]
    api.store.transition(a1, State.CANCELLED, 1.0, "cancelled")
    a2 = api.post("a", {**SPEC, "checkpoint": {"resume_from": a1}}).json()
    assert a2["spec"]["checkpoint"]["url"] == str(api.dir / "jobs" / a1 / "ckpt")


def test_a_location_holding_steps_of_no_known_job_is_refused(api):
    import torch

    from tidal import ckpt

    old = api.dir / "tenants" / "a" / "gpt"
    cp = ckpt.Checkpointer(str(old), keep=2, tiers=[str(old)])
    cp.save(60, {"w": torch.zeros(2)}).wait()
    cp.close()
    r = api.post("a", {**SPEC, "checkpoint": {"url": str(old)}})
    assert r.status_code == 422 and "already holds checkpoint steps" in _errors(r)[0]


# --------------------------------------------------------------------- D: no outbound calls by tenants
def test_remote_tiers_need_an_allowed_endpoint_and_bounded_timeouts(api):
    own = str(api.dir / "tenants" / "a" / "r")
    for tier in ({"url": "s3://bucket/x", "endpoint": "http://10.0.0.1:9000"}, "s3://bucket/x",
                 {"kind": "peer", "agent": "169.254.169.254:80"}):
        r = api.post("a", {**SPEC, "checkpoint": {"tiers": ["shm", own, tier]}})
        assert r.status_code == 422 and "not allowed" in " ".join(_errors(r)), (tier, r.text)
    # A peer tier naming no agent means the executor's own agents; this plane runs none.
    r = api.post("a", {**SPEC, "checkpoint": {"tiers": ["shm", own, "peer"]}})
    assert r.status_code == 422 and "runs none" in " ".join(_errors(r)), r.text
    r = api.post("a", {**SPEC, "checkpoint": {"url": "s3://bucket/x"}})
    assert r.status_code == 422


def test_a_peer_tier_without_an_agent_uses_the_executors_agents_when_it_runs_them(tmp_path):
    """With the executor's own agents (Ray, --ckpt-agents) a tenant's plain ``peer`` tier is accepted;
    an agent the tenant names still has to be allowed."""
    api = Api(tmp_path, LocationPolicy(tmp_path / "tenants", own_agents=True))
    own = str(tmp_path / "tenants" / "a" / "r")
    r = api.post("a", {**SPEC, "checkpoint": {"tiers": ["shm", own, "peer"]}})
    assert r.status_code == 201, r.text
    r = api.post("a", {**SPEC, "checkpoint": {"tiers": ["shm", str(tmp_path / "tenants" / "a" / "r2"),
                                                         {"kind": "peer", "peers": ["10.1.2.3:7000"]}]}})
    assert r.status_code == 422 and "10.1.2.3:7000 is not allowed" in " ".join(_errors(r)), r.text
    api.store.close()


def test_checkpoint_view_never_connects_to_a_tenants_endpoint(tmp_path, monkeypatch):
    from tidal.ckpt.tiers import peer, s3

    policy = LocationPolicy(tmp_path / "tenants", grants={"a": ("s3://bucket",)},
                            endpoints=("http://127.0.0.1:9", "127.0.0.1:9"), max_timeout_s=30)
    api = Api(tmp_path, policy)
    own = str(tmp_path / "tenants" / "a" / "r")
    r = api.post("a", {**SPEC, "checkpoint": {"tiers": [
        "shm", own, {"url": "s3://bucket/r", "endpoint": "http://127.0.0.1:9", "retry_timeout_s": 86400}]}})
    assert r.status_code == 422 and "retry_timeout_s" in _errors(r)[0]
    job = api.post("a", {**SPEC, "checkpoint": {"tiers": [
        "shm", own, {"url": "s3://bucket/r", "endpoint": "http://127.0.0.1:9"},
        {"kind": "peer", "agent": "127.0.0.1:9", "timeout_s": 30}]}})
    assert job.status_code == 201, job.text

    def no(*a, **k):
        raise AssertionError("the API process connected to a tenant's endpoint")

    monkeypatch.setattr(s3.S3Tier, "__init__", no)
    monkeypatch.setattr(peer.PeerTier, "__init__", no)
    out = api.http.get(f"/v1/jobs/{job.json()['id']}/checkpoints", headers=api.h("a")).json()
    assert [(t["kind"], t["source"]) for t in out["tiers"]] == [
        ("dir", "storage"),
        ("s3", "spec"),
        ("peer", "spec"),
    ]
    api.store.close()


# ---------------------------------------------------------------- E: metrics, priority, preemption
def test_metrics_take_the_admin_token(api):
    api.post("a", SPEC)
    assert api.http.get("/metrics").status_code == 401
    assert api.http.get("/metrics", headers=api.h("a")).status_code == 403
    r = api.http.get("/metrics", headers=api.h("admin"))
    assert r.status_code == 200 and 'tidal_jobs{state="pending"} 1.0' in r.text  # (no series per waiting job)


def test_priority_is_capped_per_tenant(api):
    r = api.post("a", {**SPEC, "priority": 1})
    assert r.status_code == 422 and _errors(r) == [
        "priority: priority 1 is above tenant a's limit of 0 (max_priority, set by the admin)"]
    assert api.post("b", {**SPEC, "priority": 5}).status_code == 201
    assert api.post("b", {**SPEC, "priority": 6}).status_code == 422
    assert api.post("admin", {**SPEC, "priority": 1000}).status_code == 201
    made = api.http.post("/v1/tenants", json={"name": "c", "max_priority": 7}, headers=api.h("admin")).json()
    assert made["max_priority"] == 7 and api.store.tenant("c").max_priority == 7


def test_priority_never_preempts_another_tenants_job():
    from sched_fixtures import nodes, pend, run, snap, tenants
    from tidal.model import Preempt
    from tidal.policy.scheduler import SchedulerConfig, schedule

    cfg = SchedulerConfig()
    # tenant b (holding nothing) waits at priority 100; tenant a's jobs (priority 0) fill the pool:
    # with equal weights fair share lets b take its half; with a tiny weight, priority alone must not.
    for weights, expect in (((1.0, 1.0), True), ((1.0, 0.001), False)):
        s = snap(10_000.0, nodes((4,)), tenants(("a", 0, weights[0]), ("b", 0, weights[1])),
                 [run("a-1", {"t0": 2}, tenant="a"), run("a-2", {"t0": 2}, tenant="a"),
                  pend("b-1", tenant="b", min=2, priority=100)])
        pre = [d for d in schedule(s, cfg) if isinstance(d, Preempt)]
        assert bool(pre) == expect, (weights, pre)
        assert all(d.reason == "fair_share" for d in pre)
    # within a tenant, priority still preempts
    s = snap(10_000.0, nodes((4,)), tenants(("a", 0, 1.0)),
             [run("a-1", {"t0": 4}, tenant="a"), pend("a-2", tenant="a", min=4, priority=100)])
    assert [d.reason for d in schedule(s, cfg) if isinstance(d, Preempt)] == ["priority"]


# ------------------------------------------------------------- F: files a job controls, bounded resources
def test_open_plain_refuses_another_uids_file_and_one_over_the_cap(tmp_path):
    from tidal.files import NotPlainFile, open_plain, read_plain

    p = tmp_path / "heartbeat.json"
    p.write_bytes(b"x" * 100)
    assert read_plain(p, 100) == b"x" * 100
    with pytest.raises(NotPlainFile, match="over the limit of 99") as e:
        read_plain(p, 99)
    assert e.value.errno == errno.EFBIG
    if os.geteuid() == 0:  # a hard link a job made to another tenant's file: owned by a third uid
        os.chown(p, 54321, 54321)
        with pytest.raises(NotPlainFile, match="owned by uid 54321, not by the job's uid 12345") as e:
            open_plain(p, owner=12345)
        assert e.value.errno == errno.EPERM
        open_plain(p, owner=54321).close()
    else:
        with pytest.raises(NotPlainFile, match="owned by uid 0"):
            open_plain("/etc/passwd", owner=os.geteuid() + 1)


def test_a_huge_sparse_progress_file_is_read_in_bounded_chunks(tmp_path):
    """The plane read a job's progress file to its end at each observation: a sparse file of 64 GiB
    (free to its writer) would be read into the plane's memory at once."""
    from tidal.contract import progress_file
    from tidal.exec.progress import MAX_READ_BYTES, ProgressReader

    p = tmp_path / progress_file(0)
    p.write_text(json.dumps({"event": "step", "step": 7, "time": 1.0}) + "\n")
    with open(p, "r+b") as f:
        f.truncate(64 << 30)
    reader = ProgressReader(tmp_path, 1)
    assert reader.read().step == 7
    assert reader._offset == MAX_READ_BYTES and len(reader._partial) <= MAX_READ_BYTES
    reader.read()
    assert reader._offset == 2 * MAX_READ_BYTES and len(reader._partial) <= MAX_READ_BYTES


def test_a_status_file_the_job_swapped_or_inflated_is_refused_not_read(tmp_path, monkeypatch):
    """``GET /v1/jobs/{id}/checkpoints`` read the job's status file (in its shared memory) with a plain
    read: through a link the job planted (another tenant's status, the admin token) and whole, so a
    sparse file of 64 GiB took the plane's memory."""
    from tidal.ckpt.tiers.directory import SHM_BASE_ENV, shm_root_for

    monkeypatch.setenv(SHM_BASE_ENV, str(tmp_path / "shm"))
    api = Api(tmp_path)
    try:
        job = api.post("a", SPEC).json()["id"]
        status = Path(tmp_path / "shm" / "tidal" / shm_root_for(str(tmp_path / "jobs" / job / "ckpt")).name,
                      "status.json")
        status.parent.mkdir(parents=True)
        other = tmp_path / "other-tenants-status.json"
        other.write_text(json.dumps({"format": "tidal-ckpt-status", "job": "theirs-1", "updated_unix_s": 1.0,
                                     "tiers": [], "steps": []}))
        status.symlink_to(other)
        r = api.http.get(f"/v1/jobs/{job}/checkpoints", headers=api.h("a"))
        assert r.status_code == 200 and r.json()["status_file"] is None and "ELOOP" not in r.text
        assert "Too many levels of symbolic links" in r.json()["status_error"]
        status.unlink()
        with open(status, "wb") as f:
            f.truncate(64 << 30)
        r = api.http.get(f"/v1/jobs/{job}/checkpoints", headers=api.h("a"))
        assert r.status_code == 200 and "over the limit" in r.text and r.json()["status_file"] is None
    finally:
        api.store.close()


def test_a_rank_log_is_capped_keeping_its_tail_and_readers_follow_the_cut(tmp_path):
    """A rank's output went to its log without a bound: a job printing in a loop filled the plane's
    disk. Past the cap the newest half stays, after a line saying what was cut, and the rank (which
    appends through the descriptor the plane handed it) goes on writing after it."""
    from tidal.exec.files import cap_log

    log = tmp_path / "rank-0.log"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # as the plane opens it
    try:
        for i in range(2000):
            os.write(fd, f"line {i:05d} {'x' * 40}\n".encode())
        assert cap_log(str(log), 1 << 20) == 0
        size = log.stat().st_size
        cut = cap_log(str(log), 16 << 10)
        os.write(fd, b"after the cut\n")
    finally:
        os.close(fd)
    data = log.read_text()
    first, rest = data.split("\n", 1)
    assert first == f"=== tidal: {cut} bytes of this log were cut here (the log is kept under 16384 " \
                    "bytes: isolation.max_log_bytes) ==="
    assert rest.startswith("line ") and rest.endswith("line 01999 " + "x" * 40 + "\nafter the cut\n")
    assert size - cut == len(rest) - len("after the cut\n") and len(data) < 9 << 10

    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    try:  # a follower whose offset is past the cut log's end reads it anew from the marker
        ensure_admin(store, tmp_path, 0.0)
        token = create_tenant(store, "a")
        app = create_app(ApiContext(store, [Node("local", 4)], lambda j, r: str(log), FakeClock()))
        http = TestClient(app, raise_server_exceptions=False)
        h = {"Authorization": f"Bearer {token}"}
        jid = http.post("/v1/jobs", json=SPEC, headers=h).json()["id"]
        r = http.get(f"/v1/jobs/{jid}/logs", params={"offset": size}, headers=h).json()
        assert r["data"].startswith("=== tidal: ") and r["offset"] == len(data)
    finally:
        store.close()


def test_every_path_names_all_its_methods_in_allow_and_tenant_bodies_get_the_same_400s(api):
    """Starlette's 405 named the methods of one route only (``Allow: POST`` on /v1/jobs, which also
    answers GET); POST /v1/tenants answered an undocumented 400 without saying what was wrong."""
    for path in ("/v1/jobs", "/v1/tenants"):
        r = api.http.request("OPTIONS", path, headers=api.h("admin"))
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.headers
    post = {**api.h("admin"), "Content-Type": "application/json"}
    r = api.http.post("/v1/tenants", content=b"\xff", headers=post)
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["detail"]
    r = api.http.post("/v1/tenants", content=b"{nope", headers=post)
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = api.http.post("/v1/tenants", content=b"[" * 100000 + b"]" * 100000, headers=post)
    assert r.status_code == 400 and "nested too deeply" in r.json()["detail"]
    r = api.http.post("/v1/tenants", json={"name": "t", "max_priority": False}, headers=api.h("admin"))
    assert r.status_code == 422 and r.json()["errors"] == ["max_priority: expected a number, got bool False"]
    r = api.http.post("/v1/tenants", json={"name": "t", "quota_gpus": 2.0}, headers=api.h("admin"))
    assert r.status_code == 201 and r.json()["quota_gpus"] == 2


def test_a_spec_number_is_never_true_or_a_string(api):
    r = api.post("a", {**SPEC, "priority": True, "max_restarts": "3"})
    assert r.status_code == 422 and _errors(r) == ["priority: expected a number, got bool True",
                                                   "max_restarts: expected a number, got str '3'"]
    assert api.post("a", {**SPEC, "gpus": 1.0}).status_code == 201  # 1.0 is an integer in JSON Schema


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_heartbeat_owned_by_another_uid_is_not_read(tmp_path):
    """With per-job uids a job could hard-link another job's heartbeat into its progress directory and
    look alive while hung; the plane reads a job's files only when its uid (or the plane's) owns them."""
    from tidal.contract import heartbeat_file
    from tidal.exec.progress import ProgressReader

    beat = tmp_path / heartbeat_file(0)
    beat.write_text(json.dumps({"time": 5.0, "phase": "train"}))
    os.chown(beat, 54321, 54321)
    assert ProgressReader(tmp_path, 1, owner=12345).read().heartbeats == 0
    assert ProgressReader(tmp_path, 1, owner=54321).read().heartbeat_s == 5.0


def test_checkpoint_quota_refuses_new_jobs_and_a_running_job_going_over_is_an_event(tmp_path):
    """A tenant's checkpoints could fill the plane's disk: with ``checkpoint_quota_bytes`` a submission
    while its local checkpoints hold the quota (as counted at most a ``QUOTA_CHECK_S`` ago) is refused
    naming the bytes, and the reconcile loop records one event when a running job takes its tenant over
    it. Bytes are blocks on disk: a sparse file of a GiB costs nothing, a link to a big file is not
    followed. Once the tenant removes checkpoints it is let in after ``QUOTA_RECHECK_S``."""
    import shutil

    from control_fakes import FakeExecutor
    from tidal.control.config import ControlConfig
    from tidal.control.controller import Controller
    from tidal.control.locations import QUOTA_CHECK_S, QUOTA_RECHECK_S

    api = Api(tmp_path, LocationPolicy(tmp_path / "tenants", quota_bytes={"a": 1 << 20}))
    try:
        job = api.post("a", SPEC).json()["id"]
        home = tmp_path / "jobs" / job / "ckpt"
        home.mkdir(parents=True)
        with open(home / "sparse", "wb") as f:
            f.truncate(1 << 30)
        (home / "link").symlink_to(tmp_path / "tidal.db")
        assert api.post("a", SPEC).status_code == 201
        config = ControlConfig(checkpoint_quota_bytes={"a": 1 << 20})
        ctl = Controller(api.store, FakeExecutor(gpus=4), config, ckpt_root=tmp_path / "jobs")
        ctl.step(0.0)
        (home / "step_1").write_bytes(os.urandom(2 << 20))
        ctl.step(1.0)  # counted once a QUOTA_CHECK_S
        assert not [e for e in api.store.events() if e.kind == "ckpt_quota"]
        ctl.step(QUOTA_CHECK_S)
        ctl.step(2 * QUOTA_CHECK_S)  # still over: no second event
        events = [e for e in api.store.events() if e.kind == "ckpt_quota"]
        assert len(events) == 1 and events[0].tenant == "a"
        assert "over its quota of 1048576" in events[0].message
        assert api.post("a", SPEC).status_code == 201  # (counted under its quota less than a minute ago)
        api.clock.advance(QUOTA_CHECK_S)
        r = api.post("a", SPEC)
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "checkpoint_quota"
        assert "its quota is 1048576 (checkpoint_quota_bytes" in _errors(r)[0]
        assert api.post("b", SPEC).status_code == 201 and api.post("admin", SPEC).status_code == 201
        shutil.rmtree(home)
        assert api.post("a", SPEC).status_code == 422  # (over: counted again only after a few seconds)
        api.clock.advance(QUOTA_RECHECK_S)
        assert api.post("a", SPEC).status_code == 201
    finally:
        api.store.close()


def test_a_tenants_checkpoint_bytes_are_counted_once_for_many_submissions(tmp_path):
    """Submissions of a tenant with a checkpoint quota do not each walk the homes of all its jobs: sixteen
    at once wait for one count; the next within ``QUOTA_CHECK_S`` counts nothing; a tenant without a quota
    is never counted; once at its quota the tenant is counted again after ``QUOTA_RECHECK_S``; a clock
    that went back counts again."""
    import threading

    from tidal.control.limits import QuotaMeter
    from tidal.control.locations import QUOTA_CHECK_S, QUOTA_RECHECK_S

    home = tmp_path / "home"
    home.mkdir()
    (home / "data").write_bytes(os.urandom(64 << 10))
    counts: list[str] = []
    gate = threading.Event()

    def homes(tenant: str):
        counts.append(tenant)
        gate.wait(5)  # (a slow walk: the others come while it runs)
        return [(tenant, str(home))]

    meter = QuotaMeter(homes, {"a": 1 << 20, "full": 1 << 10}.get)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(meter.used("a", 0.0))) for _ in range(16)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert counts == ["a"] and len(got) == 16 and len(set(got)) == 1 and got[0] >= 64 << 10
    assert meter.used("a", QUOTA_CHECK_S - 1) == got[0] and counts == ["a"]
    assert meter.used("a", QUOTA_CHECK_S) == got[0] and counts == ["a", "a"]
    assert meter.used("nobody", 0.0) == 0 and counts == ["a", "a"]  # (no quota: never counted)
    assert meter.used("full", 0.0) >= 1 << 10 and meter.used("full", QUOTA_RECHECK_S - 1) >= 1 << 10
    assert counts == ["a", "a", "full"]
    (home / "data").unlink()
    assert meter.used("full", QUOTA_RECHECK_S) == 0 and counts == ["a", "a", "full", "full"]
    assert meter.used("a", 1.0) == 0 and counts[-1] == "a"  # (the clock went back: counted again)

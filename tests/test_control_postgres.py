"""The control plane's store on a real PostgreSQL server (``--db postgresql+psycopg://...``).

A PostgreSQL 16 server from the ``pgserver`` wheel (binaries inside, no system install) is started
once for this module in a temporary directory, on a Unix socket, and stopped at the end. The same
controller and API tests that run on SQLite run here again, imported from their modules, each on
an emptied schema; plus what only a server shows: concurrent submissions from many threads.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa

import test_control_api as api_tests
import test_control_controller as ctl_tests
import test_store_submit as store_submit_tests
from control_fakes import FakeClock, FakeExecutor, submit
from tidal.control.auth import create_tenant
from tidal.control.controller import Controller
from tidal.control.store import Base, Store

with warnings.catch_warnings():  # platformdirs warns that XDG_RUNTIME_DIR is unset
    warnings.simplefilter("ignore")
    import pgserver


@pytest.fixture(scope="module")
def pg_server():
    # Not under pytest's /tmp/pytest-of-<user>: as root, pgserver runs initdb as its own user and opens
    # the path for it (chmod o+x up to /), and every pytest session that starts on the machine meanwhile
    # makes that directory 0700 again (initdb then fails: "Permission denied").
    base = Path(tempfile.mkdtemp(prefix="tidal-pg-"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            srv = pgserver.get_server(base / "pgdata", cleanup_mode="stop")
        try:
            yield srv.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
        finally:
            srv.cleanup()  # stops the server (pg_ctl stop), also when a test failed
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    engine = sa.create_engine(pg_server)
    try:
        Base.metadata.drop_all(engine)  # every test starts from an empty schema
    finally:
        engine.dispose()
    return pg_server


def pg_store(url: str, *tenants: tuple[str, int, float]) -> Store:
    store = Store(url)
    for name, quota, weight in tenants:
        create_tenant(store, name, quota_gpus=quota, weight=weight)
    return store


# -- the controller tests, on PostgreSQL ----------------------------------------------------------------
@pytest.fixture
def world(pg_url, tmp_path):
    store = pg_store(pg_url, ("prod", 4, 1.0), ("lab", 0, 1.0))
    ex = FakeExecutor(gpus=4)
    ctl = Controller(store, ex, ctl_tests.CFG, ckpt_root=tmp_path / "jobs")
    yield store, ex, ctl, FakeClock()
    store.close()


for _name in dir(ctl_tests):
    if _name.startswith("test_"):
        globals()[f"{_name}_pg"] = getattr(ctl_tests, _name)  # collected here, with this module's fixtures


# -- the API tests (auth, isolation matrix, 422s, logs, pool), on PostgreSQL -------------------------------
@pytest.fixture
def api(pg_url, tmp_path, monkeypatch):
    real = api_tests.Store
    monkeypatch.setattr(api_tests, "Store", lambda url: real(pg_url))
    gen = api_tests.api.__wrapped__(tmp_path)
    value = next(gen)
    assert value[2].url.startswith("postgresql")  # the store under test is the server's
    yield value
    gen.close()


for _name in dir(api_tests):
    if _name.startswith("test_"):
        globals()[f"{_name}_pg"] = getattr(api_tests, _name)


# -- only on a server ----------------------------------------------------------------------------------
def test_concurrent_submissions_get_unique_ids_and_one_event_each(pg_url):
    store = pg_store(pg_url, ("a", 0, 1.0), ("b", 0, 1.0))
    try:
        def one(i: int) -> str:
            return submit(store, "ab"[i % 2], 1000.0 + i, name="sweep", gpus=1)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(one, range(200)))
        assert len(set(ids)) == 200
        assert sorted(int(i.rsplit("-", 1)[1]) for i in ids) == list(range(1, 201))
        assert len(store.jobs(tenant="a")) == 100 and len(store.jobs()) == 200
        submitted = [e for e in store.events() if e.kind == "transition" and e.to_state == "pending"]
        assert sorted(e.job_id for e in submitted) == sorted(ids)
    finally:
        store.close()


@pytest.mark.parametrize("check", [store_submit_tests.check_submit_is_as_read,
                                   store_submit_tests.check_submissions_at_once_go_in_together,
                                   store_submit_tests.check_batch_events_in_order,
                                   store_submit_tests.check_batch_writes_of_held_rows,
                                   store_submit_tests.check_many_progress_documents,
                                   store_submit_tests.check_hostile_progress_documents,
                                   store_submit_tests.check_ckpt_locations_near],
                         ids=lambda f: f.__name__)
def test_the_stores_own_statements_pg(pg_url, check):
    """tests/test_store_submit.py on PostgreSQL: a submit's rows, a batch's events and held rows."""
    store = pg_store(pg_url, ("a", 0, 1.0))
    try:
        check(store)
    finally:
        store.close()


def test_observed_progress_is_committed_without_waiting_for_the_log_that_transaction_only(pg_url):
    """What the loop observed of running jobs (progress) is committed with ``synchronous_commit`` off for
    its transaction only: stored and read back, and every other transaction on the connection still waits
    for its log (a submit, a transition)."""
    store = pg_store(pg_url, ("a", 0, 1.0))
    try:
        seen: list[str] = []
        sa.event.listen(store.engine, "before_cursor_execute",
                        lambda _c, _cur, sql, *_: seen.append(sql))
        jid = submit(store, "a", 1.0, name="j")
        store.update_many({jid: {"progress": {"step": 7}, "last_ckpt_s": 3.0}}, mark=False, observed=True)
        assert sum("synchronous_commit TO OFF" in q for q in seen) == 1
        got = store.job(jid)
        assert (got.progress, got.last_ckpt_s) == ({"step": 7}, 3.0)
        store.update_many({jid: {"progress": {"step": 8}}}, mark=False)  # (not observed: waits)
        assert sum("synchronous_commit TO OFF" in q for q in seen) == 1
        for _ in range(3):  # (each pooled connection: the setting ended with its transaction)
            with store.engine.connect() as c:
                assert c.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
    finally:
        store.close()

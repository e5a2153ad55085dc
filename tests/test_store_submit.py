"""A submit's rows as the store writes them (its own statements, no ORM unit of work): the job returned is the
job a read gives, column for column; its event; nothing stored when the insert fails. Also run on PostgreSQL
(tests/test_control_postgres.py)."""

from __future__ import annotations

import threading
import time
from unittest import mock

import pytest
import sqlalchemy as sa

from control_fakes import new_store
from tidal.control.spec import parse_spec
from tidal.control.store import JobRow, Store


@pytest.fixture
def store(tmp_path):
    s = new_store(tmp_path, ("a", 0, 1.0))
    yield s
    s.close()


def check_submit_is_as_read(store: Store) -> None:
    spec = parse_spec({"name": "sweep", "command": ["python", "-c", "print('é')"],
                       "gpus": {"min": 2, "max": 4},
                       "env": {"A": "1"}, "checkpoint": {"interval_s": 60.0}}).model_dump()
    made = [store.submit("a", spec, 1000.25, ckpt_location=loc) for loc in (None, "/ckpt/a/x")]
    marks = store.take_changed()  # (the reconcile loop's rows: its own, as a read gives them too)
    for row in made:
        got, loops = store.job(row.id), marks[row.id]
        assert loops is not None and loops is not row
        for col in JobRow.__table__.columns:
            assert getattr(row, col.name) == getattr(got, col.name) == getattr(loops, col.name), col.name
        assert row.progress == got.progress == loops.progress == {}
        assert row.id == f"sweep-{row.seq}" and row.state == "pending" and row.placement == {}
    assert [m.seq for m in made] == [1, 2]
    with store.engine.connect() as c:  # the columns a submit leaves out are SQL NULL, as the ORM left them
        assert c.execute(sa.text("SELECT count(*) FROM jobs WHERE finished_s IS NULL AND handle IS NULL "
                                 "AND started_s IS NULL")).scalar() == 2
        assert c.execute(sa.text("SELECT value FROM meta WHERE key = 'job_seq'")).scalar() == "2"
    events = [e for e in store.events() if e.job_id == made[0].id]
    assert [(e.kind, e.from_state, e.to_state, e.message, e.data, e.tenant, e.time_s) for e in events] == [
        ("transition", None, "pending", "submitted", None, "a", 1000.25)]
    with pytest.raises(sa.exc.IntegrityError):  # (no such tenant: the job's insert fails)
        store.submit("nobody", spec, 1001.0)
    assert len(store.jobs()) == 2 and len(store.events(job_id="sweep-3")) == 0
    assert store.submit("a", spec, 1002.0).id == "sweep-3"  # (the failed submit's number not taken)


def test_a_submitted_job_is_as_a_read_of_the_store_gives_it(store):
    check_submit_is_as_read(store)


def submit_at_once(store: Store, tenants: list[str], spec: dict, meanwhile=None) -> dict[int, object]:
    """A submission from a thread per tenant listed, all waiting for the write lock held meanwhile (then
    ``meanwhile()``), then let in together: index -> the row, or what the submission raised."""
    got: dict[int, object] = {}

    def submit(i: int, tenant: str) -> None:
        try:
            got[i] = store.submit(tenant, spec, float(i))
        except BaseException as e:  # (an interrupt too, in the thread that stored the group)
            got[i] = e

    with store._lock:
        threads = [threading.Thread(target=submit, args=(i, t)) for i, t in enumerate(tenants)]
        for t in threads:
            t.start()
        while len(store._subs) < len(tenants):
            time.sleep(0.001)
        if meanwhile is not None:
            meanwhile()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and len(got) == len(tenants)
    return got


def check_submissions_at_once_go_in_together(store: Store) -> None:
    """Submissions of many threads at once are stored in one transaction (group commit), each with its own
    number and event; one that fails (an unknown tenant) fails alone: the others are stored, its number not
    taken, its caller gets the error."""
    spec = parse_spec({"name": "g", "command": ["true"], "gpus": 1}).model_dump()
    commits = []
    sa.event.listen(store.engine, "commit", lambda _: commits.append(1))
    for tenants in (["a"] * 24, ["a"] * 11 + ["nobody"] + ["a"] * 12):
        start = len(commits)
        got = submit_at_once(store, tenants, spec)  # (every submission waits, then they go in as a group)
        if "nobody" not in tenants:
            assert len(commits) - start == 1, "the submissions waiting together were not stored together"
        else:
            assert isinstance(got[11], sa.exc.IntegrityError)
        rows = [r for r in got.values() if isinstance(r, JobRow)]
        assert len(rows) == tenants.count("a")
        for r in rows:
            read = store.job(r.id)
            assert (read.seq, read.submit_s, read.tenant) == (r.seq, r.submit_s, "a") and r.id == f"g-{r.seq}"
            assert [e.to_state for e in store.events(job_id=r.id)] == ["pending"]
    seqs = sorted(j.seq for j in store.jobs())
    assert seqs == list(range(1, 48)), "numbers were skipped or taken twice"
    assert not store._subs and not store._leading
    assert store.submit("a", spec, 99.0).seq == 48  # (one alone, after the groups)


def test_submissions_at_once_go_in_together(store):
    check_submissions_at_once_go_in_together(store)


STORED = ["/ckpt/a", "/ckpt/a/", "/ckpt/a//", "/ckpt/a/b", "/ckpt/ab", "/ckpt/a_b", "/ckpt/a%b", "/ckpt/A/b",
          "/ckpt/a\\b/c", "/ckpt/a.b", "/ckpt/a b/c", "/ckpt/é/ü", "/", "s3://bkt/x", "s3://bkt/x//",
          "s3://bkt/x/y/z", "s3://bkt/xy", "s3://bkt/x_y", "peer://job/a", "/other/a"]


def check_ckpt_locations_near(store: Store) -> None:
    """The jobs whose checkpoint location overlaps one asked for, found through the index, are exactly those
    a look at every job's finds: names that only look alike in SQL (``_``, ``%``, case, a backslash, "/"s
    at the end) are not taken for one another."""
    from tidal.control.locations import overlaps

    spec = parse_spec({"name": "l", "command": ["true"], "gpus": {"min": 1, "max": 1}}).model_dump()
    for i, loc in enumerate(STORED):
        store.submit("a", spec, float(i), ckpt_location=loc)
    every = store.ckpt_locations()
    assert len(every) == len(STORED) and {loc for _, _, loc, _ in every} >= {"/ckpt/a/", "s3://bkt/x/"}
    for m in [*STORED, "/ckpt", "/ckpt/", "/ckpt/a/b/c/d", "s3://bkt", "/ckpt/a%", "/ckpt/a_", "/ckpt/a\\",
              "/ckpt/é", "peer://job", "/nothing/here"]:
        got = sorted(store.ckpt_locations([m]))
        assert got == sorted(r for r in every if overlaps(m, r[2])), m
    assert store.ckpt_locations([]) == []
    got = {loc for _, _, loc, _ in store.ckpt_locations(["/ckpt/a/b/c", "s3://bkt/x_y/z"])}
    assert got == {"/", "/ckpt/a", "/ckpt/a/", "/ckpt/a/b", "s3://bkt/x_y"}
    from tidal.control.spec import MAX_PATH_CHARS, MAX_TIERS

    # a hostile tenant's tiers at the spec's bounds: ~32,000 names above them, in one statement
    deep = ["/ckpt/a" + "/b" * 2000, *("s3://bkt/x" + "/" * (MAX_PATH_CHARS - 12) + str(k)
                                       for k in range(MAX_TIERS - 1))]
    assert all(len(m) <= MAX_PATH_CHARS for m in deep)
    got = sorted(store.ckpt_locations(deep))  # (thousands of names above each: bounded statements)
    assert got == sorted(r for r in every if any(overlaps(m, r[2]) for m in deep)) and len(got) > 3


def test_ckpt_locations_near_are_those_that_overlap(store):
    check_ckpt_locations_near(store)


def check_batch_events_in_order(store: Store) -> None:
    """A batch's events are written together at its commit: in the order recorded (ids ascending, loan
    documents' events among them), seen by its own thread before, by none after a rollback."""
    from tidal.control.states import State

    spec = parse_spec({"name": "ev", "command": ["true"], "gpus": 1}).model_dump()
    a, b = (store.submit("a", spec, 1.0) for _ in range(2))
    before = store.events()[-1].id
    seen: list[int] = []
    with store.batch():
        store.record("note", "first", 2.0, job=a)
        store.transition(a, State.CANCELLED, 3.0, "cancelled while pending", finished_s=3.0)
        store.put_doc("doc", {"x": 1}, 4.0, events=[("loan", "lent n1", {"gpus": 8})])
        store.record("note", "last", 5.0, tenant="a", data={"k": [1, 2]})
        mine = [e.message for e in store.events(after_id=before)]  # (its own thread: flushed to be seen)
        store.record("note", "after the read", 6.0, job=b)
        t = threading.Thread(target=lambda: seen.append(len(store.events(after_id=before))))
        t.start()
        t.join()
    assert mine == ["first", "cancelled while pending", "lent n1", "last"] and seen == [0]
    got = store.events(after_id=before)
    assert [(e.kind, e.job_id, e.tenant, e.from_state, e.to_state, e.message, e.data, e.time_s)
            for e in got] == [
        ("note", a.id, "a", None, None, "first", None, 2.0),
        ("transition", a.id, "a", "pending", "cancelled", "cancelled while pending", None, 3.0),
        ("loan", None, None, None, None, "lent n1", {"gpus": 8}, 4.0),
        ("note", None, "a", None, None, "last", {"k": [1, 2]}, 5.0),
        ("note", b.id, "a", None, None, "after the read", None, 6.0)]
    assert [e.id for e in got] == sorted(e.id for e in got)
    last = got[-1].id
    with pytest.raises(RuntimeError), store.batch():
        store.record("note", "rolled back", 7.0, job=b)
        store.transition(b, State.CANCELLED, 7.0, "cancelled while pending", finished_s=7.0)
        raise RuntimeError("a step failing midway")
    assert store.events(after_id=last) == [] and store.job(b.id).state == "pending"
    with store.batch():  # (the rolled-back batch's events are not written by the next one)
        store.record("note", "next", 8.0, job=b)
    assert [e.message for e in store.events(after_id=last)] == ["next"]


def test_a_batch_writes_its_events_at_its_commit_in_order(store):
    check_batch_events_in_order(store)


def check_batch_writes_of_held_rows(store: Store) -> None:
    """A batch's writes of rows its thread holds run together (one statement per SQL) at its next read, other
    write or commit: each job's writes in order, its thread's reads see them, other threads see them once
    committed; a write that finds its job moved by another writer meanwhile rolls the batch back."""
    from tidal.control.states import State
    from tidal.control.store import StoreConflict

    spec = parse_spec({"name": "held", "command": ["true"], "gpus": 1}).model_dump()
    a, b, c = (store.submit("a", spec, 1.0) for _ in range(3))
    seen: list[str] = []
    store.update_many({a.id: {"progress": {"step": 5}}, b.id: {"progress": {"step": 6}}})  # (attempts before)
    with store.batch():
        store.transition(a, State.ADMITTED, 2.0, "admitted", placement={"n1": 1}, progress={})
        store.update(a, handle={"pid": 7})  # the same job again: the first write runs first
        store.transition(a, State.RUNNING, 3.0, "running")
        store.transition(b, State.ADMITTED, 2.0, "admitted", placement={"n2": 1}, progress={"step": 0})
        store.update(b, nominated_s=2.5)
        assert store.job(b.id).progress == {"step": 0}  # (deferred with its row's write, read in order)
        store.update(b, progress={"step": 1})  # (written now: what waits runs first)
        t = threading.Thread(target=lambda: seen.append(store.job(a.id).state))
        t.start()
        t.join()
        assert store.job(b.id).nominated_s == 2.5  # (its own thread reads its writes)
    assert seen == ["pending"]
    got_a, got_b = store.job(a.id), store.job(b.id)
    assert (got_a.state, got_a.placement, got_a.handle, got_a.message) == ("running", {"n1": 1}, {"pid": 7},
                                                                           "running")
    assert (got_b.state, got_b.placement, got_b.nominated_s) == ("admitted", {"n2": 1}, 2.5)
    assert (got_a.progress, got_b.progress) == ({}, {"step": 1})
    assert [e.to_state for e in store.events(job_id=a.id)] == ["pending", "admitted", "running"]
    stale = store.job(c.id)  # another writer moves c under a row held here
    store.transition(c.id, State.CANCELLED, 4.0, "cancelled while pending", finished_s=4.0)
    before = store.events()[-1].id
    with pytest.raises(StoreConflict, match="1 of 2 writes"), store.batch():
        store.update(got_b, nominated_s=9.0)
        store.transition(stale, State.ADMITTED, 5.0, "admitted", placement={"n3": 1})
    assert store.job(c.id).state == "cancelled" and store.job(b.id).nominated_s == 2.5  # all rolled back
    assert store.events(after_id=before) == []


def test_a_batch_runs_its_writes_of_held_rows_together(store):
    check_batch_writes_of_held_rows(store)


def check_many_progress_documents(store: Store) -> None:
    """Progress of many jobs at once (PostgreSQL copies them in: COPY_PROGRESS_MIN), twice in one batch: each
    job's newest document stored, a non-finite number as null, the others untouched."""
    from tidal.control.store import COPY_PROGRESS_MIN

    spec = parse_spec({"name": "p", "command": ["true"], "gpus": 1}).model_dump()
    jobs = [store.submit("a", spec, 1.0).id for _ in range(COPY_PROGRESS_MIN + 2)]
    with store.batch():
        store.update_many({j: {"progress": {"step": 1, "loss": 0.5}} for j in jobs[:-1]}, mark=False)
        store.update_many({j: {"progress": {"step": 2, "loss": float("nan") if i == 0 else 0.25}}
                           for i, j in enumerate(jobs[1:])}, mark=False)
    got = {r.id: r.progress for r in store.jobs_by_id(jobs)}
    assert got[jobs[0]] == {"step": 1, "loss": 0.5}
    assert got[jobs[1]] == {"step": 2, "loss": None}
    assert all(got[j] == {"step": 2, "loss": 0.25} for j in jobs[2:])


def test_many_progress_documents_at_once(store):
    check_many_progress_documents(store)


def check_hostile_progress_documents(store: Store) -> None:
    """A job's progress with what its own code may put in it (NUL, tabs, backslashes, newlines in strings
    and keys, infinities, a huge step) is stored as it is, the non-finite as null, whether many jobs'
    documents are copied in at once (PostgreSQL's COPY) or written one by one."""
    from tidal.control.store import COPY_PROGRESS_MIN

    spec = parse_spec({"name": "h", "command": ["true"], "gpus": 1}).model_dump()
    jobs = [store.submit("a", spec, 1.0).id for _ in range(COPY_PROGRESS_MIN + 1)]
    evil = {"phase": "x\x00y\t\\N\n\r", "tiers": {"k\\.\t\x00": [1, float("inf")]}, "loss": float("-inf"),
            "step": 2**62}
    stored = {**evil, "tiers": {"k\\.\t\x00": [1, None]}, "loss": None}
    for few in (jobs, jobs[:1]):
        with store.batch():
            store.update_many({j: {"progress": {**evil, "n": len(few)}} for j in few}, mark=False)
        got = {r.id: r.progress for r in store.jobs_by_id(few)}
        assert got == {j: {**stored, "n": len(few)} for j in few}


def test_hostile_progress_documents(store):
    check_hostile_progress_documents(store)


def test_a_batch_holds_the_write_lock_only_while_its_transaction_is_open(store):
    """A batch that has only read lets other threads write; one with a transaction open commits at its next
    write once another thread waits to write (here at once: BATCH_HOLD_S 0), so the waiter goes in before the
    batch ends; both writes stored."""
    spec = parse_spec({"name": "w", "command": ["true"], "gpus": 1}).model_dump()
    first = store.submit("a", spec, 1.0)
    done = threading.Event()

    def submit_one() -> None:
        store.submit("a", spec, 2.0)
        done.set()

    with store.batch():
        store.jobs()  # (a read: no lock taken)
        t = threading.Thread(target=submit_one)
        t.start()
        assert done.wait(30), "a batch that only read held the write lock"
        t.join()
        store.update(first.id, message="one")  # the batch's transaction opens: the lock is held until commit
        t = threading.Thread(target=submit_one)
        done.clear()
        t.start()
        while not store._waiters:  # (the submit waits for the batch's lock)
            time.sleep(0.001)
        with mock.patch("tidal.control.store.BATCH_HOLD_S", 0.0):
            store.update(first.id, message="two")  # commits: the waiting submit goes in now
        assert done.wait(30), "the batch kept its transaction open while a writer waited"
        t.join()
    assert [j.message for j in store.jobs()] == ["two", "", ""]


def test_a_transition_and_an_update_leave_the_row_as_a_read_gives_it_and_refuse_what_is_no_column(store):
    from tidal.control.states import State

    spec = parse_spec({"name": "t", "command": ["true"], "gpus": {"min": 2, "max": 2}}).model_dump()
    row = store.job(store.submit("a", spec, 1.0).id)
    store.transition(row, State.ADMITTED, 2.0, "admitted", data={"why": ["n1"], "gpus": 2},
                     placement={"n1": 2}, attempt=1, killed=False, handle=None)
    store.update(row, releasing={"n1": 1}, last_ckpt_s=3.5, cancel_requested=True)
    got = store.job(row.id)
    for col in JobRow.__table__.columns:
        assert getattr(row, col.name) == getattr(got, col.name), col.name
    ev = store.events(job_id=row.id)[-1]
    assert (ev.kind, ev.from_state, ev.to_state, ev.data, ev.tenant) == (
        "transition", "pending", "admitted", {"why": ["n1"], "gpus": 2}, "a")
    with pytest.raises(ValueError, match=r"no such column of jobs: \['bogus'\]"):
        store.update(row, bogus=1)
    with pytest.raises(ValueError, match=r"no such column of jobs: \['state; --'\]"):
        store.transition(row, State.RUNNING, 4.0, "running", **{"state; --": 1})
    assert store.job(row.id).state == "admitted" and len(store.events(job_id=row.id)) == 2


def test_a_group_interrupted_fails_each_of_its_submissions_and_the_next_goes_in(store, monkeypatch):
    """An interrupt while a group is stored (here in its insert) leaves nothing stored: the thread storing it
    raises it, every other submission of the group fails with the store unavailable (503), none waits on, and
    the next submission is stored."""
    spec = parse_spec({"name": "i", "command": ["true"], "gpus": 1}).model_dump()
    insert = store._insert_jobs

    def interrupted(s, rows):
        if len(rows) > 1:
            raise KeyboardInterrupt
        return insert(s, rows)

    monkeypatch.setattr(store, "_insert_jobs", interrupted)
    got = submit_at_once(store, ["a"] * 5, spec)
    kinds = sorted(type(e).__name__ for e in got.values())
    assert kinds == ["KeyboardInterrupt"] + ["StoreUnavailable"] * 4, kinds
    assert store.jobs() == [] and not store._leading and not store._subs
    assert store.submit("a", spec, 9.0).seq == 1  # (the group's numbers not taken)


def test_submissions_waiting_while_the_file_is_deleted_are_refused_not_lost(tmp_path):
    """The database file deleted while submissions wait for the write lock: each is refused with the store
    unavailable (503), none is answered as stored into the deleted file, and none waits on."""
    import os

    from tidal.control.store import StoreUnavailable

    store = new_store(tmp_path, ("a", 0, 1.0))
    try:
        spec = parse_spec({"name": "d", "command": ["true"], "gpus": 1}).model_dump()
        store.submit("a", spec, 0.0)
        got = submit_at_once(store, ["a"] * 6, spec, meanwhile=lambda: os.unlink(tmp_path / "tidal.db"))
        assert all(isinstance(e, StoreUnavailable) for e in got.values()) and len(got) == 6, got
        assert not store._leading and not store._subs
    finally:
        store.close()

"""The job state machine table, and the store's use of it (checked transitions, one event each)."""

from __future__ import annotations

import itertools

import pytest

from control_fakes import new_store, submit
from tidal.control.states import (
    HELD,
    STOPPING,
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    State,
    check_transition,
)
from tidal.exec.protocol import EXIT_PREEMPTED

S = State


def test_every_state_has_a_row_and_terminal_states_have_no_exit():
    assert set(TRANSITIONS) == set(State)
    assert {S.SUCCEEDED, S.FAILED, S.CANCELLED} == TERMINAL
    for s in TERMINAL:
        assert not TRANSITIONS[s]
    assert STOPPING <= HELD and S.PENDING not in HELD and S.BACKOFF not in HELD


def test_every_state_is_reachable_from_pending_and_can_end():
    seen, todo = {S.PENDING}, [S.PENDING]
    while todo:
        for n in TRANSITIONS[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    assert seen == set(State)
    for s in State:  # from every state some terminal state is reachable
        reach, todo = {s}, [s]
        while todo:
            for n in TRANSITIONS[todo.pop()]:
                if n not in reach:
                    reach.add(n)
                    todo.append(n)
        assert reach & TERMINAL, s


@pytest.mark.parametrize(("old", "new"), [
    ("pending", "admitted"), ("admitted", "running"), ("running", "preempting"), ("preempting", "pending"),
    ("running", "resizing"), ("resizing", "admitted"), ("running", "backoff"), ("backoff", "pending"),
    ("running", "failed"), ("running", "succeeded"), ("running", "cancelling"), ("cancelling", "cancelled"),
    ("pending", "cancelled"), ("running", "pending"),
])
def test_legal(old, new):
    check_transition("j", old, new)


def test_everything_else_is_illegal():
    legal = {(a, b) for a, nxt in TRANSITIONS.items() for b in nxt}
    for a, b in itertools.product(State, State):
        if (a, b) not in legal:
            with pytest.raises(IllegalTransition):
                check_transition("j", a, b)
    with pytest.raises(
        IllegalTransition, match=r"pending -> running \(from pending: \['admitted', 'cancelled'\]\)"
    ):
        check_transition("j-1", "pending", "running")
    with pytest.raises(IllegalTransition):
        check_transition("j", "pending", "exploded")


def test_store_records_every_transition_as_an_event(tmp_path):
    store = new_store(tmp_path, ("lab", 0, 1.0))
    j = submit(store, "lab", 10.0, name="a")
    store.transition(j, S.ADMITTED, 11.0, "admitted", placement={"n0": 1}, attempt=1)
    store.transition(j, S.RUNNING, 12.0, "up")
    with pytest.raises(IllegalTransition):
        store.transition(j, S.ADMITTED, 13.0, "again")
    store.transition(j, S.SUCCEEDED, 14.0, "done", placement={})
    evs = [(e.time_s, e.from_state, e.to_state, e.message) for e in store.events(job_id=j)]
    assert evs == [(10.0, None, "pending", "submitted"), (11.0, "pending", "admitted", "admitted"),
                   (12.0, "admitted", "running", "up"), (14.0, "running", "succeeded", "done")]
    with pytest.raises(ValueError, match="Store.transition"):
        store.update(j, state="running")
    store.close()


def test_exit_code_matches_the_runtime():
    from tidal.train.env import EXIT_PREEMPTED as RUNTIME

    assert EXIT_PREEMPTED == RUNTIME


def test_store_migrates_an_older_database_and_refuses_a_newer_one(tmp_path):
    """A database made by an older schema (no ``jobs.nominated_s``, progress a column of jobs, a
    ``jobs.waiting`` column) opens and keeps its jobs; one from a newer tidal is refused with a message
    naming the versions."""
    import sqlite3

    from tidal.control.store import SCHEMA_VERSION, Store

    store = new_store(tmp_path, ("lab", 0, 1.0))
    j = submit(store, "lab", 10.0, name="a")
    store.close()
    db = sqlite3.connect(tmp_path / "tidal.db")
    db.execute("ALTER TABLE jobs DROP COLUMN nominated_s")
    db.execute("DROP TABLE progress")  # (progress was a column of jobs)
    db.execute("DROP INDEX ix_jobs_state_tenant_kind")
    db.execute("ALTER TABLE jobs ADD COLUMN progress JSON")
    db.execute("""UPDATE jobs SET progress = '{"step": 7}'""")
    db.execute("ALTER TABLE jobs ADD COLUMN waiting JSON")  # (schemas 5 and 6)
    db.execute("""UPDATE jobs SET waiting = '{"reason": "stale", "until_s": null}'""")
    db.execute("UPDATE jobs SET ckpt_location = 's3://b/x//'")  # (recorded as given before schema 7)
    db.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    assert store.job(j).nominated_s is None and store.job(j).state == "pending"
    assert store.job(j).progress == {"step": 7}  # moved to its own table, the column gone
    assert store.job(j).ckpt_location == "s3://b/x/" and store.ckpt_locations(["s3://b/x/y"])[0][0] == j
    with store.engine.connect() as c:
        assert not {"progress", "waiting"} & {r[1] for r in c.exec_driver_sql("PRAGMA table_info(jobs)")}
        assert "ix_jobs_state_tenant_kind" in {r[1] for r in c.exec_driver_sql("PRAGMA index_list(jobs)")}
    store.update(j, nominated_s=20.0)
    assert store.job(j).nominated_s == 20.0
    store.close()
    db = sqlite3.connect(tmp_path / "tidal.db")
    assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        str(SCHEMA_VERSION),
    )
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(ValueError, match=rf"schema version {SCHEMA_VERSION + 1}, newer than this tidal's"):
        Store(f"sqlite:///{tmp_path}/tidal.db")

"""The pool reads and ``/metrics`` served from the view the reconcile loop publishes after each step
(``tidal.control.read_view``): after every step they answer what the same reads of the store answer at that
moment; a job submitted since is counted at once; a view once served does not change; a failed step
withdraws it (the reads go back to the store)."""

from __future__ import annotations

import json
import warnings

import pytest

with warnings.catch_warnings():  # starlette 1.x suggests another httpx package for its test client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from control_fakes import FakeClock, FakeExecutor, new_store, submit
from tidal.control.api import ApiContext, create_app
from tidal.control.auth import create_tenant, ensure_admin
from tidal.control.controller import Controller
from tidal.control.states import State

SPEC = {"name": "burst", "command": ["python", "train.py"], "gpus": {"min": 1, "max": 2}}


@pytest.fixture
def plane(tmp_path):
    """A controller that publishes, over 3 nodes (8, 4 and 4 GPUs), tenants a (quota 4) and b, and two
    apps on its store: one serving the published view (as ``tidal up``), one reading the store."""
    clock = FakeClock()
    store = new_store(tmp_path)
    admin, _ = ensure_admin(store, tmp_path, 0.0)
    tokens = {"admin": admin, "a": create_tenant(store, "a", quota_gpus=4), "b": create_tenant(store, "b")}
    ex = FakeExecutor(gpus=8, more={"m1": 4, "m2": 4})
    ctl = Controller(store, ex, publish=True)

    def app(view):
        return TestClient(create_app(ApiContext(store, ctl.nodes, ex.log_path, clock, view=view)))

    served, stored = app(ctl.published), app(None)

    def get(http, who: str, path: str, **params):
        r = http.get(path, params=params, headers={"Authorization": f"Bearer {tokens[who]}"})
        assert r.status_code == 200, r.text
        return r.text if path == "/metrics" else r.json()

    yield clock, store, ex, ctl, served, stored, get, tokens
    store.close()


READS = [("admin", "/v1/pool", {}), ("a", "/v1/pool", {}), ("b", "/v1/pool", {"offset": 1, "limit": 1}),
         ("admin", "/v1/dashboard/pool", {}), ("a", "/v1/dashboard/pool", {}),
         ("b", "/v1/dashboard/pool", {}), ("admin", "/metrics", {})]


def _same(got, want, path: str, view=None):
    """``got`` served from ``view`` is ``want`` read from the store, but for why a job waits: the queue's job
    that the scheduler gave a reason at the step shows that reason (the store has none: it is the loop's)."""
    shown = 0  # reasons the store has not
    if path == "/metrics":  # the view's time is a series of its own; the rest as read from the store
        got = "\n".join(x for x in got.splitlines() if "tidal_plane_view_time_seconds" not in x)
        assert got == want.rstrip("\n")
        return shown
    if path == "/v1/dashboard/pool":
        assert isinstance(got.pop("step"), int) and want.pop("step") is None
        told = {j.id: j.waiting for j in view.head if j.waiting is not None} if view is not None else {}
        for row, stored_row in zip(got["queue"]["jobs"], want["queue"]["jobs"], strict=False):
            if row["job"] in told and row["state"] == "pending" and row["why"] != stored_row["why"]:
                assert row["why"] == told[row["job"]].reason
                stored_row["why"] = row["why"]
                shown += 1
    assert got == want
    return shown


def test_every_read_after_each_step_is_what_the_store_says(plane):
    clock, store, ex, ctl, served, stored, get, _ = plane
    ids = [submit(store, "a", clock.advance(1.0), name=f"a{i}", gpus={"min": 2, "max": 4, "multiple_of": 2})
           for i in range(4)]
    ids += [submit(store, t, clock.advance(1.0), name=f"{t}{i}", gpus=g, kind=k, priority=p)
            for i, (t, g, k, p) in enumerate([("b", 4, "spot", 0), ("a", 4, "dedicated", 0),
                                               ("b", 8, "spot", 0), ("b", 1, "spot", 0),
                                               ("a", 2, "dedicated", 0)])]
    seen_running = seen_ended = seen_waiting = False
    told = 0
    for k in range(12):
        ctl.step(clock.advance(10.0))
        assert ctl.published.view is not None and ctl.published.view.step == k + 1
        assert ctl.published.view.as_of_s == clock()
        for who, path, params in READS:
            told += _same(get(served, who, path, **params), get(stored, who, path, **params), path,
                          ctl.published.view)
        counts = store.count_by_state()
        for t in ("a", "b"):  # (what a tenant's queue cap reads: the view's, as the store counts it)
            assert ctl.published.view.pending(t, store.submitted) == store.count_by_state(t, ["pending"]).get(
                "pending", 0)
        seen_running |= counts.get("running", 0) > 0
        seen_waiting |= counts.get("pending", 0) > 0
        seen_ended |= counts.get("succeeded", 0) + counts.get("failed", 0) > 0
        # the world moves between steps: ranks beat, checkpoint, end, fail; more jobs arrive
        for jid, job in list(ex.jobs.items()):
            if all(c is None for c in job.codes):
                ex.beat(jid, clock() + 5.0, 10 * k + 1, tiers={"disk": (10 * k, clock())})
        if k in (3, 6):
            ex.exit(next(iter(ex.jobs)), 0)
        if k == 5:
            ex.exit(list(ex.jobs)[-1], 1)
        if k == 4:
            submit(store, "b", clock(), name="late", gpus=2, priority=0)
    assert seen_running and seen_ended and seen_waiting and told
    view = get(served, "admin", "/v1/pool")
    assert view["allocated"] > 0 and view["as_of_s"] == clock()
    dash = get(served, "admin", "/v1/dashboard/pool")
    assert dash["states"]["running"] > 0 and dash["queue"]["jobs"]
    assert ids[0] not in json.dumps(dash)  # (ended)


def test_a_job_submitted_is_counted_before_the_next_step(plane):
    clock, store, ex, ctl, served, stored, get, tokens = plane
    submit(store, "a", clock(), name="first", gpus=16)  # holds the whole pool: the jobs below wait
    ctl.step(clock.advance(1.0))
    assert get(served, "a", "/v1/pool")["pending"] == 0
    r = served.post("/v1/jobs", json={**SPEC, "gpus": 16}, headers={"Authorization": f"Bearer {tokens['a']}"})
    assert r.status_code == 201
    r = served.post("/v1/jobs", json={**SPEC, "gpus": 16}, headers={"Authorization": f"Bearer {tokens['b']}"})
    assert r.status_code == 201
    assert get(served, "a", "/v1/pool")["pending"] == 1 and get(served, "b", "/v1/pool")["pending"] == 1
    assert get(served, "admin", "/v1/pool")["pending"] == 2
    assert [ctl.published.view.pending(t, store.submitted) for t in ("a", "b")] == [1, 1]  # (before a step)
    dash = get(served, "admin", "/v1/dashboard/pool")
    assert dash["queue"]["total"] == 2 and dash["states"] == {"admitted": 1, "pending": 2}
    assert {t["tenant"]: t["waiting"] for t in dash["tenants"]} == {"a": 1, "b": 1}
    assert get(served, "b", "/v1/dashboard/pool")["states"] == {"pending": 1}
    assert 'tidal_jobs{state="pending"} 2.0' in get(served, "admin", "/metrics")
    for who, path, params in READS:  # the counts are the store's; the queue shown gains them at the next step
        got, want = get(served, who, path, **params), get(stored, who, path, **params)
        if path == "/v1/dashboard/pool":
            assert got["queue"]["total"] == want["queue"]["total"] == 2
            assert got["queue"]["jobs"] == [] and len(want["queue"]["jobs"]) == 2
            got["queue"] = want["queue"]
        _same(got, want, path, ctl.published.view)
    ctl.step(clock.advance(1.0))
    for who, path, params in READS:
        _same(get(served, who, path, **params), get(stored, who, path, **params), path, ctl.published.view)


def test_a_view_once_served_does_not_change(plane):
    clock, store, ex, ctl, served, _, get, _ = plane
    ids = [submit(store, "a", clock(), name=f"j{i}", gpus=4) for i in range(3)]
    ctl.step(clock.advance(1.0))
    view = ctl.published.view
    pool, text = get(served, "admin", "/v1/pool"), get(served, "admin", "/metrics")
    held = {j.id: dict(j.placement) for j in view.held}
    assert held and all(held.values())
    for jid in held:  # the loop's own rows change in place at the next steps: not the view's copies
        ex.exit(jid, 0)
    ctl.step(clock.advance(1.0))
    ctl.step(clock.advance(1.0))
    assert ctl.published.view is not view and ctl.published.view.step == view.step + 2
    assert {j.id: dict(j.placement) for j in view.held} == held
    assert get(served, "admin", "/v1/pool") != pool and get(served, "admin", "/metrics") != text
    assert {j.id for j in ctl.published.view.held}.isdisjoint(held)
    assert store.job(ids[0]).state == State.SUCCEEDED


def test_a_failed_step_withdraws_the_view(plane):
    clock, store, ex, ctl, served, stored, get, _ = plane
    submit(store, "a", clock(), name="x", gpus=2)
    ctl.step(clock.advance(1.0))
    assert ctl.published.view is not None

    def broken(now_s):
        raise RuntimeError("the executor is gone")

    ex.observe = broken
    with pytest.raises(RuntimeError):
        ctl.step(clock.advance(1.0))
    assert ctl.published.view is None
    got = get(served, "admin", "/v1/dashboard/pool")
    assert got["step"] is None and got == get(stored, "admin", "/v1/dashboard/pool")
    store.transition(store.jobs()[0].id, State.CANCELLING, clock(), "x")  # the store's, read at once
    holders = [h["state"] for n in get(served, "admin", "/v1/pool")["nodes"] for h in n["jobs"]]
    assert holders == ["cancelling"]


def test_the_parts_asked_for_at_every_step_are_built_by_the_loop(plane):
    clock, store, ex, ctl, served, stored, get, _ = plane
    submit(store, "a", clock(), name="x", gpus=2)
    ctl.step(clock.advance(1.0))
    ctl.published.warm()
    assert ctl.published.view._memo == {}  # nothing asked for: nothing built
    get(served, "admin", "/v1/pool")
    get(served, "a", "/v1/dashboard/pool")
    get(served, "admin", "/metrics")
    asked = {("pool", None, 0, 512), ("gpu_map", "a"), ("metrics", "pool"), ("metrics", "jobs")}
    assert asked <= ctl.published.view._memo.keys()
    ctl.step(clock.advance(1.0))
    new = ctl.published.view
    assert new._memo == {}
    ctl.published.warm()  # (the loop, between steps)
    assert new._memo.keys() == asked
    for who, path, params in READS:  # what was built is what a reader builds
        _same(get(served, who, path, **params), get(stored, who, path, **params), path, ctl.published.view)
    asked = set(ctl.published.wanted)
    assert len(asked) == 8  # (with the pages and maps of a and b)
    ctl.step(clock.advance(1.0))
    ctl.published.warm()  # asked of the view before (built by the loop, then read): built again
    assert ctl.published.view._memo.keys() == asked
    ctl.step(clock.advance(1.0))
    ctl.published.warm()  # not asked of the view before: forgotten, not built
    assert ctl.published.view._memo == {} and ctl.published.wanted == {}


def test_the_loop_builds_a_bounded_number_of_parts(plane):
    from tidal.control.read_view import WARM_MAX

    clock, store, ex, ctl, served, _, get, _ = plane
    ctl.step(clock.advance(1.0))
    for offset in range(WARM_MAX + 5):  # as many pages: the loop builds the latest asked, readers the rest
        get(served, "admin", "/v1/pool", offset=offset % 3, limit=1 + offset)
    ctl.step(clock.advance(1.0))
    ctl.published.warm()
    built = set(ctl.published.view._memo)
    assert built == {("pool", None, o % 3, 1 + o) for o in range(5, WARM_MAX + 5)}


def test_ended_jobs_dropped_by_retention_leave_the_views_counts(tmp_path):
    from tidal.control.config import ControlConfig

    clock = FakeClock()
    store = new_store(tmp_path, ("a", 0, 1.0))
    old = [submit(store, "a", clock(), name="old", gpus=1) for _ in range(3)]
    for jid in old:
        store.transition(jid, State.CANCELLED, clock(), "cancelled while pending", finished_s=clock())
    ctl = Controller(store, FakeExecutor(gpus=2), ControlConfig(retention_s=3600.0), publish=True)
    ctl.step(clock.advance(10.0))
    assert ctl.published.view.ended == {"cancelled": 3} == store.count_by_state(states=["cancelled"])
    ctl.step(clock.advance(4000.0))  # past retention: the three are dropped, no job ended meanwhile
    assert store.count_by_state() == {} and ctl.published.view.ended == {}


def test_a_tenants_queue_cap_counts_from_the_view_and_what_was_submitted_since(plane):
    """With the loop's view, a tenant's waiting jobs are counted from it (no query) with those submitted since
    the step: the cap refuses the submission over it with 429 and stores nothing, before and after a step."""
    from tidal.control.limits import SubmitLimits

    clock, store, ex, ctl, _, _, _, tokens = plane
    capped = TestClient(create_app(ApiContext(store, ctl.nodes, ex.log_path, clock, view=ctl.published,
                                              limits=SubmitLimits(max_queued=2))))
    submit(store, "b", clock(), name="first", gpus=16)  # holds the whole pool: the jobs below wait
    ctl.step(clock.advance(1.0))

    def post() -> int:
        return capped.post("/v1/jobs", json={**SPEC, "gpus": 16},
                           headers={"Authorization": f"Bearer {tokens['a']}"}).status_code

    assert [post(), post(), post()] == [201, 201, 429]  # (two submitted since the step: counted)
    ctl.step(clock.advance(1.0))
    assert post() == 429 and ctl.published.view.pending("a", store.submitted) == 2
    assert store.count_by_state("a") == {"pending": 2}

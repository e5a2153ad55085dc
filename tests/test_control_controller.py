"""The reconcile loop stepped with a fake clock and a fake executor (our own seam): decisions,
transitions and events, one step at a time."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from control_fakes import FakeClock, FakeExecutor, new_store, submit
from tidal.control import metrics
from tidal.control.accounting import job_report
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.states import State
from tidal.model import Admit, Grow, Preempt, Shrink
from tidal.policy.ckpt_interval import CkptIntervalConfig
from tidal.policy.scheduler import SchedulerConfig

CFG = ControlConfig(scheduler=SchedulerConfig(min_runtime_before_preempt_s=0, preempt_grace_s=60),
                    restart_backoff_s=10, max_backoff_s=100, hang_timeout_s=60, hang_step_times=10,
                    startup_timeout_s=120, kill_slack_s=5)


@pytest.fixture
def world(tmp_path):
    store = new_store(tmp_path, ("prod", 4, 1.0), ("lab", 0, 1.0))
    ex = FakeExecutor(gpus=4)
    ctl = Controller(store, ex, CFG, ckpt_root=tmp_path / "jobs")
    yield store, ex, ctl, FakeClock()
    store.close()


def transitions(store, job_id):
    return [(e.from_state, e.to_state) for e in store.events(job_id=job_id) if e.kind == "transition"]


def state(store, job_id) -> str:
    return store.job(job_id).state


def test_admit_run_succeed(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="a", gpus=2)
    assert ctl.step(clock()) == [Admit(j, {"n0": 2})]
    assert state(store, j) == "admitted" and ex.launches() == [("launch", j, 1, 2)]
    env = ex.jobs[j].req.env
    assert env["TIDAL_CKPT_URL"].endswith(f"jobs/{j}/ckpt") and env["TIDAL_GRACE_S"] == "30"
    assert ctl.step(clock.advance(1)) == []
    assert state(store, j) == "running"
    ex.beat(j, clock.advance(1), step=5)
    ctl.step(clock())
    assert store.job(j).progress["step"] == 5
    ex.exit(j, 0)
    ctl.step(clock.advance(1))
    assert transitions(store, j) == [(None, "pending"), ("pending", "admitted"), ("admitted", "running"),
                                     ("running", "succeeded")]
    assert ("release", j) in ex.calls and store.job(j).placement == {}


def test_ranks_that_abort_after_a_clean_close_have_finished(world):
    """torch 2.13 + gloo: a finished rank may die of SIGABRT in teardown (exit -6) after its end record."""
    store, ex, ctl, clock = world
    ok = submit(store, "lab", clock(), name="ok", gpus=2)
    bad = submit(store, "lab", clock(), name="bad", gpus=2)
    ctl.step(clock())
    ctl.step(clock.advance(1))
    ex.jobs[ok].ended = {0, 1}
    ex.exit(ok, -6)
    ex.exit(bad, -6)  # no clean close: a failure (restarted)
    ctl.step(clock.advance(1))
    assert state(store, ok) == "succeeded" and "teardown" in store.events(job_id=ok)[-1].message
    assert state(store, bad) == "backoff"


def test_preempted_for_quota_exit_75_is_not_a_failure(world):
    store, ex, ctl, clock = world
    spot = submit(store, "lab", clock(), name="sweep", gpus=4, max_restarts=0)
    ctl.step(clock())
    ctl.step(clock.advance(1))
    ex.beat(spot, clock(), step=3)
    ded = submit(store, "prod", clock.advance(1), name="pretrain", kind="dedicated", gpus=2)
    decisions = ctl.step(clock())
    assert decisions == [Preempt(spot, "quota", clock() + 60, ded)]
    assert state(store, spot) == "preempting" and ("stop", spot) in ex.calls
    assert store.job(ded).nominated_s == clock()  # the GPUs being freed are for it
    assert ctl.snapshot(clock()).queues[("prod", "dedicated", 0)][0].nominated_s == clock()
    assert ctl.step(clock.advance(1)) == []  # draining: the need is not acted on twice
    ex.exit(spot, 75)
    assert ctl.step(clock.advance(1)) == [Admit(ded, {"n0": 2})]
    assert store.job(ded).nominated_s is None  # admitted: the nomination is spent
    job = store.job(spot)
    assert job.state == "pending" and job.restarts == 0 and job.preemptions == 1
    ex.exit(ded, 0)
    ctl.step(clock.advance(1))  # the dedicated job ends: the spot job comes back, attempt 2
    assert state(store, spot) == "admitted" and ex.launches(spot)[-1] == ("launch", spot, 2, 4)
    assert ("preempting", "pending") in transitions(store, spot)


def test_failure_restarts_with_backoff_up_to_max_restarts(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="flaky", max_restarts=2)
    ctl.step(clock())
    ex.exit(j, 3)
    ctl.step(clock.advance(1))
    job = store.job(j)
    assert job.state == "backoff" and job.restarts == 1 and job.retry_at_s == clock() + 10
    assert "rank 0 exited with code 3; restart 1/2 in 10 s" in job.message
    assert ctl.step(clock.advance(5)) == [] and state(store, j) == "backoff"
    assert ctl.step(clock.advance(5)) == [Admit(j, {"n0": 1})]  # retry time reached: pending, admitted
    ex.exit(j, 1)
    ctl.step(clock.advance(1))
    assert store.job(j).retry_at_s == clock() + 20  # doubled
    ctl.step(clock.advance(20))
    ex.exit(j, -11)
    ctl.step(clock.advance(1))
    job = store.job(j)
    assert job.state == "failed" and job.restarts == 2
    assert "killed by signal 11; no restarts left (max_restarts=2)" in job.message
    assert len(ex.launches(j)) == 3
    assert [t for t in transitions(store, j) if t[1] in ("backoff", "failed")] == [
        ("admitted", "backoff"), ("admitted", "backoff"), ("admitted", "failed")]


def test_a_fenced_attempt_fails_without_a_restart(world):
    """Exit 77: the fence of the job's checkpoint location names another job or a newer attempt. A restart
    would fence that one out in turn: two jobs given one checkpoint directory would take turns failing
    until their restarts ran out. Before, 77 was an ordinary failure (restarted with backoff)."""
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="twin", gpus=2, max_restarts=3)
    ctl.step(clock())
    ctl.step(clock.advance(1))
    ex.exit(j, 77, None)
    ctl.step(clock.advance(1))  # rank 0 fenced out: the other rank is killed
    assert ("kill", j) in ex.calls
    ctl.step(clock.advance(1))
    job = store.job(j)
    assert job.state == "failed" and job.restarts == 0 and len(ex.launches(j)) == 1
    assert "rank 0 was fenced out of its checkpoint location (exit 77)" in job.message
    assert "not restarted" in job.message and "checkpoint directory" in job.message
    assert ctl.step(clock.advance(100)) == [] and len(ex.launches(j)) == 1


def test_one_rank_fails_the_rest_are_killed_then_restarted(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="gang", gpus=3)
    ctl.step(clock())
    ctl.step(clock.advance(1))
    ex.exit(j, None, 1, None)
    ctl.step(clock.advance(1))
    assert ("kill", j) in ex.calls and state(store, j) == "running"
    assert any(
        e.kind == "failure" and "rank 1 exited with code 1" in e.message for e in store.events(job_id=j)
    )
    ctl.step(clock.advance(1))  # all gone now (killed ranks report -9): classified as the failure
    assert state(store, j) == "backoff" and "rank 1 exited with code 1" in store.job(j).message


def test_vanished_rank_is_a_failure(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="v", gpus=2)
    ctl.step(clock())
    ex.jobs[j].vanished.add(0)
    ctl.step(clock.advance(1))
    ctl.step(clock.advance(1))
    assert state(store, j) == "backoff" and "rank 0 (pid 1000) vanished" in store.job(j).message


def test_hang_detected_from_heartbeat(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="h", gpus=2)
    ctl.step(clock())
    ex.beat(j, clock.advance(1), step=1, step_time_s=2.0)
    ctl.step(clock())
    ctl.step(clock.advance(60))  # 60 s silent: at the limit max(60, 10 x 2 s), not past it
    assert state(store, j) == "running"
    other = submit(store, "lab", clock(), name="other", kind="spot", gpus=3, command=["python", "x.py"])
    ctl.step(clock.advance(1))
    assert ("kill", j) in ex.calls and state(store, other) == "pending"  # nothing placed on the lost node
    hang = [e for e in store.events(job_id=j) if e.kind == "hang"]
    assert hang and "no heartbeat for 61 s (limit 60 s) at step 1" in hang[0].message
    ctl.step(clock.advance(1))
    assert state(store, j) == "backoff"


def test_starting_and_restoring_phases_get_the_startup_timeout(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="r", max_restarts=0)
    ctl.step(clock())
    ex.beat(j, clock.advance(1), step=0)
    for phase in ("starting", "restoring"):
        ex.jobs[j].progress = replace(ex.jobs[j].progress, phase=phase, heartbeat_s=clock())
        ctl.step(clock.advance(100))  # past hang_timeout_s (60), within startup_timeout_s (120)
        assert state(store, j) == "running" and ("kill", j) not in ex.calls
    ctl.step(clock.advance(21))
    assert ("kill", j) in ex.calls
    (hang,) = [e for e in store.events(job_id=j) if e.kind == "hang"]
    assert "(limit 120 s) at step 0, phase restoring" in hang.message


def test_no_heartbeat_within_startup_timeout_is_a_hang(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="s", max_restarts=0)
    ctl.step(clock())
    ctl.step(clock.advance(120))
    assert state(store, j) == "running"
    ctl.step(clock.advance(1))
    ctl.step(clock.advance(1))
    job = store.job(j)
    assert job.state == "failed" and "wrote no heartbeat within 120 s of launch" in job.message


def test_stop_grace_expires_then_sigkill_still_requeues(world):
    store, ex, ctl, clock = world
    spot = submit(store, "lab", clock(), name="slow", gpus=4, grace_s=20)
    ctl.step(clock())
    ded = submit(store, "prod", clock.advance(1), name="d", kind="dedicated", gpus=4)
    ctl.step(clock())
    assert store.job(spot).stop_deadline_s == clock() + 20 + 5
    ctl.step(clock.advance(25))
    assert ("kill", spot) in ex.calls
    assert ctl.step(clock.advance(1)) == [Admit(ded, {"n0": 4})]
    assert state(store, spot) == "pending" and store.job(spot).restarts == 0


def test_cancel_running_and_pending(world):
    store, ex, ctl, clock = world
    a = submit(store, "lab", clock(), name="a", gpus=4)
    b = submit(store, "lab", clock(), name="b", gpus=4)
    ctl.step(clock())
    store.update(a, cancel_requested=True)
    store.update(b, cancel_requested=True)
    ctl.step(clock.advance(1))
    assert state(store, a) == "cancelling" and ("stop", a) in ex.calls and state(store, b) == "cancelled"
    ex.exit(a, 75)
    ctl.step(clock.advance(1))
    assert state(store, a) == "cancelled" and store.job(a).finished_s == clock()


def test_shrink_is_stop_and_relaunch_on_the_smaller_size(world):
    store, ex, ctl, clock = world
    el = submit(store, "lab", clock(), name="elastic", gpus={"min": 2, "max": 4, "multiple_of": 2})
    ctl.step(clock())
    assert store.job(el).placement == {"n0": 4}
    ctl.step(clock.advance(1))
    other = submit(store, "lab", clock.advance(1), name="other", gpus=2, priority=1)
    decisions = ctl.step(clock())
    assert [type(d) for d in decisions] == [Shrink] and decisions[0].to_gpus == 2
    assert state(store, el) == "resizing" and store.job(el).releasing == {"n0": 2}
    ex.exit(el, 75)
    assert ctl.step(clock.advance(1)) == [Admit(other, {"n0": 2})]
    job = store.job(el)
    assert job.state == "admitted" and job.placement == {"n0": 2} and job.releasing == {}
    assert ex.launches(el) == [("launch", el, 1, 4), ("launch", el, 2, 2)]
    assert ("resizing", "admitted") in transitions(store, el)


def test_launch_error_is_a_failed_attempt(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="nodir", max_restarts=0)
    ex.fail_launch = "workdir /nope is not a directory"
    ctl.step(clock())
    job = store.job(j)
    assert job.state == "failed" and "launch failed: workdir /nope is not a directory" in job.message


def test_a_steps_admissions_are_all_committed_before_any_rank_starts(world):
    """Crash safety with one commit per step's admissions: when the executor starts the first job's ranks,
    another connection to the database already sees every attempt of the step (a kill -9 at any launch
    leaves recorded attempts, which recovery requeues, never ranks without a record); each handle stored."""
    store, ex, ctl, clock = world
    jobs = [submit(store, "lab", clock(), name=f"j{i}") for i in range(3)]
    seen: list[dict[str, tuple[str, int]]] = []
    launch = ex.launch

    def looking(req, now_s):
        with store.engine.connect() as db:  # (a connection of its own: it sees what is committed)
            rows = db.exec_driver_sql("SELECT id, state, attempt FROM jobs")
            seen.append({i: (st, a) for i, st, a in rows})
        return launch(req, now_s)

    ex.launch = looking
    assert [type(d) for d in ctl.step(clock())] == [Admit] * 3
    assert seen == [{j: ("admitted", 1) for j in jobs}] * 3
    assert [store.job(j).handle for j in jobs] == [{"pids": [1000]}] * 3
    assert [e.kind for e in store.events(job_id=jobs[0])][-1] == "launch"


def test_an_ended_attempt_is_released_only_once_its_end_is_committed(world):
    """The attempts that end in a step are released after the reconcile's one commit: when the executor
    forgets the first of them, another connection already sees every end (a kill -9 at any release leaves
    each end stored: none lost, none run again)."""
    store, ex, ctl, clock = world
    jobs = [submit(store, "lab", clock(), name=f"j{i}") for i in range(3)]
    ctl.step(clock())
    ctl.step(clock.advance(1))
    seen: list[dict[str, str]] = []
    release = ex.release

    def looking(job_id):
        with store.engine.connect() as db:  # (a connection of its own: it sees what is committed)
            seen.append(dict(db.exec_driver_sql("SELECT id, state FROM jobs").all()))
        release(job_id)

    ex.release = looking
    for j in jobs:
        ex.exit(j, 0)
    ctl.step(clock.advance(1))
    assert seen == [{j: "succeeded" for j in jobs}] * 3
    assert ex.jobs == {}


def test_a_step_that_raises_releases_only_the_ends_it_stored(world, monkeypatch):
    """A step raising after an attempt's end was written: rolled back, the attempt stays with the executor
    and the next step ends it again (once); its end committed, it is released."""
    store, ex, ctl, clock = world
    a, b = (submit(store, "lab", clock(), name=n) for n in ("a", "b"))
    ctl.step(clock())
    ctl.step(clock.advance(1))
    ex.exit(a, 0)
    snapshot = ctl.snapshot
    monkeypatch.setattr(ctl, "snapshot", lambda now_s: (_ for _ in ()).throw(RuntimeError("disk gone")))
    with pytest.raises(RuntimeError):
        ctl.step(clock.advance(1))  # (a's end written in the reconcile's batch and committed before)
    assert state(store, a) == "succeeded" and ("release", a) in ex.calls
    ex.exit(b, 0)
    real_release = ctl._release
    monkeypatch.setattr(ctl, "_release", lambda: (_ for _ in ()).throw(RuntimeError("disk gone")))
    with pytest.raises(RuntimeError):
        ctl.step(clock.advance(1))  # (b's end rolled back with the batch)
    assert state(store, b) == "running" and ("release", b) not in ex.calls
    monkeypatch.setattr(ctl, "_release", real_release)
    monkeypatch.setattr(ctl, "snapshot", snapshot)
    ctl.step(clock.advance(1))
    assert state(store, b) == "succeeded" and ex.calls.count(("release", b)) == 1
    assert [t for t in transitions(store, b) if t[1] == "succeeded"] == [("running", "succeeded")]


def test_a_release_that_raises_leaves_no_other_ended_attempt_held(world, monkeypatch):
    """Three attempts end in one step and the executor's release of the first raises: the step fails, and
    the other two are released all the same (their ends are stored; nothing would release them later)."""
    store, ex, ctl, clock = world
    jobs = [submit(store, "lab", clock(), name=f"j{i}") for i in range(3)]
    ctl.step(clock())
    ctl.step(clock.advance(1))
    release = ex.release

    def flaky(job_id):
        if job_id == jobs[0]:
            raise RuntimeError("executor unreachable")
        release(job_id)

    monkeypatch.setattr(ex, "release", flaky)
    for j in jobs:
        ex.exit(j, 0)
    with pytest.raises(RuntimeError):
        ctl.step(clock.advance(1))
    assert [state(store, j) for j in jobs] == ["succeeded"] * 3
    assert [("release", j) in ex.calls for j in jobs] == [False, True, True]


def test_a_loss_gone_nan_is_stored_as_null_and_every_read_goes_on(world):
    """A training run that diverged reports loss NaN (a worker may write any float): its progress is stored as
    standard JSON, NaN as null, so PostgreSQL stores it (a step writing it raised there, every step) and
    SQLite's JSON functions read it (the jobs holding GPUs, for the pool and /metrics: 'malformed JSON')."""
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="a", gpus=2)
    ctl.step(clock())
    ctl.step(clock.advance(1))
    ex.beat(j, clock.advance(1), step=5, loss=float("nan"))
    ctl.step(clock())
    assert store.job(j).progress["loss"] is None and store.job(j).progress["step"] == 5
    assert [(h.id, h.progress["step"]) for h in store.held(accounting=True)] == [(j, 5)]
    text = metrics.render(metrics.registry(store, ctl.nodes, clock)).decode()
    assert f'tidal_job_step{{job_id="{j}",tenant="lab"}} 5.0' in text


def test_json_columns_hold_standard_json_whatever_a_worker_wrote():
    """Non-finite floats become null also in what orjson refuses (a lone surrogate: written by ``json``)."""
    from tidal.control.store import to_json

    doc = {"phase": "\udc80", "loss": float("nan"), "tiers": {"dir": [1, float("inf")]}}
    assert json.loads(to_json(doc)) == {"phase": "\udc80", "loss": None, "tiers": {"dir": [1, None]}}
    assert json.loads(to_json({"loss": float("-inf"), 1: (2, 3)})) == {"loss": None, "1": [2, 3]}


def test_one_launch_failing_in_a_step_leaves_the_others_started(world):
    store, ex, ctl, clock = world
    jobs = [submit(store, "lab", clock(), name=f"j{i}", max_restarts=0) for i in range(3)]
    launch = ex.launch

    def flaky(req, now_s):
        if req.job_id == jobs[1]:
            raise RuntimeError("workdir vanished")
        return launch(req, now_s)

    ex.launch = flaky
    ctl.step(clock())
    assert [state(store, j) for j in jobs] == ["admitted", "failed", "admitted"]
    assert "launch failed: workdir vanished" in store.job(jobs[1]).message
    assert [store.job(j).handle for j in (jobs[0], jobs[2])] == [{"pids": [1000]}] * 2


def test_lost_work_and_ettr(world):
    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="e")
    t0 = clock()
    ctl.step(clock())
    ex.beat(j, clock.advance(10), step=1)
    ex.beat(j, clock.advance(10), step=11, ckpt_step=6)  # 1 s per step
    ctl.step(clock())
    ex.exit(j, 1)
    ctl.step(clock.advance(0))
    job = store.job(j)
    assert job.lost_steps == 5 and job.lost_s == pytest.approx(5.0)
    assert job.productive_s == pytest.approx(6.0) and job.held_s == pytest.approx(clock() - t0)
    rep = job_report(job, clock())
    assert rep["restarts"] == 1 and rep["ettr"] == pytest.approx(6.0 / 20.0)


def two_running(tmp_path):
    """A plane over a 4-GPU fake executor running jobs a and b (2 GPUs each): store, clock, executor,
    controller, a, b."""
    store = new_store(tmp_path, ("lab", 0, 1.0))
    clock = FakeClock()
    ex1 = FakeExecutor(gpus=4)
    ctl = Controller(store, ex1, CFG)
    a = submit(store, "lab", clock(), name="a", gpus=2)
    b = submit(store, "lab", clock(), name="b", gpus=2)
    ctl.step(clock())
    return store, clock, ex1, ctl, a, b


def test_recover_adopts_running_workers_or_requeues(tmp_path):
    store, clock, ex1, ctl, a, b = two_running(tmp_path)
    ctl.step(clock.advance(1))
    # The control plane dies; a's workers survive, b's are gone. A new process starts.
    ex2 = FakeExecutor(gpus=4)
    ex2.survivors[a] = ex1.jobs[a]
    ctl2 = Controller(store, ex2, CFG)
    ctl2.recover(clock.advance(5))
    assert state(store, a) == "running" and state(store, b) == "pending"
    adopted = [e.message for e in store.events(job_id=a) if e.kind == "adopted"]
    assert adopted and "re-adopted attempt 1, 2 of 2 ranks running" in adopted[0]
    assert "requeued to resume from checkpoint" in store.job(b).message
    assert ctl2.step(clock.advance(1)) == [Admit(b, {"n0": 2})]
    assert ex2.launches() == [("launch", b, 2, 2)]  # a is never launched again
    ex2.exit(a, 0)
    ctl2.step(clock.advance(1))
    assert state(store, a) == "succeeded"
    store.close()


def test_recover_releases_an_end_stored_by_a_plane_killed_before_its_release(tmp_path):
    store, clock, ex1, ctl, a, b = two_running(tmp_path)
    ex1.exit(a, 0)

    def killed(job_id: str) -> None:
        raise SystemExit("kill -9")

    ex1.release = killed  # the plane dies between the commit of a's end and its release
    with pytest.raises(SystemExit):
        ctl.step(clock.advance(1))
    assert state(store, a) == "succeeded" and state(store, b) == "running"
    ex2 = FakeExecutor(gpus=4)
    ex2.survivors = {a: ex1.jobs[a], b: ex1.jobs[b]}  # both still hold their GPUs in the executor
    Controller(store, ex2, CFG).recover(clock.advance(5))
    assert ("release", a) in ex2.calls and ("release", b) not in ex2.calls
    assert set(ex2.jobs) == {b} and not ex2.survivors
    # the executor failing that clean-up (its cluster out of reach a moment) does not stop the plane's start
    ex3 = FakeExecutor(gpus=4)
    ex3.survivors = {b: ex2.jobs[b]}

    def unreachable() -> list[str]:
        raise ConnectionError("the cluster is out of reach")

    ex3.release_unadopted = unreachable
    ctl3 = Controller(store, ex3, CFG)
    ctl3.recover(clock.advance(1))
    assert state(store, b) == "running" and set(ex3.jobs) == {b}
    ctl3.step(clock.advance(1))
    store.close()


def test_illegal_transition_leaves_the_job_as_it_was(world):
    from tidal.control.states import IllegalTransition

    store, ex, ctl, clock = world
    j = submit(store, "lab", clock(), name="x")
    with pytest.raises(IllegalTransition, match="pending -> running"):
        store.transition(j, State.RUNNING, clock(), "nope", attempt=7)
    job = store.job(j)
    assert job.state == "pending" and job.attempt == 0


def test_cancel_arriving_as_the_ranks_exit(world):
    store, ex, ctl, clock = world
    ok = submit(store, "lab", clock(), name="ok", gpus=2)
    bad = submit(store, "lab", clock(), name="bad", gpus=2)
    ctl.step(clock())
    for j, code in ((ok, 0), (bad, 1)):
        store.update(j, cancel_requested=True)
        ex.exit(j, code)
    ctl.step(clock.advance(1))
    assert state(store, ok) == "succeeded"  # it finished before the notice could matter
    assert state(store, bad) == "cancelled" and store.job(bad).restarts == 0


def test_auto_checkpoint_interval_from_the_measured_stall(world):
    store, ex, ctl, clock = world
    # 10 interruptions per GPU-hour: a 2-GPU job is interrupted every 3 minutes, so Daly's interval
    # for a 30 s stall is well inside [min, max].
    ctl.config = replace(CFG, ckpt_interval=CkptIntervalConfig(failure_rate_per_gpu_hour=10.0))
    auto = submit(store, "lab", clock(), name="auto", gpus=2)
    fixed = submit(store, "lab", clock(), name="fixed", gpus=2, checkpoint={"interval_s": 90})
    ctl.step(clock())
    assert (
        ex.jobs[auto].req.env["TIDAL_CKPT_INTERVAL_S"] == "3600"
    )  # the policy's cap until a stall is measured
    assert ex.jobs[fixed].req.env["TIDAL_CKPT_INTERVAL_S"] == "90"
    ctl.step(clock.advance(1))
    for j in (auto, fixed):
        ex.beat(j, clock.advance(1), step=3, ckpt_stall_s=30.0)
    decisions = ctl.step(clock())
    (d,) = [d for d in decisions if type(d).__name__ == "SetCkptInterval"]  # only the auto job
    assert d.job == auto and 60.0 < d.interval_s < 300
    assert ("configure", auto, {"ckpt_interval_s": d.interval_s}) in ex.calls
    assert store.job(auto).ckpt_interval_s == d.interval_s and store.job(fixed).ckpt_interval_s is None
    (ev,) = [e for e in store.events(job_id=auto) if e.kind == "ckpt_interval"]
    assert "measured stall 30 s" in ev.message
    ex.beat(auto, clock.advance(1), step=4, ckpt_stall_s=31.0)  # within the change ratio: no chatter
    assert [c for c in ex.calls if c[0] == "configure"] == [
        ("configure", auto, {"ckpt_interval_s": d.interval_s})
    ]
    ctl.step(clock())
    assert len([c for c in ex.calls if c[0] == "configure"]) == 1
    # A relaunch (after a failure) starts with the interval the policy set.
    ex.exit(auto, 1)
    ctl.step(clock.advance(1))
    ctl.step(clock.advance(CFG.restart_backoff_s + 1))
    ctl.step(clock.advance(1))
    assert (
        ex.jobs[auto].req.attempt == 2
        and ex.jobs[auto].req.env["TIDAL_CKPT_INTERVAL_S"] == f"{d.interval_s:g}"
    )


def test_tier_list_goes_to_the_ranks(world):
    store, ex, ctl, clock = world
    tiers = ["shm", "/ck/a", {"url": "s3://bucket/a", "every": 5}]
    j = submit(store, "lab", clock(), name="t", gpus=1, checkpoint={"tiers": tiers})
    ctl.step(clock())
    env = ex.jobs[j].req.env
    assert "TIDAL_CKPT_URL" not in env
    import json

    assert json.loads(env["TIDAL_CKPT_TIERS"]) == tiers


def test_why_a_job_waits_is_the_schedulers_own_published_with_each_step_and_gone_once_it_starts(tmp_path):
    """Each step publishes the scheduler's own reason for every job that waits (the loop's view, not the
    store: it is made afresh at every step), the API shows it, it is gone once the job runs, and a restarted
    controller shows none until its own first step."""
    import sqlalchemy as sa

    from tidal.control.views import job_view

    store = new_store(tmp_path, ("prod", 4, 1.0), ("lab", 0, 1.0))
    ex, clock = FakeExecutor(gpus=4), FakeClock()
    ctl = Controller(store, ex, CFG, ckpt_root=tmp_path / "jobs", publish=True)
    a = submit(store, "lab", clock(), name="a", gpus=3)
    b = submit(store, "lab", clock(), name="b", gpus=2)
    ctl.step(clock())
    view = ctl.published.view
    assert a not in view.waiting and job_view(store.job(a), clock(), view=view)["waiting"] is None
    w = view.waiting[b]
    assert w.reason.startswith("waiting: needs 2 GPUs, 1 free") and w.until_s is None
    assert job_view(store.job(b), clock(), view=view)["waiting"] == {"reason": w.reason, "until_s": None}
    assert job_view(store.job(b), clock())["waiting"] is None  # (no loop, no reason)
    c = submit(store, "lab", clock(), name="c", gpus=2)  # (after the step: behind b in its queue)
    behind = "queued behind earlier jobs in tenant lab's spot queue at priority 0"
    assert job_view(store.job(c), clock(), view=view)["waiting"] == {"reason": behind, "until_s": None}
    ctl.step(clock.advance(1))
    assert ctl.published.view.waiting[b] == w
    told = ctl.published.view.waiting[c]  # (the step looked at it: a reason of its own)
    assert job_view(store.job(c), clock(), view=ctl.published.view)["waiting"]["reason"] == told.reason
    ex.exit(a, 0)
    ctl.step(clock.advance(1))
    emptied = ctl.published.view if state(store, c) != "pending" else None  # (the step that admitted c)
    ctl.step(clock.advance(1))
    view = ctl.published.view
    assert state(store, b) in ("admitted", "running") and b not in view.waiting
    assert job_view(store.job(b), clock(), view=view)["waiting"] is None
    assert state(store, c) in ("admitted", "running")
    d = submit(store, "lab", clock(), name="d", gpus=2)  # (its queue emptied by the step that admitted c)
    for v in (emptied or view, view):
        assert job_view(store.job(d), clock(), view=v)["waiting"] is None  # (no job ahead: none until a step)
    assert "waiting" not in {c["name"] for c in sa.inspect(store.engine).get_columns("jobs")}  # (not stored)
    ctl2 = Controller(store, ex, CFG, ckpt_root=tmp_path / "jobs", publish=True)
    assert ctl2.published.view is None
    ctl2.step(clock.advance(1))
    assert b not in ctl2.published.view.waiting
    store.close()


def test_checkpoint_cadence_the_jobs_own_wins_and_interval_changes_do_not_chatter(world):
    """A job that checkpoints on its own step cadence gets no interval from the platform, and one event
    saying so; a platform-driven job's interval changes are announced at most every ANNOUNCE_INTERVAL_S
    (each applied at once), the next announcement counting the ones in between."""
    from tidal.control.controller import ANNOUNCE_INTERVAL_S

    store, ex, ctl, clock = world
    knobs = CkptIntervalConfig(failure_rate_per_gpu_hour=10.0, change_ratio=0.01)
    ctl.config = replace(CFG, ckpt_interval=knobs)
    own = submit(store, "lab", clock(), name="own", gpus=1)
    auto = submit(store, "lab", clock(), name="auto", gpus=1)
    ctl.step(clock())
    for i in range(90):  # 900 s: two announcements at most
        ex.beat(own, clock.advance(10), step=i + 1, ckpt_stall_s=5.0, ckpt_every_steps=25)
        ex.beat(auto, clock(), step=i + 1, ckpt_stall_s=5.0 + (i % 2) * 20)  # flips between two intervals
        ctl.step(clock())
    own_events = [e.message for e in store.events(job_id=own) if e.kind == "ckpt_interval"]
    assert own_events == ["checkpoint cadence: every 25 steps, the job's own (TIDAL_CKPT_INTERVAL_STEPS or "
                          "its code); the platform's interval is not applied (its timer stays at 3600 s)"]
    assert not [c for c in ex.calls if c[0] == "configure" and c[1] == own]
    changes = [c for c in ex.calls if c[0] == "configure" and c[1] == auto]
    told = [e for e in store.events(job_id=auto) if e.kind == "ckpt_interval"]
    assert len(changes) >= 80 and len(told) == 2 and told[1].time_s - told[0].time_s >= ANNOUNCE_INTERVAL_S
    assert "more change(s) since the last announcement" in told[-1].message
    assert store.job(auto).ckpt_interval_s == changes[-1][2]["ckpt_interval_s"]


def test_node_loss_requeues_on_the_remaining_gpus_not_a_failure(tmp_path):
    """A node leaves with ranks of a running job: the others are killed, the job is requeued (no restart
    counted) and relaunched on the GPUs left; the lost node is never placed on; events name it all,
    the ``recovered`` one too when the plane restarted between the loss and the recovery."""
    store = new_store(tmp_path, ("lab", 0, 1.0))
    ex = FakeExecutor(gpus=2, node="a", more={"b": 2})
    ctl, clock = Controller(store, ex, CFG, ckpt_root=tmp_path / "jobs"), FakeClock()
    j = submit(store, "lab", clock(), name="elastic", kind="spot", gpus={"min": 2, "max": 4})
    ctl.step(clock())
    assert store.job(j).placement == {"a": 2, "b": 2}
    ctl.step(clock.advance(1))
    ex.beat(j, clock.advance(1), step=14, ckpt_step=10)
    ctl.step(clock())

    ex.lose_node("b")
    other = submit(store, "lab", clock(), name="other", kind="spot", gpus=3, command=["python", "x.py"])
    ctl.step(clock.advance(1))
    assert ("kill", j) in ex.calls and state(store, other) == "pending"  # nothing placed on the lost node
    left = [e for e in store.events() if e.kind == "node" and (e.data or {}).get("left")]
    assert (
        len(left) == 1
        and left[0].data["jobs"] == [j]
        and "node b (2 GPUs) left the cluster" in left[0].message
    )
    lost = [e for e in store.events(job_id=j) if e.kind == "node_lost"]
    assert len(lost) == 1 and lost[0].data["ranks"] == [2, 3] and lost[0].data["ckpt_step"] == 10
    assert [n.name for n in ctl.nodes] == ["a", "b"] and ctl.nodes[1].gpus == 4 - 2  # held, none free
    ctl.step(clock.advance(1))  # all ranks gone: requeued, then admitted on what is left
    job = store.job(j)
    assert job.restarts == 0 and job.state == "admitted" and job.attempt == 2 and job.lost_steps == 4
    assert (
        sum(job.placement.values()) >= 2 and "b" not in job.placement and [n.name for n in ctl.nodes] == ["a"]
    )
    requeue = [e for e in store.events(job_id=j) if e.to_state == "pending" and e.from_state][0]
    assert requeue.data["node_lost"] and "node b lost with ranks [2, 3] at step 14" in requeue.message

    ctl = Controller(store, ex, CFG, ckpt_root=tmp_path / "jobs")  # the plane restarts before recovery
    ctl.step(clock.advance(1))
    ex.jobs[j].progress = replace(ex.jobs[j].progress, start_step=10, restore_tier="disk")
    ex.beat(j, clock.advance(2), step=11)
    ctl.step(clock.advance(1))
    rec = [e for e in store.events(job_id=j) if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].data["recovery_s"] == pytest.approx(4.0)
    assert rec[0].data["world_size"] == sum(job.placement.values()) and rec[0].data["was_world_size"] == 4
    assert rec[0].data["restore_tier"] == "disk" and rec[0].data["start_step"] == 10
    ctl.step(clock.advance(1))
    assert len([e for e in store.events(job_id=j) if e.kind == "recovered"]) == 1
    text = metrics.render(metrics.registry(store, ctl.nodes, clock)).decode()
    assert "tidal_node_losses_total 1.0" in text and "tidal_node_loss_recovery_seconds_count 1.0" in text
    assert (
        "tidal_node_loss_recovery_seconds_sum 4.0" in text
        and "tidal_node_loss_heartbeat_age_seconds_sum 1.0" in text
    )

    ex.more["b"] = 2  # the node returns: the elastic job grows back onto it
    decisions = ctl.step(clock.advance(1))
    assert [(d.job, dict(d.add)) for d in decisions if isinstance(d, Grow)] == [(j, {"b": 2})]
    joined = [e for e in store.events() if e.kind == "node" and (e.data or {}).get("joined")]
    assert [e.data["node"] for e in joined] == ["b"] and [(n.name, n.gpus) for n in ctl.nodes] == [
        ("a", 2),
        ("b", 2),
    ]
    store.close()


def test_a_resumed_location_is_taken_over_from_the_ended_jobs_of_the_tenant_there(tmp_path):
    """``taken_over``: the job it resumes and the ended jobs of its tenant at (or in) that location; not
    another tenant's, not one still pending, not one elsewhere; nothing for a job that resumes nothing."""
    from tidal.control.job_views import taken_over
    from tidal.control.spec import parse_spec
    from tidal.control.store import JobRow

    store = new_store(tmp_path, ("a", 2, 1.0), ("b", 2, 1.0))
    loc = str(tmp_path / "loc")

    def job(tenant: str, where: str, ended: bool = True, **ck) -> JobRow:
        spec = parse_spec({"name": "j", "gpus": 1, "command": ["python"],
                           "checkpoint": {"url": where}}).model_dump()
        spec["checkpoint"].update(ck)  # as stored: resume_from with the location it took over
        row = store.submit(tenant, spec, 0.0, ckpt_location=where)
        return store.transition(row.id, State.CANCELLED, 1.0, "test") if ended else row

    first, nested = job("a", loc), job("a", loc + "/sub")
    job("b", loc), job("a", loc + "/sub2", ended=False), job("a", str(tmp_path / "elsewhere"))
    resumer = job("a", loc, ended=False, resume_from=first.id)
    assert taken_over(resumer, store) == ((loc,), tuple(sorted([first.id, nested.id])))
    assert taken_over(first, store) == ((), ())

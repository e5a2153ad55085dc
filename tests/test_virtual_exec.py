"""The virtual executor behaves like real ranks towards the plane: training, checkpoints at their interval,
notices honoured with a checkpoint and exit 75, kills, node loss, a journal a restarted plane adopts from;
and the real controller drives it to the end."""

from __future__ import annotations

import pytest

from control_fakes import FakeClock, new_store, submit
from tidal.contract import ENV_CKPT_INTERVAL_S, EXIT_PREEMPTED
from tidal.control.controller import Controller
from tidal.control.states import State
from tidal.exec.protocol import LaunchError, LaunchRequest
from tidal.exec.virtual import WORK_ENV, VirtualExecutor, parse_shape

T0 = 1_000_000.0


def req(job: str = "j-1", attempt: int = 1, placement: dict | None = None, work: float | None = 400.0,
        interval_s: float = 30.0) -> LaunchRequest:
    env = {ENV_CKPT_INTERVAL_S: str(interval_s), **({WORK_ENV: str(work)} if work is not None else {})}
    return LaunchRequest(job, attempt, ("train",), placement or {"v0": 2, "v1": 2}, env=env)


def test_shape_and_nodes() -> None:
    assert parse_shape("256x8") == (256, 8)
    for bad in ("256", "0x8", "axb", "2x0"):
        with pytest.raises(ValueError, match="NODESxGPUS"):
            parse_shape(bad)
    ex = VirtualExecutor(12, 4, serving={"s0": 8})
    nodes = ex.nodes()
    assert [n.name for n in nodes][:2] == ["v00", "v01"] and len(nodes) == 13
    assert sum(n.gpus for n in nodes if n.pool == "training") == 48 and nodes[-1].pool == "serving"
    with pytest.raises(LaunchError, match="no node nope"):
        ex.launch(req(placement={"nope": 1}), T0)


def test_trains_checkpoints_and_exits_zero() -> None:
    ex = VirtualExecutor(2, 4, beat_s=5.0)
    ex.launch(req(placement={"v0": 2, "v1": 2}), T0)  # 4 GPUs, 400 GPU-s: done at T0 + 100
    ob = ex.observe(T0 + 47)["j-1"]
    assert ob.alive and len(ob.ranks) == 4 and [r.node for r in ob.ranks] == ["v0", "v0", "v1", "v1"]
    p = ob.progress
    assert (p.step, p.heartbeat_s, p.heartbeats) == (180, T0 + 45, 4)  # beats every 5 s, 4 GPU-s per second
    assert (p.ckpt_step, p.durable_ckpt_s) == (120, T0 + 30)  # the checkpoint of T0 + 30
    assert ex.used() == {"v0": 2, "v1": 2}
    done = ex.observe(T0 + 101)["j-1"]
    assert done.done and [r.exit_code for r in done.ranks] == [0] * 4 and done.progress.ended
    assert done.progress.ckpt_step == 400
    ex.release("j-1")
    assert ex.observe(T0 + 102) == {} and ex.ckpt["j-1"] == 400


def test_notice_kill_and_resume_from_checkpoint() -> None:
    ex = VirtualExecutor(2, 4, notice_s=5.0)
    ex.launch(req(), T0)
    ex.observe(T0 + 40)
    ex.signal_stop("j-1")
    assert ex.observe(T0 + 44)["j-1"].alive  # the notice takes notice_s
    ob = ex.observe(T0 + 45)["j-1"]
    assert [r.exit_code for r in ob.ranks] == [EXIT_PREEMPTED] * 4 and ob.progress.ckpt_step == 180
    ex.release("j-1")
    ex.launch(req(attempt=2, placement={"v0": 1}), T0 + 50)  # resumes from 180 on 1 GPU
    ob = ex.observe(T0 + 60)["j-1"]
    assert ob.progress.start_step == 180 and ob.progress.step == 190
    ex.observe(T0 + 70)
    ex.kill("j-1")
    ob = ex.observe(T0 + 71)["j-1"]
    assert [r.exit_code for r in ob.ranks] == [-9]
    ex.release("j-1")
    assert ex.ckpt["j-1"] == 180  # no checkpoint since the resume (interval 30 s): the killed work is lost
    ex.launch(req(attempt=3, placement={"v0": 1}), T0 + 80)
    with pytest.raises(ValueError, match="no rank 3"):
        ex.signal_stop("j-1", [3])


def test_node_loss() -> None:
    ex = VirtualExecutor(2, 4)
    ex.launch(req(), T0)
    ex.lose_node("v1", T0 + 20)
    ob = ex.observe(T0 + 25)["j-1"]
    assert [(r.rank, r.lost, r.vanished, r.alive) for r in ob.ranks] == [
        (0, False, False, True), (1, False, False, True), (2, True, True, False), (3, True, True, False)]
    assert ob.progress.step == 80  # training stopped with the node
    assert [n.name for n in ex.nodes()] == ["v0"]


def test_journal_adopted_after_a_restart(tmp_path) -> None:
    path = tmp_path / "virtual.jsonl"
    ex = VirtualExecutor(2, 4, journal=path)
    ex.launch(req("a-1", placement={"v0": 4}), T0)
    ex.launch(req("b-2", placement={"v1": 1}, work=None), T0)
    ex.observe(T0 + 10)
    ex.signal_stop("a-1")
    ex.lose_node("v1", T0 + 12)
    # a kill -9 of the plane: nothing closed
    again = VirtualExecutor(2, 4, journal=path)
    assert not again.adopt("a-1", 2, T0 + 20) and again.adopt("a-1", 1, T0 + 20)
    assert again.adopt("b-2", 1, T0 + 20)
    obs = again.observe(T0 + 20)
    assert [r.exit_code for r in obs["a-1"].ranks] == [EXIT_PREEMPTED] * 4  # the notice went on meanwhile
    assert obs["b-2"].ranks[0].lost and [n.name for n in again.nodes()] == ["v0"]
    again.release("a-1")
    third = VirtualExecutor(2, 4, journal=path)
    assert third.ckpt["a-1"] == 4 * 15 and not third.adopt("a-1", 1, T0 + 30)
    # b-2's end stored, the plane killed before its release: the next one adopts nothing and releases it
    assert third.release_unadopted() == ["attempt 1 of b-2"] and third.release_unadopted() == []
    assert not VirtualExecutor(2, 4, journal=path).adopt("b-2", 1, T0 + 40)


def test_controller_runs_jobs_to_the_end(tmp_path) -> None:
    """The real reconcile loop and scheduler over the virtual executor: each job admitted, trained,
    checkpointed and succeeded, one preempted by a node loss and resumed from its checkpoint."""
    clock = FakeClock(T0)
    store = new_store(tmp_path, ("a", 0, 1.0), ("b", 0, 1.0))
    ex = VirtualExecutor(4, 8, beat_s=5.0)
    ids = [submit(store, t, clock(), name=f"j{g}", gpus=g, env={WORK_ENV: str(g * 300)},
                  checkpoint={"interval_s": 60}) for t, g in (("a", 8), ("b", 16), ("a", 4), ("b", 8))]
    ctl = Controller(store, ex)
    ctl.step(clock())
    lost_node = next(iter(store.job(ids[1]).placement))
    for _ in range(100):
        ctl.step(clock.advance(10.0))
        if clock() - T0 >= 100 and lost_node not in ex.lost_nodes:
            ex.lose_node(lost_node, clock())
    states = {j: store.job(j).state for j in ids}
    assert states == {j: State.SUCCEEDED for j in ids}, states
    hit = store.job(ids[1])
    assert hit.attempt == 2 and hit.ckpt_step == 16 * 300
    assert any("node" in e.message for e in store.events(job_id=ids[1]))

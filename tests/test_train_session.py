"""``tidal.train`` in one process: environment contract, checkpoint policy, notices, progress records.

These sessions run without a process group (no launcher variables), in the test process itself;
``exit_fn`` stands in for ``os._exit`` so that a notice ends the session, not pytest.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from tidal import ckpt, train
from tidal.train import Env, EnvError, MemoryWriter, Notice, Preempted, Session
from tidal.train.progress import JsonlWriter, read_jsonl


@pytest.fixture(autouse=True)
def _shm(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))


def make_job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, opt, train.GlobalBatchSampler(64, 8, 4, seed=1)


def train_step(model, opt, sampler, step) -> float:
    total = 0.0
    for idx in sampler.micro_batches(step):
        x = torch.tensor([[i / 64, (i % 7) / 7, 1.0, -1.0] for i in idx])
        loss = (model(x).squeeze(1) - x[:, 0]).square().mean()
        (loss / sampler.accum_steps).backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad()
    return total / sampler.accum_steps


def events(w: MemoryWriter, name: str) -> list[dict]:
    return [r for r in w.records if r["event"] == name]


def test_env_defaults_and_errors_name_the_variable():
    e = Env.from_environ({})
    assert (e.rank, e.world_size, e.launched, e.ckpt_url, e.grace_s, e.notice_wait) == (
        0,
        1,
        False,
        None,
        30.0,
        "fast",
    )
    e = Env.from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
                          "TIDAL_CKPT_URL": "/c", "TIDAL_CKPT_INTERVAL_STEPS": "50", "TIDAL_GRACE_S": "7.5"})
    assert (e.rank, e.world_size, e.launched, e.ckpt_url, e.ckpt_interval_steps, e.grace_s) == (
        1,
        2,
        True,
        "/c",
        50,
        7.5,
    )
    bad = [
        ({"WORLD_SIZE": "2"}, "MASTER_ADDR/MASTER_PORT are not set"),
        ({"TIDAL_GRACE_S": "soon"}, "TIDAL_GRACE_S='soon': expected a number of seconds"),
        ({"TIDAL_GRACE_S": "0"}, "TIDAL_GRACE_S='0'"),
        ({"TIDAL_NOTICE_WAIT": "later"}, "TIDAL_NOTICE_WAIT='later': expected one of"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK=2 is not below WORLD_SIZE=2",
        ),
        ({"TIDAL_CKPT_KEEP": "-1"}, "TIDAL_CKPT_KEEP='-1': expected an integer >= 0"),
    ]
    for environ, msg in bad:
        with pytest.raises(EnvError, match=msg.replace("(", r"\(").replace("/", "/")):
            Env.from_environ(environ)


def test_checkpoints_every_n_steps_and_restores_into_a_fresh_model(tmp_path):
    url, w = tmp_path / "ckpt", MemoryWriter()
    model, opt, sampler = make_job()
    extra = {"note": "hello", "ema": torch.zeros(2)}
    params_at: dict[int, list[torch.Tensor]] = {}
    with Session(env=Env(), ckpt_url=url, ckpt_every_steps=2, ckpt_every_s=0, progress_dir=tmp_path / "p",
                 writers=[w]) as s:
        step = s.restore(model, opt, sampler, extra=extra)
        assert step == 0 and events(w, "restore")[0]["tier"] is None
        while step < 5:
            loss = train_step(model, opt, sampler, step)
            extra["ema"] += 1
            step += 1
            params_at[step] = [p.detach().clone() for p in model.parameters()]
            s.step_done(step, loss=loss, tokens=8 * 4)
    assert [c["step"] for c in events(w, "checkpoint")] == [2, 4]
    assert [(c["step"], c["tiers"]) for c in events(w, "committed")] == [
        (2, ["shm", "disk"]),
        (4, ["shm", "disk"]),
    ]
    steps = events(w, "step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert set(steps[-1]["committed"].values()) <= {
        2,
        4,
    }  # as far as known then: saves persist in the background
    assert s.committed == {"shm": 4, "disk": 4}  # close() waited for them
    assert steps[1]["samples_per_s"] > 0 and steps[1]["tokens_per_s"] == pytest.approx(
        4 * steps[1]["samples_per_s"]
    )
    assert read_jsonl(tmp_path / "p" / "progress-r00000.jsonl")[-1]["event"] == "end"
    beat = json.loads((tmp_path / "p" / "heartbeat-r00000.json").read_text())
    assert beat["step"] == 5 and beat["phase"] == "ended" and beat["pid"] == os.getpid()

    model2, opt2, sampler2 = make_job(seed=99)
    extra2 = {"note": "", "ema": torch.zeros(2)}
    w2 = MemoryWriter()
    with Session(env=Env(), ckpt_url=url, writers=[w2]) as s:
        assert s.restore(model2, opt2, sampler2, extra=extra2) == 4
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), params_at[4], strict=True))
    assert extra2["note"] == "hello" and torch.equal(extra2["ema"], torch.full((2,), 4.0))
    assert events(w2, "restore")[0]["tier"] == "shm" and events(w2, "restore")[0]["saved_world_size"] == 1
    # Resuming continues the same trajectory: step 5 from the checkpoint equals step 5 without a stop.
    train_step(model2, opt2, sampler2, 4)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), params_at[5], strict=True))


def test_time_based_checkpoint_and_no_location(tmp_path):
    w = MemoryWriter()
    model, opt, sampler = make_job()
    with Session(env=Env(), ckpt_url=tmp_path / "c", ckpt_every_s=0.05, writers=[w]) as s:
        s.restore(model, opt, sampler)
        s.step_done(1)
        time.sleep(0.06)
        s.step_done(2)
    assert [(c["step"], c["reason"]) for c in events(w, "checkpoint")] == [(2, "seconds")]
    with Session(env=Env(), writers=[w]) as s:  # no TIDAL_CKPT_URL: nothing to restore, nothing saved
        assert s.restore(model, opt, sampler) == 0
        assert s.checkpoint(1) is None


@pytest.mark.parametrize("wait", ["all", "fast"])
def test_notice_file_stops_after_the_step_with_the_checkpoint_committed(tmp_path, wait):
    notice, w, exits = tmp_path / "notice", MemoryWriter(), []
    model, opt, sampler = make_job()
    with pytest.raises(Preempted) as e, Session(env=Env(), ckpt_url=tmp_path / "c", notice_file=notice,
                                                notice_wait=wait, writers=[w], exit_fn=exits.append) as s:
        step = s.restore(model, opt, sampler)
        while step < 100:
            train_step(model, opt, sampler, step)
            step += 1
            if step == 3:
                notice.write_text("reclaim")  # arrives while step 4 is (notionally) running
            s.step_done(step)
    assert e.value.code == train.EXIT_PREEMPTED and e.value.step == 3
    assert e.value.tiers[0] == "shm" and (wait == "fast" or e.value.tiers == ["shm", "disk"])
    assert exits == ([] if wait == "all" else [75])  # fast: the session ends the process itself
    assert ckpt.steps(tmp_path / "c")[-1] == 3
    (n,), (p,) = events(w, "notice"), events(w, "preempted")
    assert n["source"] == "file" and p["step"] == 3 and p["exit_code"] == 75 and p["notice_to_exit_s"] >= 0


def test_sigterm_is_a_notice_and_the_handler_is_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    model, opt, sampler = make_job()
    w = MemoryWriter()
    with pytest.raises(Preempted), Session(env=Env(), ckpt_url=tmp_path / "c", notice_wait="all", writers=[w],
                                           exit_fn=lambda code: None) as s:
        s.restore(model, opt, sampler)
        train_step(model, opt, sampler, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        s.step_done(1)
    assert signal.getsignal(signal.SIGTERM) == before
    assert events(w, "notice")[0]["source"] == "SIGTERM" and ckpt.steps(tmp_path / "c") == [1]


def test_stale_notice_file_is_ignored(tmp_path):
    f = tmp_path / "notice"
    f.write_text("left from an earlier attempt")
    os.utime(f, (time.time() - 60, time.time() - 60))
    n = Notice(30.0, f, not_before_unix=time.time() - 1, exit_fn=lambda code: None)
    assert not n.requested()
    f.touch()
    assert n.requested() and n.source == "file" and 0 < n.remaining_s() <= 30.0
    n.uninstall()


def test_grace_watchdog_and_second_signal_exit_with_75():
    called, done = [], threading.Event()

    def exit_fn(code):
        called.append(code)
        done.set()

    n = Notice(0.2, exit_fn=exit_fn)
    n.trigger("api")
    assert done.wait(10.0) and called == [75]  # the grace ran out
    n.uninstall()

    called.clear()
    done.clear()
    n = Notice(3600.0, exit_fn=exit_fn)
    assert n.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert n.source == "SIGTERM" and called == []
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert called == [75]
    finally:
        n.uninstall()


def test_jsonl_reader_skips_a_torn_last_line(tmp_path):
    w = JsonlWriter(tmp_path / "x.jsonl")
    w.write({"event": "step", "step": 1})
    w.close()
    with open(tmp_path / "x.jsonl", "a") as f:
        f.write('{"event": "st')
    assert read_jsonl(tmp_path / "x.jsonl") == [{"event": "step", "step": 1}]


def test_tier_list_from_the_environment(tmp_path):
    env = Env.from_environ({"TIDAL_CKPT_TIERS": f"shm, {tmp_path / 'a'} ,{tmp_path / 'b'}"})
    assert env.ckpt_tiers == ("shm", str(tmp_path / "a"), str(tmp_path / "b"))
    as_json = json.dumps(["shm", {"url": str(tmp_path / "a")}, {"url": str(tmp_path / "b"), "every": 2}])
    env = Env.from_environ({"TIDAL_CKPT_TIERS": as_json})
    assert env.ckpt_tiers[2] == {"url": str(tmp_path / "b"), "every": 2}
    for raw, msg in [("[1, 2]", "expected a JSON list of strings or objects"), ("[\"shm\"", "not valid JSON"),
                     ("shm,,/x", "without empty entries")]:
        with pytest.raises(EnvError, match=r"TIDAL_CKPT_TIERS"):
            Env.from_environ({"TIDAL_CKPT_TIERS": raw})
        with pytest.raises(EnvError, match=msg):
            Env.from_environ({"TIDAL_CKPT_TIERS": raw})
    with pytest.raises(EnvError, match=r"TIDAL_CKPT_TIERS: .*'shmm'"):  # a typo fails at start, named
        Session(env=Env.from_environ({"TIDAL_CKPT_TIERS": "shmm,/x"}))

    # Saves go through every tier (the second one every 2nd save); restore reads the newest from any.
    w = MemoryWriter()
    model, opt, sampler = make_job()
    with Session(env=env, ckpt_every_steps=1, ckpt_every_s=0, writers=[w]) as s:
        assert s.ckpt_url is None and s.restore(model, opt, sampler) == 0
        for step in range(1, 4):
            train_step(model, opt, sampler, step - 1)
            s.step_done(step)
    assert ckpt.steps(tmp_path / "a") == [1, 2, 3] and ckpt.steps(tmp_path / "b") == [1, 3]
    import shutil

    shutil.rmtree(tmp_path / "a")  # the disk tier is gone: restore finds step 3 in the other tiers
    model2, opt2, sampler2 = make_job(seed=5)
    with Session(env=env, writers=[w]) as s:
        assert s.restore(model2, opt2, sampler2) == 3
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), model.parameters(), strict=True))


def test_notice_during_restore_stops_before_training(tmp_path):
    url = tmp_path / "c"
    model, opt, sampler = make_job()
    with Session(env=Env(), ckpt_url=url, ckpt_every_steps=2, ckpt_every_s=0) as s:
        s.restore(model, opt, sampler)
        for step in range(1, 3):
            train_step(model, opt, sampler, step - 1)
            s.step_done(step)
    notice, w, exits = tmp_path / "notice", MemoryWriter(), []
    model2, opt2, sampler2 = make_job(seed=3)
    with pytest.raises(Preempted) as e, Session(env=Env(), ckpt_url=url, notice_file=notice, writers=[w],
                                                exit_fn=exits.append) as s:
        notice.write_text("reclaim")  # arrives before (or while) the step is read back
        s.restore(model2, opt2, sampler2)
        pytest.fail("restore returned although a notice had come")
    assert e.value.step == 2 and e.value.tiers and exits == [75]
    assert events(w, "checkpoint") == [] and events(w, "step") == []  # no training, no new save
    assert ckpt.steps(url) == [2] and events(w, "preempted")[0]["step"] == 2


def test_control_file_changes_the_interval_of_a_running_session(tmp_path):
    control, w = tmp_path / "control.json", MemoryWriter()
    env = Env.from_environ({"TIDAL_CONTROL_FILE": str(control)})
    model, opt, sampler = make_job()
    with Session(env=env, ckpt_url=tmp_path / "c", ckpt_every_s=3600, writers=[w]) as s:
        s.restore(model, opt, sampler)
        s.step_done(1)  # no file yet: nothing changes
        control.write_text("{\"ckpt_interval_s\": \"soon\"}")
        s.step_done(2)  # a bad file is ignored with a warning; training goes on
        assert s.ckpt_every_s == 3600
        control.write_text(json.dumps({"ckpt_interval_s": 0.01}))
        os.utime(
            control, ns=(time.time_ns(), time.time_ns() + 1_000_000)
        )  # a new mtime, even on coarse clocks
        time.sleep(0.02)
        s.step_done(3)
    assert s.ckpt_every_s == 0.01
    assert [(r["ckpt_interval_s"], r["was"]) for r in events(w, "control")] == [(0.01, 3600.0)]
    assert [(c["step"], c["reason"]) for c in events(w, "checkpoint")] == [(3, "seconds")]


def test_commits_are_recorded_as_they_happen_not_at_the_next_step(tmp_path):
    w = MemoryWriter()
    model, opt, sampler = make_job()
    with Session(env=Env(), ckpt_url=tmp_path / "c", ckpt_every_steps=2, ckpt_every_s=0, writers=[w]) as s:
        s.restore(model, opt, sampler)
        for step in (1, 2):
            train_step(model, opt, sampler, step - 1)
            s.step_done(step)
        deadline = time.monotonic() + 60
        while not events(w, "committed") and time.monotonic() < deadline:  # no step_done meanwhile
            time.sleep(0.01)
        assert [(c["step"], c["tiers"]) for c in events(w, "committed")] == [(2, ["shm", "disk"])]
        assert s.committed == {"shm": 2, "disk": 2}
    assert s._watcher is not None and not s._watcher.is_alive()  # stopped with the session

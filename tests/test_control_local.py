"""The local executor with real (tiny) processes: the env contract, exit codes, notices (to every rank
or some), logs, the shim's two-phase start, adoption by a second executor after a "crash", and the
progress fold."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tidal.exec import procs, shim
from tidal.exec.local import LaunchError, LocalExecutor
from tidal.exec.progress import ProgressReader
from tidal.exec.protocol import LaunchRequest

PY = sys.executable


def req(job: str, code: str, n: int = 1, attempt: int = 1, **kw) -> LaunchRequest:
    return LaunchRequest(job, attempt, (PY, "-c", code), {"local": n}, **kw)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def wait_done(ex: LocalExecutor, job: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ob = ex.observe(time.time())[job]
        if ob.done:
            return ob
        time.sleep(0.05)
    ex.kill(job)
    raise AssertionError(f"{job} still running after {timeout_s} s")


@pytest.fixture
def executors():
    made: list[LocalExecutor] = []

    def make(root, **kw) -> LocalExecutor:
        made.append(LocalExecutor(root, **kw))
        return made[-1]

    yield make
    for ex in made:  # stop anything a failed test left running (by pid, through the executor)
        for job in list(ex._jobs):
            ex.kill(job)
            ex.release(job)


CONTRACT = """
import json, os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TIDAL_JOB_ID",
        "TIDAL_PROGRESS_DIR", "CUDA_VISIBLE_DEVICES", "MINE", "TIDAL_ATTEMPT"]
print(json.dumps({k: os.environ.get(k) for k in keys} | {"cwd": os.getcwd()}))
sys.exit(3 * int(os.environ["RANK"]))
"""


def test_env_contract_exit_codes_and_logs(tmp_path, executors):
    ex = executors(tmp_path / "jobs", slots=3)
    handle = ex.launch(req("j", CONTRACT, n=2, workdir=str(tmp_path), env={"MINE": "1"}), time.time())
    assert handle["devices"] == [0, 1] and len(handle["ranks"]) == 2
    ob = wait_done(ex, "j")
    assert [r.exit_code for r in ob.ranks] == [0, 3]
    seen = []
    for r in range(2):
        lines = read(ex.log_path("j", r)).splitlines()
        assert lines[0].startswith(f"=== tidal: j attempt 1, rank {r} of 2")
        seen.append(json.loads(lines[1]))
    port = seen[0]["MASTER_PORT"]
    for r, env in enumerate(seen):
        assert env == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TIDAL_JOB_ID": "j",
                       "TIDAL_PROGRESS_DIR": str(tmp_path / "jobs" / "j" / "attempt-1" / "progress"),
                       "CUDA_VISIBLE_DEVICES": "", "MINE": "1", "TIDAL_ATTEMPT": "1", "cwd": str(tmp_path)}
    with pytest.raises(LaunchError, match="needs 2 devices on local, 1 free"):
        ex.launch(req("k", "pass", n=2), time.time())
    ex.release("j")
    assert ex.used() == {"local": 0}


def test_gpu_binding(tmp_path, executors):
    ex = executors(tmp_path / "jobs", gpu_ids=[4, 5, 6])
    ex.launch(req("g", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])", n=2), time.time())
    wait_done(ex, "g")
    assert read(ex.log_path("g", 1)).splitlines()[1] == "4,5"


def test_notice_then_kill(tmp_path, executors):
    ex = executors(tmp_path / "jobs", slots=2)
    polite = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    ex.launch(req("p", polite), time.time())
    ex.launch(req("q", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "print('ready', flush=True); time.sleep(60)"), time.time())
    for job in ("p", "q"):
        deadline = time.monotonic() + 30
        while "ready" not in read(ex.log_path(job, 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
    ex.signal_stop("p")
    ex.signal_stop("q")
    assert [r.exit_code for r in wait_done(ex, "p").ranks] == [75]
    time.sleep(0.3)
    assert ex.observe(time.time())["q"].alive  # ignores the notice
    ex.kill("q")
    assert [r.exit_code for r in wait_done(ex, "q").ranks] == [-9]


def test_a_notice_to_some_ranks(tmp_path, executors):
    ex = executors(tmp_path / "jobs", slots=2)
    ex.launch(req("s", "import signal, sys, time\n"
                       "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
                       "print('ready', flush=True)\n"
                       "time.sleep(60)\n", n=2), time.time())
    deadline = time.monotonic() + 30
    while not all("ready" in read(ex.log_path("s", r)) for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ValueError, match=r"job s: no rank 2 \(it has 2: 0..1\)"):
        ex.signal_stop("s", ranks=[2])
    ex.signal_stop("s", ranks=[1])
    deadline = time.monotonic() + 30
    while ex.observe(time.time())["s"].ranks[1].alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.exit_code for r in ex.observe(time.time())["s"].ranks] == [None, 75]  # rank 0 runs on
    ex.signal_stop("s")
    assert [r.exit_code for r in wait_done(ex, "s").ranks] == [75, 75]


def test_launch_errors(tmp_path, executors):
    ex = executors(tmp_path / "jobs", slots=1)
    with pytest.raises(LaunchError, match="is not a directory"):
        ex.launch(req("w", "pass", workdir=str(tmp_path / "nope")), time.time())
    ex.launch(LaunchRequest("m", 1, ("/no/such/program",), {"local": 1}), time.time())
    ob = wait_done(ex, "m")
    assert [r.exit_code for r in ob.ranks] == [127]
    assert "cannot start '/no/such/program'" in read(ex.log_path("m", 0))


def test_shim_runs_nothing_without_go(tmp_path):
    marker = tmp_path / "ran"
    p = subprocess.run(
        [
            PY,
            "-I",
            shim.__file__,
            str(tmp_path / "exit.json"),
            str(tmp_path / "pid.json"),
            "--",
            PY,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        input=b"",
        timeout=30,
    )
    assert p.returncode == 0 and not marker.exists() and not (tmp_path / "exit.json").exists()
    p = subprocess.run(
        [
            PY,
            "-I",
            shim.__file__,
            str(tmp_path / "exit.json"),
            str(tmp_path / "pid.json"),
            "--",
            PY,
            "-c",
            f"open({str(marker)!r}, 'w'); raise SystemExit(7)",
        ],
        input=b"go\n",
        timeout=30,
    )
    assert p.returncode == 7 and marker.exists()
    assert json.loads((tmp_path / "exit.json").read_text())["code"] == 7


def test_adopt_after_a_restart(tmp_path, executors):
    first = executors(tmp_path / "jobs", slots=2)
    first.launch(req("a", "import time; print('up', flush=True); time.sleep(60)", n=2), time.time())
    pids = [r.pid for r in first.observe(time.time())["a"].ranks]
    first._jobs.clear()  # the control plane "dies": nothing is stopped, the new one starts from disk
    second = executors(tmp_path / "jobs", slots=2)
    assert not second.adopt("a", 2, time.time())  # no such attempt was ever launched
    assert second.adopt("a", 1, time.time())
    ob = second.observe(time.time())["a"]
    assert [r.pid for r in ob.alive] == pids and second.used() == {"local": 2}
    for pid in pids:
        assert procs.alive(pid, procs.start_time(pid)) and not procs.alive(
            pid, 1
        )  # wrong start time: not ours
    second.kill("a")
    ob = wait_done(second, "a")
    assert all(r.vanished for r in ob.ranks)  # SIGKILL of shim and rank: no exit code was recorded
    second.release("a")
    assert second.used() == {"local": 0}


def test_progress_fold(tmp_path):
    d = tmp_path / "progress"
    d.mkdir()
    recs = [{"event": "restore", "time": 1.0, "step": 10},
            {"event": "step", "time": 2.0, "step": 11, "step_time_s": None, "loss": 3.0},
            {"event": "checkpoint", "time": 2.5, "step": 11, "stall_s": 0.1},
            {"event": "step", "time": 4.0, "step": 12, "step_time_s": 2.0, "loss": 2.5},
            {"event": "committed", "time": 4.5, "step": 11, "tiers": ["shm"]},
            {"event": "committed", "time": 5.0, "step": 11, "tiers": ["shm", "disk"]},
            {"event": "step", "time": 6.0, "step": 13, "step_time_s": 2.0, "loss": 2.0}]
    f = d / "progress-r00000.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"event": "step", "ti')  # a torn last line
    (d / "heartbeat-r00000.json").write_text(json.dumps({"time": 7.0, "phase": "training"}))
    reader = ProgressReader(d, world_size=2)
    p = reader.read()
    assert (p.start_step, p.step, p.first_step, p.loss, p.mean_step_s) == (10, 13, 11, 2.0, 2.0)
    assert (p.ckpt_step, p.ckpt_s, p.durable_ckpt_step, p.durable_ckpt_s) == (11, 2.5, 11, 2.5)
    assert p.tiers == {"shm": [11, 2.5], "disk": [11, 2.5]} and p.ckpt_stall_s == 0.1
    assert p.heartbeats == 1 and p.heartbeat_s == 7.0
    with open(f, "a") as fh:  # the rest of the torn line, then the notice's final checkpoint
        fh.write('me": 8.0, "step": 14, "step_time_s": 2.0}\n')
        fh.write(json.dumps({"event": "checkpoint", "time": 8.1, "step": 14, "stall_s": 0.1}) + "\n")
        fh.write(json.dumps({"event": "preempted", "time": 8.5, "step": 14, "tiers": ["shm"]}) + "\n")
    (d / "heartbeat-r00001.json").write_text(json.dumps({"time": 6.5, "phase": "training"}))
    p = reader.read()
    assert p.step == 14 and p.preempted and p.ckpt_step == 14 and p.durable_ckpt_step == 11
    assert p.heartbeats == 2 and p.heartbeat_s == 6.5  # the oldest rank's newest beat
    with open(f, "a") as fh:  # one slow save among quick ones does not move the reported stall
        for i, stall in enumerate([0.1, 0.1, 2.0, 0.12]):
            fh.write(
                json.dumps({"event": "checkpoint", "time": 9.0 + i, "step": 15 + i, "stall_s": stall}) + "\n"
            )
    p = reader.read()
    assert p.ckpt_stall_s == 0.1  # the median of the last five: 0.1, 0.1, 0.1, 2.0, 0.12


INTERVAL = """
import time
import torch
import torch.distributed as dist
from tidal.train import Session
with Session(ckpt_every_s=3600) as s:
    s.restore()
    for step in range(1, 100000):
        time.sleep(0.02)
        s.step_done(step)
        seen = torch.tensor([float(s.ckpt_every_s != 3600)])
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # stop together, once every rank has the new value
        if seen.item():
            print("interval", s.ckpt_every_s, flush=True)
            break
"""


@pytest.mark.slow
def test_configure_reaches_the_running_ranks(tmp_path, executors):
    ex = executors(tmp_path / "jobs", slots=2)
    ex.configure("not-running", {"ckpt_interval_s": 5})  # ignored
    ex.launch(req("c", INTERVAL, n=2, env={"TIDAL_CKPT_URL": str(tmp_path / "ck"),
                                           "TIDAL_SHM_DIR": str(tmp_path / "shm")}), time.time())
    deadline = time.monotonic() + 60
    while ex.observe(time.time())["c"].progress.step is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ex.configure("c", {"ckpt_interval_s": 42.5})
    ob = wait_done(ex, "c", timeout_s=60)
    assert [r.exit_code for r in ob.ranks] == [0, 0]
    for r in range(2):
        assert "interval 42.5" in read(ex.log_path("c", r))
    assert json.loads((tmp_path / "jobs" / "c" / "attempt-1" / "control.json").read_text()) == {
        "ckpt_interval_s": 42.5
    }


ABORT_AFTER_CLOSE = """
import os
from tidal.train import Session
with Session(ckpt_every_s=3600) as s:
    s.step_done(1)
os.abort()  # what torch 2.13 + gloo sometimes does in the interpreter's teardown after a clean close
"""

ABORT_BEFORE_CLOSE = """
import os
from tidal.train import Session
s = Session(ckpt_every_s=3600)
s.step_done(1)
os.abort()
"""


@pytest.mark.slow
def test_a_rank_that_aborts_after_closing_cleanly_has_finished(tmp_path, executors):
    ex = executors(tmp_path / "jobs", slots=2)
    ex.launch(req("ok", ABORT_AFTER_CLOSE, n=2, env={"TIDAL_SHM_DIR": str(tmp_path / "shm")}), time.time())
    ob = wait_done(ex, "ok", timeout_s=60)
    assert [r.exit_code for r in ob.ranks] == [-6, -6] and all(r.ended for r in ob.ranks)
    ex.release("ok")
    ex.launch(req("bad", ABORT_BEFORE_CLOSE, n=1, env={"TIDAL_SHM_DIR": str(tmp_path / "shm")}), time.time())
    ob = wait_done(ex, "bad", timeout_s=60)
    assert [r.exit_code for r in ob.ranks] == [-6] and not ob.ranks[0].ended


def test_a_progress_document_is_every_field_in_order_and_the_rate():
    """What the store keeps of a job's progress: each field of ``Progress`` (nothing else the object holds),
    then ``steps_per_s``."""
    from dataclasses import fields

    from tidal.exec.progress import Progress

    p = Progress(start_step=3, step=13, step_s=20.0, first_step=3, first_step_s=10.0, heartbeats=2,
                 phase="training", tiers={"dir": [10, 19.0]})
    doc = p.to_dict()
    assert list(doc) == [f.name for f in fields(Progress)] + ["steps_per_s"]
    assert doc == {**{f.name: getattr(p, f.name) for f in fields(Progress)}, "steps_per_s": 1.0}

"""``tidal demo``: the real command (a subprocess: embedded control plane, real gloo ranks of the GPT
example) in its tiny configuration; Ctrl-C stops every process it started; bad options are refused
before anything starts; the verdict refuses a "recovery" that started from scratch.

Every process started here is stopped at the end, also on failure, by pid (the demo's own and, from
the state dir's launch records, every worker's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from tidal.demo.plane import kill_workers
from tidal.demo.single import (
    DemoError,
    DemoOptions,
    Kill,
    Watch,
    demo,
    summarize,
    summary_table,
)
from tidal.exec import procs

TINY = [
    "--size",
    "tiny",
    "--steps",
    "100",
    "--ckpt-every",
    "10",
    "--kill-at",
    "0.3",
]  # a wide window to kill in


def _ctrl_c_as_in_a_shell() -> None:
    """The demo's Ctrl-C as a terminal gives it: not ignored nor blocked, whatever the test worker that
    starts it inherited (an ignored or blocked SIGINT passes to the children)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def start_demo(args: list[str], out: Path) -> subprocess.Popen:
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-c", "from tidal.cli import main; main()", "demo", *args],
                                stdout=subprocess.PIPE, stderr=f, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                preexec_fn=_ctrl_c_as_in_a_shell)


def stop(proc: subprocess.Popen, state: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    kill_workers(state)


def worker_pids(state: Path) -> list[tuple[int, int | None]]:
    """(pid, start time or None) of every shim and rank any attempt recorded."""
    out = []
    for adir in state.glob("jobs/*/attempt-*"):
        launch = adir / "launch.json"
        if launch.exists():
            out += [(r["pid"], r.get("started")) for r in json.loads(launch.read_text())["ranks"]]
        out += [(json.loads(p.read_text())["pid"], None) for p in adir.glob("pid-*.json")]
    return out


@pytest.mark.slow
def test_demo_kills_a_rank_and_recovers_from_a_checkpoint(tmp_path):
    state = tmp_path / "state"
    proc = start_demo([*TINY, "--json", "--state-dir", str(state), "--timeout", "150"], tmp_path / "demo.err")
    try:
        stdout, _ = proc.communicate(timeout=180)
    finally:
        stop(proc, state)
    narration = (tmp_path / "demo.err").read_text()
    assert proc.returncode == 0, narration
    s = json.loads(stdout)
    assert s["ok"] and s["succeeded"] and s["problems"] == []
    assert s["final_step"] == 100 and s["restarts"] >= 1 and s["attempts"] >= 2
    k = s["killed"]
    assert k["rank"] == 1 and k["attempt"] == 1
    # It really resumed: from a committed step > 0 that the killed attempt had reached, not from scratch.
    assert 0 < s["resumed_from_step"] <= k["reached_step"] and s["resumed_from_step"] % 10 == 0
    assert s["steps_recomputed"] == k["reached_step"] - s["resumed_from_step"]
    assert s["resumed_from_step"] in s["checkpoints"][s["restore_tier"]]
    assert set(s["checkpoints"]) == {"shm", "disk"} and 100 in s["checkpoints"]["disk"]
    assert s["final_loss"] < s["initial_loss"]
    assert 0 < s["ettr"] < 1 and s["recovery_s"] > 0
    # The event log shows the failure and the restart from the checkpoint.
    assert "failure: rank 1 was killed by signal 9: killing the other ranks" in s["events"]
    assert any(e.startswith("running -> backoff: failed: rank 1 was killed by signal 9; restart 1/3")
               for e in s["events"])
    transitions = [e for e in s["events"] if " -> " in e]  # the shm tier freed after the end is said after it
    assert transitions[-1] == "running -> succeeded: all 2 ranks exited 0 at step 100"
    assert "SIGKILL to rank 1" in narration and "recovered" in narration
    # The killed process is named with its shim, whose pid the events print (so it can be found there).
    said = " ".join(narration.split())
    assert f"(pid {k['pid']}, the child of its shim pid {k['shim_pid']} named in the events)" in said
    assert any("ranks running (pids [" in e and str(k["shim_pid"]) in e for e in s["events"])
    assert all(not procs.alive(pid, started) for pid, started in worker_pids(state))


@pytest.mark.slow
def test_ctrl_c_stops_the_plane_and_every_worker(tmp_path):
    state = tmp_path / "state"
    proc = start_demo(
        ["--size", "tiny", "--steps", "1000000", "--ckpt-every", "10", "--state-dir", str(state), "--json"],
        tmp_path / "demo.err",
    )  # --json: all the narration goes to stderr
    try:
        deadline = time.monotonic() + 90
        while len(list(state.glob("jobs/*/attempt-1/pid-*.json"))) < 2:  # both ranks started
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "demo.err").read_text()
            time.sleep(0.1)
        pids = worker_pids(state)
        assert len(pids) == 4 and all(procs.alive(p, t) for p, t in pids)
        proc.send_signal(signal.SIGINT)
        try:  # (its clean-up waits are bounded: the loop 15 s, the workers 10 s, the API server 10 s)
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            err = (tmp_path / "demo.err").read_text()[-3000:]
            raise AssertionError(f"no exit 120 s after Ctrl-C: {err}") from None
    finally:
        stop(proc, state)
    err = (tmp_path / "demo.err").read_text()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "stopped 2 worker process groups" in err
    assert not any(procs.alive(p, t) for p, t in pids)


def test_options_that_cannot_show_a_recovery_are_refused():
    with pytest.raises(
        DemoError,
        match=r"--ckpt-every 50: expected 1 to 49, so that a checkpoint exists before "
        r"the kill at step 50",
    ):
        DemoOptions(steps=100, ckpt_every=50).check()
    with pytest.raises(
        DemoError,
        match=r"--gpus 5: the global batch of 16 sequences \(small model\) must split "
        r"evenly over the ranks; expected one of \[2, 4, 8, 16\]",
    ):
        DemoOptions(gpus=5).check()
    with pytest.raises(DemoError, match="--gpus 1: the demo kills one rank of a gang"):
        DemoOptions(gpus=1).check()
    app = typer.Typer()
    app.command()(demo)
    r = CliRunner().invoke(app, ["--parallel", "tp"])
    assert r.exit_code == 2 and "--parallel 'tp': expected ddp or fsdp" in r.output


def test_the_verdict_refuses_a_restart_from_scratch(tmp_path):
    """Attempt 2 restored nothing (step 0): the job succeeded, but that is no recovery, so not ok."""
    prog = tmp_path / "jobs" / "gpt-demo-1"
    recs = {
        1: [
            {"event": "restore", "step": 0, "tier": None},
            {"event": "step", "step": 1, "loss": 5.5, "time": 1.0},
            {"event": "committed", "step": 10, "tiers": ["shm", "disk"]},
            {"event": "step", "step": 12, "loss": 4.0, "time": 2.0},
        ],
        2: [
            {"event": "restore", "step": 0, "tier": None},
            {"event": "step", "step": 1, "loss": 5.5, "time": 9.0},
            {"event": "step", "step": 20, "loss": 3.0, "time": 10.0},
        ],
    }
    for a, rs in recs.items():
        (prog / f"attempt-{a}" / "progress").mkdir(parents=True)
        (prog / f"attempt-{a}" / "progress" / "progress-r00000.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rs))
    job = {"id": "gpt-demo-1", "state": "succeeded", "attempt": 2, "message": "", "progress": {"step": 20},
           "report": {"restarts": 1, "lost_steps": 2, "lost_work_s": 0.2, "ettr": 0.5, "held_s": 10.0,
                      "productive_s": 5.0}}
    w = Watch(kill=Kill(rank=1, pid=123, shim_pid=122, attempt=1, at_step=12, ckpt_step=10, time_s=5.0))
    s = summarize(job, w, DemoOptions(steps=20, ckpt_every=5, size="tiny"), tmp_path, 10.0, kept=False)
    assert not s["ok"] and s["resumed_from_step"] == 0
    assert s["problems"] == [
        "the restarted attempt did not restore a checkpoint step > 0 (it started from scratch)"
    ]
    assert s["killed"]["reached_step"] == 12 and s["checkpoints"] == {"disk": [10], "shm": [10]}
    assert s["initial_loss"] == 5.5 and s["final_loss"] == 3.0 and s["recovery_s"] == 4.0
    out = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115
    out.print(summary_table(s))
    assert "FAILED: the restarted attempt did not restore a checkpoint step > 0" in out.export_text()

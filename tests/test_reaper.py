"""Nothing a rank starts outlives its attempt, however it detaches: a ``setsid`` child, a daemon that
double-forked into its own session, a process in its own group that ignores SIGTERM. Real processes,
checked by pid in /proc after the rank exits by itself, after a notice, after kill and after release,
on the local executor (its shim, a child subreaper) and on the Ray executor (the rank actor)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import tidal
from iso_plane import worker_uid_base
from plane_proc import Plane, wait_until
from tidal.control.client import TidalClient
from tidal.exec import procs
from tidal.exec.isolation import IsolationConfig
from tidal.exec.local import LocalExecutor
from tidal.exec.protocol import LaunchRequest

# These tests follow the pids a rank reports for what it started; inside the sandbox's PID namespace those
# are not this machine's pids (and the namespace ends them all with the rank: tests/test_sandbox.py), so
# the shim's and the plane's own reaping is tested on unsandboxed ranks, without the default memory
# cgroup (a backstop of its own, tested on its own below).
UNSANDBOXED = IsolationConfig(mode="none", max_memory_bytes=None)

# The rank: three detached helpers, their pids in PIDS ("{rank}" in it: the rank; with MARK, a fourth, and
# all carrying MARK as their TIDAL_PROGRESS_DIR), then "ready"; with END=exit it exits by itself
# once the test has seen the helpers alive (the file PIDS.go; the shim reaps them the moment the rank
# ends), with 75 on SIGTERM, else waits to be killed.
RANK = r"""
import json, os, signal, subprocess, sys, time
out = os.environ["PIDS"].replace("{rank}", os.environ["RANK"])
if "MARK" in os.environ:  # what the helpers carry as TIDAL_PROGRESS_DIR: none (""), or another's (forged)
    os.environ["TIDAL_PROGRESS_DIR"] = os.environ["MARK"]
pids = []
pids.append(subprocess.Popen(["sleep", "1000"], start_new_session=True).pid)             # setsid
r, w = os.pipe()
if os.fork() == 0:                                                                     # double fork
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode()); os.close(w)
        os.execvp("sleep", ["sleep", "1000"])
    os._exit(0)
os.close(w)
os.wait()
pids.append(int(os.read(r, 32)))
pids.append(subprocess.Popen([sys.executable, "-c", "import signal, time; "                # no SIGTERM
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"], process_group=0).pid)
if "MARK" in os.environ:                                          # its shell gone, in the rank's session
    pids.append(int(subprocess.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
                                   capture_output=True, text=True).stdout))
with open(out + ".tmp", "w") as f:
    json.dump(pids, f)
os.replace(out + ".tmp", out)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
print("ready", flush=True)
if os.environ.get("END") == "exit":
    while not os.path.exists(out + ".go"):
        time.sleep(0.01)
    sys.exit(0)
time.sleep(1000)
"""


def wait_for(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def helpers(path: Path) -> list[int]:
    """The rank's helpers, seen alive; then a rank with END=exit may exit (``PIDS.go``)."""
    assert wait_for(path.exists), "the rank never wrote its helpers' pids"
    pids = json.loads(path.read_text())
    assert len(pids) >= 3 and all(procs.alive(p) for p in pids)
    Path(f"{path}.go").touch()
    return pids


def left_alive(pids: list[int]) -> list[int]:
    """The helpers still running once the attempt is over (given a moment to go); those are then
    killed here, so a failing run leaks nothing."""
    wait_for(lambda: not any(procs.alive(p) for p in pids), 5.0)
    alive = [p for p in pids if procs.alive(p)]
    for p in alive:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return alive


@pytest.mark.parametrize("end", ["exit", "notice", "kill", "release"])
def test_nothing_a_rank_detaches_outlives_it_locally(tmp_path, end):
    ex = LocalExecutor(tmp_path / "jobs", slots=1, isolation=UNSANDBOXED)
    pid_file = tmp_path / "pids.json"
    ex.launch(LaunchRequest("j", 1, (sys.executable, "-c", RANK), {"local": 1},
                            env={"PIDS": str(pid_file), "END": end}), time.time())
    try:
        pids = helpers(pid_file)
        if end == "notice":
            ex.signal_stop("j")
        elif end == "kill":
            ex.kill("j")
        if end != "release":
            assert wait_for(lambda: ex.observe(time.time())["j"].done)
            code = ex.observe(time.time())["j"].ranks[0].exit_code
            assert code == {"exit": 0, "notice": 75, "kill": -9}[end]
    finally:
        if end != "release":
            ex.kill("j")
        ex.release("j")
    assert left_alive(pids) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="ranks as their own uid need root, and a Python other uids may run")
def test_a_rank_as_its_own_uid_leaves_nothing_after_kill():
    """The shim (root) reaps what a rank running as a job's uid detached."""
    base = Path(tempfile.mkdtemp(prefix="tidal-reap-"))  # other uids may pass through (not tmp_path's)
    base.chmod(0o711)
    iso = IsolationConfig(mode="none", uid_base=worker_uid_base(), max_memory_bytes=None)
    ex = LocalExecutor(base / "jobs", slots=1, isolation=iso)
    pid_file = ex.home_dir("u") / "pids.json"  # the only place the job's uid may write
    ex.launch(LaunchRequest("u", 1, ("/usr/bin/python3", "-c", RANK), {"local": 1},
                            env={"PIDS": str(pid_file)}), time.time())
    try:
        pids = helpers(pid_file)
        assert {os.stat(f"/proc/{p}").st_uid for p in pids} == {worker_uid_base()}
        ex.kill("u")
        assert wait_for(lambda: ex.observe(time.time())["u"].done)
    finally:
        ex.kill("u")
        ex.release("u")
        shutil.rmtree(base, ignore_errors=True)
    assert left_alive(pids) == []


@pytest.mark.parametrize("then", ["release", "restart"])
def test_the_memory_cgroup_is_the_backstop_when_a_shim_was_killed(tmp_path, then):
    """A shim SIGKILLed by another than the executor (its rank and the rank's helpers went to init), the
    helpers without the attempt's mark and the rank without a uid of its own: the observe ends the rank
    (its pid), its children and the helper whose shell is gone (the shim's session) but not the daemon
    that left the session (no mark of the attempt is left on it); the release kills what is still in the
    rank's memory cgroup; so does a plane restarted before that release, which adopts nothing of it."""
    try:
        ex = LocalExecutor(tmp_path / "jobs", slots=1,
                           isolation=IsolationConfig(mode="none", max_memory_bytes=2**30))
    except ValueError as e:
        pytest.skip(str(e))
    pid_file = tmp_path / "pids.json"
    handle = ex.launch(LaunchRequest("m", 1, (sys.executable, "-c", RANK), {"local": 1},
                                     env={"PIDS": str(pid_file), "MARK": ""}), time.time())
    try:
        pids = helpers(pid_file) + list(ex.worker_pids("m").values())
        os.kill(handle["ranks"][0]["pid"], signal.SIGKILL)  # the shim alone
        assert wait_for(lambda: ex.observe(time.time())["m"].done)
        assert [p for p in pids if procs.alive(p)] == [pids[1]]  # the double-forked daemon, unmarked
        if then == "restart":
            again = LocalExecutor(tmp_path / "jobs", slots=1,
                                  isolation=IsolationConfig(mode="none", max_memory_bytes=2**30))
            left = again.release_unadopted()
            assert left == [f"rank cgroup {ex.cgroups.rank_dir('m', 1, 0).name}: pids [{pids[1]}]"]
            assert again.release_unadopted() == []
    finally:
        ex.release("m")
    assert left_alive(pids) == []
    assert [p.name for p in ex.cgroups.root.iterdir() if p.is_dir()] == []


@pytest.mark.slow
def test_nothing_a_rank_detaches_outlives_it_on_ray(ray_cluster, tmp_path):
    """On Ray: the rank actor reaps what its rank left when the rank exits by itself, and on release of a
    running rank (``end`` before the actor is killed, whose death alone would leave them to init).
    Unsandboxed (the helpers' pids are the node's; a sandbox's PID namespace ends with its rank anyway)."""
    from tidal.exec.ray_exec import RayExecutor

    ray_cluster.state_roots.append(tmp_path / "jobs")
    ex = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60,
                     isolation=UNSANDBOXED)
    files = {end: tmp_path / f"pids-{end}.json" for end in ("exit", "release")}
    for end, f in files.items():
        ex.launch(LaunchRequest(end, 1, (sys.executable, "-c", RANK), {"n1": 1},
                                env={"PIDS": str(f), "END": end}), time.time())
    pids: dict[str, list[int]] = {}
    try:
        pids = {end: helpers(f) for end, f in files.items()}
        assert wait_for(lambda: ex.observe(time.time())["exit"].done)
        assert ex.observe(time.time())["exit"].ranks[0].exit_code == 0
        after_exit = left_alive(pids["exit"])
        assert all(procs.alive(p) for p in pids["release"])
    finally:
        ex.release("exit")
        ex.release("release")
        after_release = left_alive(pids.get("release", []))
    assert (after_exit, after_release) == ([], [])


def killed_shim(ex: LocalExecutor, job: str, rank: int = 0) -> list[int]:
    """SIGKILL the shim of ``rank`` of ``job`` alone (as the OOM killer or an operator would), and wait
    until it has gone: its rank and the rank's helpers are now orphans."""
    shim = ex._jobs[job].ranks[rank].pid
    assert wait_for(lambda: rank in ex.worker_pids(job)), f"{job}: no pid recorded for rank {rank}"
    rank_pid = ex.worker_pids(job)[rank]
    os.kill(shim, signal.SIGKILL)
    assert wait_for(lambda: procs.state(shim) in (None, "Z"))
    assert procs.alive(rank_pid)
    return [rank_pid]


@pytest.mark.parametrize("then", ["observe", "release"])
def test_a_killed_shims_orphans_end_without_a_memory_cgroup(tmp_path, then):
    """A shim SIGKILLed by another than the executor, no memory cgroup: what its rank left re-parents to
    the executor's process (a subreaper) and ends at the next observe (or at release without one); the
    attempt's other rank, under its live shim, and another job go on (though its helpers carry the first
    job's mark); no zombie is left behind."""
    ex = LocalExecutor(tmp_path / "jobs", slots=3, subreaper=True, isolation=UNSANDBOXED)
    assert ex.subreaper and ex.cgroups is None
    files = {job: tmp_path / f"{job}-{{rank}}.json" for job in ("k", "h")}
    forged = {"MARK": str(ex.attempt_dir("k", 1) / "progress")}  # h's helpers carry k's mark
    k0: list[int] = []
    k1: list[int] = []
    h: list[int] = []
    legit: list[int] = []
    agent: subprocess.Popen | None = None
    try:
        for job, f in files.items():
            ex.launch(LaunchRequest(job, 1, (sys.executable, "-c", RANK), {"local": 2 if job == "k" else 1},
                                    env={"PIDS": str(f), **(forged if job == "h" else {})}), time.time())
        # The executor's process's own children, no job's: one in its session and one in a session of its
        # own that ended (their Popen must still read their exit codes), an agent and a daemon (re-parented
        # here).
        own = [subprocess.Popen(["sh", "-c", "exit 3"]),
               subprocess.Popen(["sh", "-c", "exit 4"], start_new_session=True)]
        agent = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        legit.append(agent.pid)
        legit.append(int(subprocess.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
                                        capture_output=True, text=True).stdout))

        def tree(job: str, rank: int) -> list[int]:  # the rank's helpers, the rank, its shim
            pids = helpers(Path(str(files[job]).format(rank=rank)))
            # the shim records the rank's pid after starting it: under load, after the rank's helpers
            assert wait_for(lambda: rank in ex.worker_pids(job)), f"{job}: no pid recorded for rank {rank}"
            return pids + [ex.worker_pids(job)[rank]] + [ex._jobs[job].ranks[rank].pid]

        k0, k1, h = tree("k", 0)[:-1], tree("k", 1), tree("h", 0)
        killed_shim(ex, "k")
        assert all(procs.alive(p) for p in k0)  # orphans, with nothing to reap them
        os.kill(k0[1], signal.SIGKILL)  # the daemon (its parent: this process now) ends by itself meanwhile
        assert wait_for(lambda: all(procs.state(p) == "Z" for p in [k0[1], *(p.pid for p in own)]))
        if then == "observe":
            ranks = ex.observe(time.time())["k"].ranks
            assert ranks[0].exit_code == -9 and ranks[1].alive
            assert all(procs.alive(p) for p in k1 + h)
        else:
            ex.release("k")
        assert [p for p in k0 if procs.state(p) is not None] == []  # killed, and no zombie left
        assert all(procs.alive(p) for p in h + legit)
        assert [p.wait(10) for p in own] == [3, 4]
    finally:
        for job in ("k", "h"):
            ex.kill(job)
            ex.release(job)
        ex.close()
        if agent is not None:
            agent.kill()
            agent.wait(10)
        for p in legit[1:]:  # the daemon, re-parented here
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
    assert left_alive(k0 + k1 + h) == []


# The control plane before its restart: launches attempt 1 of jobs "a" and "d" (one rank each), says so,
# and waits to be killed.
OLD_PLANE = r"""
import sys, time
from tidal.exec.isolation import IsolationConfig
from tidal.exec.local import LocalExecutor
from tidal.exec.protocol import LaunchRequest
ex = LocalExecutor(sys.argv[1], slots=2, subreaper=True,
                   isolation=IsolationConfig(mode="none", max_memory_bytes=None))
for job in ("a", "d"):
    ex.launch(LaunchRequest(job, 1, (sys.executable, "-c", sys.argv[2]), {"local": 1},
                            env={"PIDS": sys.argv[3].replace("{job}", job)}), time.time())
print("launched", flush=True)
time.sleep(1000)
"""


def test_a_restarted_plane_ends_what_a_shim_killed_while_it_was_down_left_and_spares_the_adopted(tmp_path):
    """The plane dies; then the shim of job d is SIGKILLed: d's rank and helpers re-parent to init. The
    restarted plane adopts a and d: d's orphans end at its first observe, a (shim, rank, helpers) runs
    on untouched until it is killed."""
    root, pids = tmp_path / "jobs", str(tmp_path / "{job}-{rank}.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(tidal.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    old = subprocess.Popen([sys.executable, "-c", OLD_PLANE, str(root), RANK, pids], env=env,
                           stdout=subprocess.PIPE, text=True)
    ex = None
    a: list[int] = []
    d: list[int] = []
    try:
        assert old.stdout.readline().strip() == "launched"  # type: ignore[union-attr]
        a = helpers(Path(pids.format(job="a", rank=0)))
        d = helpers(Path(pids.format(job="d", rank=0)))
        launched = {j: json.loads((root / j / "attempt-1" / "launch.json").read_text())["ranks"][0]
                    for j in ("a", "d")}
        shim_said = [root / j / "attempt-1" / "pid-0.json" for j in ("a", "d")]  # after its child started:
        assert wait_for(lambda: all(f.exists() for f in shim_said))  # the rank may have written first
        a += [launched["a"]["pid"], json.loads(shim_said[0].read_text())["pid"]]
        d.append(json.loads(shim_said[1].read_text())["pid"])
        old.kill()
        old.wait(10)
        os.kill(launched["d"]["pid"], signal.SIGKILL)  # while the plane is down
        assert wait_for(lambda: not procs.alive(launched["d"]["pid"]))
        assert all(procs.alive(p) for p in a + d)
        ex = LocalExecutor(root, slots=2, subreaper=True, isolation=UNSANDBOXED)
        assert ex.adopt("a", 1, time.time()) and ex.adopt("d", 1, time.time())
        obs = ex.observe(time.time())
        assert obs["d"].ranks[0].vanished and obs["a"].ranks[0].alive
        assert wait_for(lambda: not any(procs.alive(p) for p in d), 5.0)  # init reaps them
        assert all(procs.alive(p) for p in a)
        ex.release("d")
        assert all(procs.alive(p) for p in a)
        ex.kill("a")
        ex.release("a")
    finally:
        if old.poll() is None:
            old.kill()
            old.wait(10)
        if ex is not None:
            for job in ("a", "d"):
                ex.kill(job)
                ex.release(job)
            ex.close()
    assert left_alive(a + d) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="ranks as their own uid need root, and a Python other uids may run")
def test_a_killed_shims_orphans_without_their_mark_end_by_their_uid():
    """A rank running as the job's uid whose helpers drop TIDAL_PROGRESS_DIR (the double-forked daemon
    then carries no mark of the attempt but its uid): its shim SIGKILLed, the observe ends them all."""
    base = Path(tempfile.mkdtemp(prefix="tidal-reap-"))
    base.chmod(0o711)
    iso = IsolationConfig(mode="none", uid_base=worker_uid_base(), max_memory_bytes=None)
    ex = LocalExecutor(base / "jobs", slots=1, isolation=iso, subreaper=True)
    pid_file = ex.home_dir("u") / "pids-{rank}.json"
    pids: list[int] = []
    try:
        ex.launch(LaunchRequest("u", 1, ("/usr/bin/python3", "-c", RANK), {"local": 1},
                                env={"PIDS": str(pid_file), "MARK": ""}), time.time())
        pids = helpers(Path(str(pid_file).format(rank=0))) + killed_shim(ex, "u")
        assert all(procs.alive(p) for p in pids)
        assert ex.observe(time.time())["u"].ranks[0].exit_code == -9
        assert [p for p in pids if procs.state(p) is not None] == []
    finally:
        ex.kill("u")
        ex.release("u")
        ex.close()
        shutil.rmtree(base, ignore_errors=True)
    assert left_alive(pids) == []


def test_tidal_up_is_the_subreaper_of_what_a_killed_shim_left(tmp_path):
    """A real ``tidal up``: a job's shim SIGKILLed by hand; its rank re-parents to the plane (not init),
    the reconcile loop's observe ends all the rank left, and the plane collects their zombies."""
    plane = Plane(tmp_path, "loop_interval_s: 0.5\nstartup_timeout_s: 60\n"
                            "isolation: {mode: none, max_memory_bytes: null}\n", gpus=1)
    pids: list[int] = []
    try:
        plane.start()
        lab = TidalClient(plane.url, plane.admin.create_tenant("lab", quota_gpus=1, weight=1.0)["token"])
        job = lab.submit({"name": "reap", "gpus": 1, "max_restarts": 0,
                          "command": [sys.executable, "-c", RANK],
                          "env": {"PIDS": str(tmp_path / "pids-{rank}.json")}})["id"]
        pids = helpers(tmp_path / "pids-0.json")
        adir = plane.state / "jobs" / job / "attempt-1"
        shim = json.loads((adir / "launch.json").read_text())["ranks"][0]["pid"]
        pids.append(rank := json.loads((adir / "pid-0.json").read_text())["pid"])
        os.kill(shim, signal.SIGKILL)
        while (p := procs.table().get(rank)) is not None and p.ppid == shim:
            time.sleep(0.001)
        assert p is None or p.state == "Z" or p.ppid == plane.proc.pid  # type: ignore[union-attr]
        wait_until("the rank's leftovers gone", lambda: all(procs.state(q) is None for q in pids), 30)
        wait_until("the job failed", lambda: lab.job(job)["state"] == "failed", 30)
    finally:
        plane.stop()
    assert left_alive(pids) == []


def test_what_re_parents_to_the_plane_and_ends_by_itself_is_collected_on_observe(tmp_path):
    """``tidal up`` is a subreaper: a daemon a serving hook started (the hook runs in a session of its own)
    re-parents to it when the hook exits. When the daemon ends, ``observe`` collects it at once (it must
    not stay a zombie until the plane exits); the plane's own
    children (in its session, or leading one) keep their exit codes for their ``Popen``."""
    ex = LocalExecutor(tmp_path / "jobs", slots=1, subreaper=True, isolation=UNSANDBOXED)
    own: list[subprocess.Popen] = []
    try:
        assert ex.subreaper
        out = subprocess.run(["sh", "-c", "sleep 0.2 >/dev/null 2>&1 & echo $!"], capture_output=True,
                             text=True, start_new_session=True, check=True)
        daemon = int(out.stdout)
        own = [subprocess.Popen(["sh", "-c", "exit 5"], start_new_session=True),
               subprocess.Popen(["sh", "-c", "exit 6"])]
        assert wait_for(lambda: procs.state(daemon) == "Z" and all(procs.state(p.pid) == "Z" for p in own))
        assert procs.table()[daemon].ppid == os.getpid()  # taken in by this process, the subreaper
        ex.observe(time.time())
        assert procs.state(daemon) is None  # collected
        assert [p.wait(timeout=5) for p in own] == [5, 6]  # not taken from their Popen
    finally:
        for p in own:
            with contextlib.suppress(OSError):
                p.kill()
        ex.close()

"""The rank sandbox (tidal.exec.sandbox) on real ranks of the local executor: what a job's ranks share
(``/dev/shm``), what they do not (another job's), nothing a rank leaves outlives it, a signal's exit code,
the start-up check naming the package, the settings and the dashboard's banner when it is off. The
escapes a hostile job tries are in tests/test_escape.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tidal.control.config import ControlConfig
from tidal.exec import procs, sandbox
from tidal.exec.isolation import IsolationConfig, make_dirs
from tidal.exec.local import LocalExecutor
from tidal.exec.protocol import LaunchRequest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="needs bwrap (apt-get install bubblewrap)")
MARK = "sandbox-left-behind-3c9e"
SHARE = """
import os, sys, time
f = "/dev/shm/from-rank-0"
if os.environ["RANK"] == "0":
    open(f, "w").write(os.environ["TIDAL_JOB_ID"])
deadline = time.time() + 30
while not os.path.exists(f) and time.time() < deadline:
    time.sleep(0.05)
print("SEEN", sorted(os.listdir("/dev/shm")), open(f).read() if os.path.exists(f) else None, flush=True)
"""


def _done(ex: LocalExecutor, job: str, timeout_s: float = 60) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ob = ex.observe(time.time())[job]
        if ob.done:
            ex.release(job)
            return [r.exit_code for r in ob.ranks]
        time.sleep(0.05)
    ex.kill(job)
    raise AssertionError(f"{job} still running")


def _log(ex: LocalExecutor, job: str, rank: int = 0) -> str:
    return Path(ex.log_path(job, rank)).read_text()


def test_a_jobs_ranks_share_dev_shm_and_no_other_job_sees_it(tmp_path):
    ex = LocalExecutor(tmp_path / "jobs", slots=2)
    ex.launch(LaunchRequest("a", 1, (sys.executable, "-c", SHARE), {"local": 2}), time.time())
    assert _done(ex, "a") == [0, 0]
    assert "SEEN ['from-rank-0', " in _log(ex, "a", 1) and _log(ex, "a", 1).rstrip().endswith(" a")
    ls = "import os; print('LS', os.listdir('/dev/shm'))"
    ex.launch(LaunchRequest("b", 1, (sys.executable, "-c", ls), {"local": 1}), time.time())
    assert _done(ex, "b") == [0]
    assert "from-rank-0" not in _log(ex, "b")
    assert (ex.shm_dir("a") / "from-rank-0").read_text() == "a"  # the job's shm directory, outside too


def test_nothing_a_sandboxed_rank_detaches_outlives_it(tmp_path):
    """Its PID namespace ends with it: a double-forked, setsid'd helper is gone with the rank."""
    ex = LocalExecutor(tmp_path / "jobs", slots=1)
    helper = f'setsid sh -c "exec sleep 300 {MARK}" </dev/null >/dev/null 2>&1 &'
    cmd = ("/bin/sh", "-c", f"{helper} sleep 0.5; exit 3")
    ex.launch(LaunchRequest("d", 1, cmd, {"local": 1}), time.time())
    assert _done(ex, "d") == [3]
    assert [pid for pid in procs.table() if MARK.encode() in _cmdline(pid)] == []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_signal_reaches_the_rank_and_is_recorded_as_for_an_unsandboxed_one(tmp_path):
    ex = LocalExecutor(tmp_path / "jobs", slots=1)
    code = "import signal, time; print('up', flush=True); time.sleep(300)"
    ex.launch(LaunchRequest("s", 1, (sys.executable, "-c", code), {"local": 1}), time.time())
    deadline = time.monotonic() + 30
    while "up" not in _log(ex, "s") and time.monotonic() < deadline:
        time.sleep(0.05)
    ex.signal_stop("s")  # SIGTERM to the shim's process group: bwrap ignores it, the rank dies of it
    assert _done(ex, "s") == [-15]


def test_tidal_up_refuses_without_bwrap_naming_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    with pytest.raises(ValueError, match=r"apt-get install -y bubblewrap.*isolation: \{mode: none\}"):
        sandbox.find_bwrap()
    with pytest.raises(ValueError, match="bubblewrap"):
        LocalExecutor(tmp_path / "jobs", slots=1)
    LocalExecutor(tmp_path / "jobs", slots=1, isolation=IsolationConfig(mode="none"))  # off: no bwrap needed


def test_settings():
    assert ControlConfig.from_dict({"isolation": {"read_only": ["/data"]}}).isolation.read_only == ("/data",)
    with pytest.raises(ValueError, match="isolation.read_only must be a list of absolute paths"):
        ControlConfig.from_dict({"isolation": {"read_only": ["data"]}})
    with pytest.raises(ValueError, match="isolation.max_file_bytes must be a positive integer or null"):
        IsolationConfig(max_file_bytes="big")
    iso = IsolationConfig().resolved(Path("/tmp"))
    assert isinstance(iso.max_file_bytes, int) and iso.max_file_bytes >= 1 << 30  # auto: half the disk
    assert IsolationConfig(max_file_bytes=None).resolved(Path("/tmp")).max_file_bytes is None
    paths = sandbox.code_paths({"PYTHONPATH": "/srv/code:", "PATH": "/usr/bin"}, ["python3"], sys.executable,
                               ["/data"])
    assert {sys.prefix, sys.base_prefix, "/srv/code", "/data"} <= set(paths)
    assert sandbox.ckpt_dirs({"TIDAL_CKPT_TIERS": '["shm", "/ck/a", "s3://bucket/p"]'}, "/w") == ["/ck/a"]
    assert sandbox.ckpt_dirs({"TIDAL_CKPT_URL": "file:///ck/b"}, "/w") == ["/ck/b"]


def test_a_symlinked_checkpoint_parent_is_refused(tmp_path):
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(OSError, match="symbolic link"):
        make_dirs([str(tmp_path / "link" / "new-ck")], None)
    assert not os.path.exists("/etc/new-ck")


def test_a_checkpoint_parent_swapped_for_a_link_after_the_check_gets_nothing_made_through_it(tmp_path,
                                                                                              monkeypatch):
    """The plane makes the directories a job names through a descriptor of the parent it checked: a swap
    for a link right after the check is seen (refused) and nothing is made where the link leads."""
    from tidal.exec import isolation

    base, elsewhere = tmp_path / "w", tmp_path / "elsewhere"
    base.mkdir()
    elsewhere.mkdir()
    checked = isolation.open_real

    def swapped_after(path):
        fd = checked(path)
        base.rename(tmp_path / "w-before")
        base.symlink_to(elsewhere)
        return fd

    monkeypatch.setattr(isolation, "open_real", swapped_after)
    with pytest.raises(OSError, match="symbolic link"):  # what it opened is no longer at that path
        make_dirs([str(base / "ck" / "a")], None)
    assert list(elsewhere.iterdir()) == []


def test_the_dashboard_shows_a_banner_when_isolation_is_off(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    from control_fakes import FakeClock
    from tidal.control.api import ApiContext, create_app
    from tidal.control.auth import ensure_admin
    from tidal.control.server import isolation_warning
    from tidal.control.store import Store
    from tidal.model import Node

    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    admin, _ = ensure_admin(store, tmp_path, 0.0)
    for config, banner in ((ControlConfig.from_dict({"isolation": "none"}), True), (ControlConfig(), False)):
        ctx = ApiContext(store, [Node("local", 1)], lambda j, r: None, FakeClock(),
                         warning=isolation_warning(config, euid=0))
        pool = TestClient(create_app(ctx)).get("/v1/dashboard/pool",
                                               headers={"Authorization": f"Bearer {admin}"})
        assert pool.status_code == 200
        assert (pool.json()["warning"] is not None and "isolation is off" in pool.json()["warning"]) == banner


def test_tidal_up_says_first_that_isolation_is_off(tmp_path):
    """A real ``tidal up`` with ``isolation: none``: its first line is the warning; without it, none."""
    from plane_proc import Plane, wait_until

    for config, warned in (("isolation: none\n", True), ("{}\n", False)):
        (tmp_path / str(warned)).mkdir()
        plane = Plane(tmp_path / str(warned), config)
        try:
            plane.start()
            out = plane.outputs[-1]
            wait_until("tidal up's first lines", lambda out=out: "dashboard:" in out.read_text(), 30)
            first = out.read_text().splitlines()[0]
            assert first.startswith("warning: isolation is off (isolation: {mode: none})") == warned, first
            assert first.startswith("tidal up: http://") != warned, first
        finally:
            plane.stop()


def test_a_link_the_job_names_as_code_does_not_uncover_the_state_dir(tmp_path):
    """A job plants, in a directory it may write outside the state dir, a link to the jobs dir; a later job
    names a file through that link in its command (and in ``PYTHONPATH``). The sandbox binds the directories
    of what the command names read-only, but never one that resolves into what no rank sees: the rank, left
    root (as an operator's own run: no capability, only root's own files), cannot read the plane's
    checkpoint-agent key through it."""
    ex = LocalExecutor(tmp_path / "state" / "jobs", slots=1, run_as_self=True)
    out = tmp_path / "outside"
    out.mkdir()
    plant = f"ln -s {ex.root.resolve()} s && echo PLANTED"
    ex.launch(LaunchRequest("plant", 1, ("/bin/sh", "-c", plant), {"local": 1}, str(out)), time.time())
    assert _done(ex, "plant") == [0] and "PLANTED" in _log(ex, "plant") and (out / "s").is_symlink()
    key = out / "s" / ".ckpt-agent.key"
    secret = (ex.root / ".ckpt-agent.key").read_text().strip()
    probe = ("/bin/sh", "-c", 'cat "$1"; ls "$2"; echo PROBED', "sh", str(key), str(out / "s"))
    env = {"PYTHONPATH": str(out / "s")}
    ex.launch(LaunchRequest("peek", 1, probe, {"local": 1}, None, env), time.time())
    _done(ex, "peek")
    log = _log(ex, "peek")
    assert "PROBED" in log and secret not in log and ".uids.json" not in log and "plant" not in log, log


def test_a_workdir_swapped_for_a_link_after_the_check_binds_what_was_checked(tmp_path):
    """The plane checks what a rank's sandbox binds, then bwrap binds it: a job that swaps its workdir for a
    link to the state dir in between must not get the state dir. The sandbox holds a descriptor of each
    directory it checked and bwrap binds that descriptor (``--bind-fd``), so the rank sees the directory
    that was checked, under its old name."""
    state, work = tmp_path / "state", tmp_path / "work"
    for d in (state, work, tmp_path / "attempt" / "progress"):
        d.mkdir(parents=True)
    (state / "admin.token").write_text("state-secret-71c4")
    (work / "mine").write_text("mine")
    binds = sandbox.Binds(named=(str(work),), hidden=(str(state),), attempt=str(tmp_path / "attempt"), own=(),
                          shm=None)
    probe = ["/bin/sh", "-c", 'ls "$0"; cat "$0/admin.token"; echo PROBED', str(work)]
    cmd = sandbox.command(sandbox.find_bwrap(), probe, binds, env={}, python=sys.executable, owner=None,
                          cwd="/")
    work.rename(tmp_path / "work-before")  # the swap, between the check and bwrap's bind
    work.symlink_to(state)
    try:
        got = subprocess.run(cmd, pass_fds=sandbox.bind_fds(cmd), capture_output=True, text=True, timeout=60)
    finally:
        sandbox.close_fds(cmd)
    assert "PROBED" in got.stdout and "mine" in got.stdout, got.stdout + got.stderr
    assert "state-secret-71c4" not in got.stdout and "admin.token\n" not in got.stdout


def test_a_checkpoint_dir_inside_the_workdir_is_not_a_mount_point_made_through_a_swapped_link(tmp_path):
    """A job names a checkpoint directory inside its workdir through a link of its own, then swaps the
    link for one to a directory its uid cannot write: bwrap (root) would make the mount point there
    through the workdir's bind. A directory below another one the job names is not bound again (it is
    seen through the one above)."""
    work, zone = tmp_path / "w", tmp_path / "zone"
    for d in (work / "real" / "x", zone, tmp_path / "attempt" / "progress"):
        d.mkdir(parents=True)
    (work / "lnk").symlink_to("real")
    binds = sandbox.Binds(named=(str(work), str(work / "lnk" / "x")), hidden=(),
                          attempt=str(tmp_path / "attempt"), own=(), shm=None)
    cmd = sandbox.command(sandbox.find_bwrap(), ["/bin/sh", "-c", "echo RAN"], binds, env={},
                          python=sys.executable, owner=None, cwd="/")
    (work / "lnk").unlink()  # the swap, between the check and bwrap's start
    (work / "lnk").symlink_to("../zone")
    try:
        got = subprocess.run(cmd, pass_fds=sandbox.bind_fds(cmd), capture_output=True, text=True, timeout=60)
    finally:
        sandbox.close_fds(cmd)
    assert "RAN" in got.stdout, got.stderr
    assert list(zone.iterdir()) == []


def test_a_notice_sent_while_the_sandbox_is_made_reaches_the_rank(tmp_path):
    """The shim's child (bwrap, then the sandbox's entry) must outlive a notice, but a notice sent then is
    the rank's: it stays pending until the entry hands over, so the rank ends at once (not at its kill
    deadline, the command never started)."""
    from tidal.exec.shim import set_limits

    ran = tmp_path / "ran"
    notice_then_enter = (  # the executor's notice lands between the fork and the entry
        "import os, signal, sys; os.kill(os.getpid(), signal.SIGTERM); "
        f"os.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {sandbox.ENTER!r}, '-1', '-1', "
        f"'touch', {str(ran)!r}])")
    p = subprocess.run([sys.executable, "-I", "-S", "-c", notice_then_enter],
                       preexec_fn=lambda: set_limits({}, sandbox=True), timeout=60)
    assert p.returncode == -15 and not ran.exists()

"""Jobs on the local executor are isolated from the control plane and from each other.

Real processes through a plane built in-process (``server.build``) and driven step by step: a hostile
job tries to read the admin token, the database, another tenant's log and checkpoint, and a secret
in the plane's own environment, and writes what it could read to its own log; as root the jobs run
as their own uids. File modes of the state dir; an ended job's shared-memory directory is freed;
orphans are freed at start.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from iso_plane import ROOT, planes, rank_log, run, worker_uid_base
from tidal.control.auth import create_tenant
from tidal.control.config import ControlConfig
from tidal.control.spec import parse_spec
from tidal.exec.isolation import IsolationConfig

pytestmark = pytest.mark.slow
SECRET = "plane-secret-7f3a9c"

VICTIM = (
    'echo "VICTIM-LOG-MARK"; mkdir -p "$TIDAL_CKPT_URL" && echo "VICTIM-CKPT-MARK" > "$TIDAL_CKPT_URL/data"; '
    'echo "VICTIM-SHM-MARK" > "$TIDAL_SHM_DIR/state"'
)
# Reads what it should not, by the paths a tenant can guess and by walking up from its progress dir.
HOSTILE = r'''
up="$TIDAL_PROGRESS_DIR/../../../.."
for f in "$STATE/admin.token" "$up/admin.token" "$STATE/tidal.db" "$STATE/api.url" "$STATE/jobs/.uids.json" \
         "$STATE/jobs/$VICTIM/logs/rank-0.log" "$STATE/jobs/$VICTIM/ckpt/data" "$VICTIM_SHM/state"; do
  if c=$(cat "$f" 2>/dev/null); then echo "READ $f: $c"; else echo "denied $f"; fi
done
for d in "$STATE" "$up" "$STATE/jobs" "$STATE/jobs/$VICTIM" "$STATE/jobs/$VICTIM/ckpt"; do
  if l=$(ls -A "$d" 2>/dev/null); then echo "LISTED $d: $l"; else echo "denied listing $d"; fi
done
echo "uid $(id -u) gid $(id -g) groups $(id -G)"
echo "HOME=$HOME"
env | sort | sed 's/^/ENV /'
ulimit -c | sed 's/^/CORE /'
'''


def _submit(plane, tenant: str, name: str, script: str, env: dict | None = None) -> str:
    spec = parse_spec({"name": name, "gpus": 1, "max_restarts": 0, "command": ["/bin/sh", "-c", script],
                       "env": env or {}})
    return plane.store.submit(tenant, spec.model_dump(), time.time()).id


@pytest.fixture
def plane_factory(monkeypatch):
    monkeypatch.setenv("TIDAL_TEST_SECRET", SECRET)  # in the plane's environment only
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with planes() as make:
        yield make


def _hostile_run(plane) -> tuple[str, str, str]:
    create_tenant(plane.store, "alice", quota_gpus=1)
    create_tenant(plane.store, "bob", quota_gpus=1)
    victim = _submit(plane, "alice", "victim", VICTIM)
    run(plane, victim)
    assert plane.store.job(victim).state == "succeeded", rank_log(plane, victim)
    assert "VICTIM-LOG-MARK" in rank_log(plane, victim)
    shm = plane.executor.shm_dir(victim)
    hostile = _submit(plane, "bob", "peek", HOSTILE, {"STATE": str(plane.state_dir), "VICTIM": victim,
                                                      "VICTIM_SHM": str(shm)})
    run(plane, hostile)
    return victim, hostile, rank_log(plane, hostile)


def test_environment_is_an_allow_list(plane_factory):
    """Whoever runs it: nothing of the plane's environment but the allow-list reaches a job."""
    plane = plane_factory()
    _, hostile, log = _hostile_run(plane)
    env = dict(line[4:].split("=", 1) for line in log.splitlines() if line.startswith("ENV ") and "=" in line)
    assert SECRET not in log
    assert "TIDAL_TEST_SECRET" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    allowed = {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH",
               "CUDA_HOME", "HOME", "TMPDIR", "USER", "LOGNAME", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
               "PYTHONUNBUFFERED", "STATE", "VICTIM", "VICTIM_SHM", "PWD", "SHLVL", "_"}
    assert set(env) - allowed - {k for k in env if k.startswith("TIDAL_")} - {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES"} == set()
    assert env["HOME"] == str(plane.executor.home_dir(hostile))
    assert env["TIDAL_SHM_DIR"] == str(plane.executor.shm_dir(hostile))
    assert "TIDAL_TOKEN" not in env and "TIDAL_STATE_DIR" not in env
    assert "CORE 0" in log  # no core dumps


@pytest.mark.skipif(not ROOT, reason="jobs run as their own uid only when tidal up runs as root; as another "
                    "user they run as that user and can read what it can (docs/control.md)")
def test_hostile_job_reads_nothing_as_its_own_uid(plane_factory):
    plane = plane_factory(uid_base=worker_uid_base())
    victim, hostile, log = _hostile_run(plane)
    token = (plane.state_dir / "admin.token").read_text().strip()
    assert token not in log and SECRET not in log
    assert "READ " not in log and "LISTED " not in log and log.count("denied ") == 13, log
    assert "VICTIM-LOG-MARK" not in log and "VICTIM-CKPT-MARK" not in log and "VICTIM-SHM-MARK" not in log
    ids = {j: plane.store.job(j).handle["uid"] for j in (victim, hostile)}
    base = worker_uid_base()
    assert ids[victim] != ids[hostile] and all(base <= u < base + 65536 for u in ids.values())
    assert f"uid {ids[hostile]} gid {ids[hostile]} groups {ids[hostile]}\n" in log  # no supplementary groups
    # the job owns what it writes; the plane (root) still reads it all
    ex = plane.executor
    for p in (ex.home_dir(victim), ex.attempt_dir(victim, 1) / "progress", ex.job_dir(victim) / "ckpt"):
        st = os.stat(p)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ids[victim], 0o700), p
    assert (ex.job_dir(victim) / "ckpt" / "data").read_text() == "VICTIM-CKPT-MARK\n"
    st = os.stat(ex.log_path(victim, 0))
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)


@pytest.mark.skipif(not ROOT, reason="jobs run as their own uid only when tidal up runs as root")
def test_a_location_under_the_tenants_prefix_is_made_for_its_uid(plane_factory):
    """A checkpoint directory under ``<state dir>/tenants/<tenant>/`` (its own prefix): the plane makes it
    for the job's uid (which cannot create anything in the state dir), under root's 0700 directories
    (the uid reaches it through its sandbox's binds); another tenant's job cannot read or list it."""
    plane = plane_factory(uid_base=worker_uid_base())
    create_tenant(plane.store, "alice", quota_gpus=1)
    create_tenant(plane.store, "bob", quota_gpus=1)
    loc = plane.state_dir / "tenants" / "alice" / "runs" / "a"
    spec = parse_spec({"name": "own", "gpus": 1, "max_restarts": 0, "checkpoint": {"url": str(loc)},
                       "command": ["/bin/sh", "-c", 'echo ALICE-CKPT > "$TIDAL_CKPT_URL/data"']})
    job = plane.store.submit("alice", spec.model_dump(), time.time()).id
    run(plane, job)
    assert plane.store.job(job).state == "succeeded", rank_log(plane, job)
    uid = plane.store.job(job).handle["uid"]
    assert (loc / "data").read_text() == "ALICE-CKPT\n"
    assert (os.stat(loc).st_uid, stat.S_IMODE(os.stat(loc).st_mode)) == (uid, 0o700)
    for d in (loc.parent, loc.parent.parent, loc.parent.parent.parent):
        assert (os.stat(d).st_uid, stat.S_IMODE(os.stat(d).st_mode)) == (0, 0o700), d
    peek = _submit(plane, "bob", "peek",
                   f'cat {loc}/data || echo "denied read"; ls {loc.parent} || echo "denied ls"')
    run(plane, peek)
    log = rank_log(plane, peek)
    assert "ALICE-CKPT" not in log and "denied read" in log and "denied ls" in log, log


@pytest.mark.skipif(not ROOT, reason="needs root to switch uids")
def test_a_file_the_plane_writes_for_a_job_is_read_only_to_it(tmp_path):
    """``control.json``: the job's uid reads it (its group), cannot change or grow it."""
    import subprocess

    from tidal.exec.files import write_json

    d = Path(tempfile.mkdtemp(prefix="tidal-ro-"))
    try:
        d.chmod(0o711)
        f = d / "control.json"
        write_json(f, {"ckpt_interval_s": 5}, (200123, 200123))
        st = os.stat(f)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 200123, 0o640)
        out = subprocess.run(["/bin/sh", "-c", f'cat {f}; echo junk >> {f} && echo WROTE || echo denied'],
                             user=200123, group=200123, extra_groups=[], capture_output=True, text=True)
        assert out.stdout == '{"ckpt_interval_s": 5}denied\n', out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_state_dir_file_modes(plane_factory):
    plane = plane_factory()
    victim, _, _ = _hostile_run(plane)
    sd, ex = plane.state_dir, plane.executor
    assert stat.S_IMODE(os.stat(sd).st_mode) == 0o700
    for f in ("admin.token", "tidal.db"):
        assert stat.S_IMODE(os.stat(sd / f).st_mode) == 0o600, f
    for d in (sd / "jobs", ex.job_dir(victim), ex.job_dir(victim) / "logs", ex.home_dir(victim),
              ex.job_dir(victim) / "ckpt"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    # a job's uid (sandboxed as root) passes through its attempt directory to its progress directory
    assert stat.S_IMODE(os.stat(ex.attempt_dir(victim, 1)).st_mode) == (0o711 if ROOT else 0o700)
    for f in (ex.log_path(victim, 0), ex.attempt_dir(victim, 1) / "launch.json",
              ex.attempt_dir(victim, 1) / "exit-0.json", ex.attempt_dir(victim, 1) / "pid-0.json"):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_shm_of_an_ended_job_is_freed(plane_factory):
    """No checkpoint (or a durable newest one): freed at the next sweep after it ends; a newest step
    only in node memory: kept for the retention time, then freed."""
    plane = plane_factory(shm_retention_s=30)
    create_tenant(plane.store, "alice", quota_gpus=2)
    job = _submit(plane, "alice", "shm", 'echo data > "$TIDAL_SHM_DIR/state"; test -s "$TIDAL_SHM_DIR/state"')
    run(plane, job)
    assert plane.store.job(job).state == "succeeded", rank_log(plane, job)
    shm = plane.executor.shm_dir(job)
    assert shm is not None and not shm.exists()  # no checkpoint at all: nothing to keep
    # a job whose newest step was only in node memory: kept until the retention ends
    job2 = _submit(plane, "alice", "shm2", 'echo data > "$TIDAL_SHM_DIR/state"; '
                   'echo \'{"event": "committed", "step": 5, "tiers": ["shm"], "time": 1}\' '
                   '> "$TIDAL_PROGRESS_DIR/progress-r00000.jsonl"; sleep 0.5')
    run(plane, job2)
    assert plane.store.job(job2).ckpt_step == 5
    now = time.time()
    assert plane.controller.sweep_shm(now, force=True) == [] and plane.executor.shm_dir(job2).exists()
    assert plane.controller.sweep_shm(now + 31, force=True) == [job2]
    assert not plane.executor.shm_dir(job2).exists()
    events = [e.message for e in plane.store.events(job_id=job2) if e.kind == "shm_freed"]
    assert events and "retention" in events[0]


def test_orphan_shm_dirs_are_freed_at_start(plane_factory):
    plane = plane_factory()
    create_tenant(plane.store, "alice", quota_gpus=2)
    done = _submit(plane, "alice", "done", "true")
    run(plane, done)
    plane.store.update(done, ckpt_step=3, progress={"ckpt_step": 3, "durable_ckpt_step": 3})
    waiting = _submit(plane, "alice", "waiting", "true")  # pending: its directory (if any) stays
    root = plane.executor.shm_root
    for name in (done, "ghost-99", waiting):
        (root / name).mkdir(parents=True, exist_ok=True, mode=0o700)
        (root / name / "state").write_text("x")
    plane.store.close()
    again = plane_factory()  # a restart of tidal up on the same state dir
    assert not (root / done).exists() and not (root / "ghost-99").exists()
    assert (root / waiting / "state").exists()
    assert again.executor.shm_root == root


def test_tidal_up_says_when_isolation_is_off():
    """Root reads any file whatever its mode: unsandboxed without uid_base a job can read the admin token,
    and `tidal up` says so at start instead of implying the modes protect anything; sandboxed (the
    default, as root with uids from 200000) it says nothing."""
    from tidal.control.server import isolation_warning

    off = ControlConfig.from_dict({"isolation": "none"})
    assert off.isolation == IsolationConfig(mode="none")
    assert "jobs run unsandboxed as root" in isolation_warning(off, euid=0)
    assert "as their own uids" in isolation_warning(ControlConfig.from_dict(
        {"isolation": {"mode": "none", "uid_base": 200000}}), euid=0)
    assert "as tidal up's user" in isolation_warning(off, euid=1000)
    assert isolation_warning(None, euid=0) is None
    assert isolation_warning(ControlConfig(), euid=0) is None
    base = IsolationConfig().resolved(Path("/tmp"), euid=0).uid_base  # a range per plane, from 200000
    assert base is not None and base >= 200000 and (base - 200000) % 65536 == 0
    assert base == IsolationConfig().resolved(Path("/tmp"), euid=0).uid_base != IsolationConfig().resolved(
        Path("/var"), euid=0).uid_base
    assert IsolationConfig().resolved(Path("/tmp"), euid=1000).uid_base is None
    assert IsolationConfig(mode="none").resolved(Path("/tmp"), euid=0).uid_base is None
    with pytest.raises(ValueError, match="isolation.mode must be one of"):
        ControlConfig.from_dict({"isolation": {"mode": "off"}})
    with pytest.raises(ValueError, match="isolation must be a mapping of settings or 'none'"):
        ControlConfig.from_dict({"isolation": "off"})


def _memory_cgroups_usable() -> str | None:
    from tidal.exec import cgroups

    probe = Path(tempfile.mkdtemp(prefix="tidal-cg-"))
    try:
        g = cgroups.find(probe)
        os.rmdir(g.root)
        return None
    except (ValueError, OSError) as e:
        return str(e)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


HOG = ("import sys; sys.stdout.write('HOG-START\\n'); sys.stdout.flush(); "
       "b = bytearray(600 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('HOG-SURVIVED')")


def test_memory_limit_kills_only_the_rank_over_it(plane_factory):
    """isolation.max_memory_bytes: a rank that allocates past it is killed by the kernel (its log says
    so); a rank within it runs; the plane refuses to start when no memory cgroup can be made."""
    why = _memory_cgroups_usable()
    if why is not None:  # the refusal is what a user gets then: one line saying why
        with pytest.raises(SystemExit, match="isolation.max_memory_bytes needs a memory cgroup"):
            plane_factory(max_memory_bytes=256 * 2**20)
        pytest.skip(f"no memory cgroup here: {why}")
    plane = plane_factory(max_memory_bytes=256 * 2**20)
    create_tenant(plane.store, "alice", quota_gpus=2)
    hog = _submit(plane, "alice", "hog", f"exec {sys.executable} -c \"{HOG}\"")
    fine = _submit(plane, "alice", "fine", f"exec {sys.executable} -c \"print('FINE-DONE')\"")
    run(plane, hog, fine)
    assert plane.store.job(fine).state == "succeeded" and "FINE-DONE" in rank_log(plane, fine)
    log = rank_log(plane, hog)
    assert plane.store.job(hog).state == "failed" and "HOG-START" in log and "HOG-SURVIVED" not in log
    assert "killed for memory: over isolation.max_memory_bytes (268435456 bytes)" in log
    assert [p.name for p in plane.executor.cgroups.root.iterdir() if p.is_dir()] == []  # rank cgroups removed


def test_memory_limit_is_checked():
    with pytest.raises(ValueError, match="isolation.max_memory_bytes must be an integer >= 67108864"):
        IsolationConfig(max_memory_bytes=1000)
    with pytest.raises(ValueError, match="max_memory_bytes"):
        IsolationConfig(max_memory_bytes=True)

"""Escapes a tenant's job tries from inside its sandbox (tidal.exec.sandbox), on a real plane
(``server.build``, driven step by step) with real ranks: while another tenant's rank runs, the job reads
the admin token, the database, the other tenant's log, fence and progress, that rank's
``/proc/<pid>/environ`` and ``cmdline`` (by its real pid and by scanning ``/proc``), the plane's own
environment, and swaps its own log for a link to the token; and a job that swaps its checkpoint
directory for a link to the plane's data, which the quota count must not walk. Each must fail. The same
script run with ``isolation: none`` reads the token (as root or as the plane's user alike): the probes
do detect a leak.

The same two runs on the Ray executor (the session's Ray cluster, tests/ray_cluster.py), whose rank
actors start each rank in the same sandbox on its node; there, without ``uid_base``, a rank of a root
plane stays root but holds no capability. What holds with uids on Ray: tests/test_ray_isolation.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from iso_plane import ROOT, planes, rank_log, run
from tidal.control import locations
from tidal.control.auth import create_tenant
from tidal.control.server import isolation_warning
from tidal.control.spec import parse_spec
from tidal.exec import procs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None,
                                                   reason="needs bwrap (apt-get install bubblewrap)")]
SECRET = "plane-secret-5e1d"
VICTIM_SECRET = "victim-secret-9b2c"
CMDLINE_MARK = "victim-cmdline-4f7a"

VICTIM = ["/bin/sh", "-c", 'echo x > "$TIDAL_PROGRESS_DIR/mark"; echo VICTIM-LOG-MARK; exec sleep 120',
          CMDLINE_MARK]
# Each probe prints READ (it got something) or denied; OWN proves the probing itself works.
HOSTILE = r'''
probe() {
  c=$(cat "$1" 2>/dev/null | tr '\0' ' ')
  if [ -n "$c" ]; then echo "READ $1: $c"; else echo "denied $1"; fi
}
probe "$STATE/admin.token"; probe "$STATE/tidal.db"; probe "$STATE/api.url"; probe /etc/shadow
if [ -n "$RAY_GCS" ]; then  # Ray's protocol, spoken to the cluster's GCS: would run code as its workers
  "$PY" -c 'import sys; from tidal.exec.ray_auth import anonymous_refused as r
print({True: "denied ray", None: "no answer from ray"}.get(r(sys.argv[1]), "READ ray"))' "$RAY_GCS"
fi
V="$STATE/jobs/$VICTIM"
probe "$V/logs/rank-0.log"; probe "$V/ckpt/fence.json"; probe "$V/attempt-1/launch.json"
for f in "$V"/attempt-1/progress/*; do probe "$f"; done
for p in $VICTIM_PIDS $PLANE_PID; do probe "/proc/$p/environ"; probe "/proc/$p/cmdline"; done
for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do
  if grep -q -e "$VICTIM_SECRET_RE" -e "$CMDLINE_RE" -e 'TIDAL_TEST_SECRE[T]' "$f" 2>/dev/null; then
    echo "READ $f"
  fi
done
echo "PROCS $(ls -d /proc/[0-9]* | wc -l)"
LOG="$STATE/jobs/$TIDAL_JOB_ID/logs/rank-0.log"
if rm -f "$LOG" 2>/dev/null && ln -s "$STATE/admin.token" "$LOG" 2>/dev/null; then
  echo "READ swapped $LOG"
else
  echo "denied swap"
fi
echo own > "$HOME/own" && [ "$(cat "$HOME/own")" = own ] && echo "OWN home"
grep CapEff /proc/self/status
'''


def _submit(plane, tenant: str, name: str, command: list[str], env: dict | None = None, **more) -> str:
    spec = parse_spec({"name": name, "gpus": 1, "max_restarts": 0, "command": command, "env": env or {},
                       **more})
    return plane.store.submit(tenant, spec.model_dump(), time.time()).id


def _running(plane, job: str, timeout_s: float = 60) -> list[int]:
    """Step the plane until the job's rank has started; its processes' real pids."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plane.controller.step(time.time())
        pids = plane.executor.worker_pids(job)
        if 0 in pids and "VICTIM-LOG-MARK" in rank_log(plane, job):
            return sorted(procs.descendants([pids[0]]) | {pids[0]})
        time.sleep(0.05)
    raise AssertionError(f"{job} did not start: {rank_log(plane, job)}")


def _escape(plane, env: dict | None = None, args: tuple[str, ...] = ()) -> tuple[str, str, str]:
    """Run the victim, then the hostile job beside it (with ``env``, ``args`` after its script); (the
    hostile job, its log, the admin token)."""
    create_tenant(plane.store, "alice", quota_gpus=1)
    create_tenant(plane.store, "bob", quota_gpus=1)
    victim = _submit(plane, "alice", "victim", VICTIM, {"VICTIM_SECRET": VICTIM_SECRET})
    pids = _running(plane, victim)
    hostile = _submit(plane, "bob", "peek", ["/bin/sh", "-c", HOSTILE, "sh", *args], {**(env or {}),
        "STATE": str(plane.state_dir), "VICTIM": victim, "VICTIM_PIDS": " ".join(map(str, pids)),
        "PLANE_PID": str(os.getpid()), "PY": sys.executable,
        "RAY_GCS": getattr(plane.executor, "address", "") or "",
        # patterns that match the markers and not themselves (the probe greps its own environment too)
        "VICTIM_SECRET_RE": f"{VICTIM_SECRET[:-1]}[{VICTIM_SECRET[-1]}]",
        "CMDLINE_RE": f"{CMDLINE_MARK[:-1]}[{CMDLINE_MARK[-1]}]"})
    run(plane, hostile)
    plane.executor.kill(victim)
    return hostile, rank_log(plane, hostile), (plane.state_dir / "admin.token").read_text().strip()


def _procs(log: str) -> int:
    """How many processes the probe saw in /proc."""
    return int(log.split("PROCS ", 1)[1].split()[0])


@pytest.fixture
def plane_factory(monkeypatch):
    monkeypatch.setenv("TIDAL_TEST_SECRET", SECRET)  # in the plane's environment only
    with planes() as make:
        yield make


def _contained(plane, hostile: str, log: str, token: str) -> None:
    assert "OWN home" in log, log  # the probes themselves work
    assert "READ" not in log and token not in log and SECRET not in log, log
    assert VICTIM_SECRET not in log and CMDLINE_MARK not in log and "VICTIM-LOG-MARK" not in log
    assert log.count("denied /proc/") >= 2 * 3  # the victim's pids outside its sandbox and the plane's
    assert _procs(log) <= 6, log  # its own sandbox's init, shell, and the probe's pipeline
    assert "denied swap" in log
    assert "CapEff:\t0000000000000000" in log, log  # as root: no capability left (its uid's, or dropped)
    log_file = Path(plane.executor.log_path(hostile, 0))
    assert log_file.is_file() and not log_file.is_symlink()


def test_a_sandboxed_job_reaches_nothing_of_the_plane_or_another_tenant(plane_factory):
    plane = plane_factory()
    _contained(plane, *_escape(plane))
    if ROOT:  # a job runs as its tenant's own uid (default uid_base 200000)
        assert all(j.handle["uid"] >= 200000 for j in plane.store.jobs())


def test_the_same_escapes_succeed_without_the_sandbox(plane_factory):
    """The control run: with ``isolation: none`` (and no uids) the same script swaps its log for a link
    to the admin token (so reading its log gives the token), so the test above can fail."""
    plane = plane_factory(mode="none")
    hostile, log, token = _escape(plane)
    assert Path(plane.executor.log_path(hostile, 0)).is_symlink() and log.strip() == token


def test_the_hosts_proc_named_as_code_is_left_out(plane_factory):
    """The host's /proc (every process's command line) named as code, in
    ``PYTHONPATH`` and by an argument: left out of the sandbox, the rank sees its own /proc only."""
    plane = plane_factory()
    _contained(plane, *_escape(plane, {"PYTHONPATH": "/proc:/proc/1"}, ("/proc/cpuinfo",)))


def test_a_job_naming_the_hosts_proc_dev_sys_or_root_as_its_directory_is_refused(plane_factory):
    """Named as a workdir (bound read-write), the host's /proc, /dev, a cgroup tree or / would show the
    rank every process's command line and the host's devices and cgroups: the launch fails, naming it."""
    plane = plane_factory()
    create_tenant(plane.store, "bob", quota_gpus=4)
    jobs = {}
    for d in ("/proc", "/dev", "/sys/fs/cgroup", "/"):
        spec = parse_spec({"name": "dir", "gpus": 1, "max_restarts": 0, "workdir": d,
                           "command": ["true"]})
        jobs[d] = plane.store.submit("bob", spec.model_dump(), time.time()).id
    run(plane, *jobs.values())
    for d, job in jobs.items():
        row = plane.store.job(job)
        assert row.state == "failed" and f"{d} is on or holds a kernel filesystem" in row.message, row.message


def test_a_sandboxed_job_on_ray_reaches_nothing_either(ray_cluster, plane_factory):
    """The same job suite under the Ray executor: each rank sandboxed by its actor, on its node."""
    plane = plane_factory(ray=ray_cluster)
    hostile, log, token = _escape(plane)
    _contained(plane, hostile, log, token)
    assert all(j.handle["executor"] == "ray" for j in plane.store.jobs())
    assert "denied ray" in log and plane.executor.token_auth  # the cluster refuses a job: it has no token
    if ROOT:  # root workers: a uid per tenant by default, as on the local executor; no warning, no banner
        assert all(j.handle["uid"] >= 200000 for j in plane.store.jobs())
        assert isolation_warning(plane.controller.config, executor=plane.executor) is None


def test_on_ray_the_same_escapes_succeed_without_the_sandbox(ray_cluster, plane_factory):
    plane = plane_factory(ray=ray_cluster, mode="none")
    hostile, log, token = _escape(plane)
    assert Path(plane.executor.log_path(hostile, 0)).is_symlink() and log.strip() == token


def test_on_ray_no_rank_sees_rays_own_directory(ray_cluster, plane_factory):
    """Ray's directory on a node (``/tmp/ray``: its sockets, ports files and logs, in directories every user
    may write, where a rank could unlink the raylet's socket or plant links for Ray's root processes) is
    covered in every rank's sandbox, as the state dir is: a job naming ``/tmp`` as its workdir finds none."""
    plane = plane_factory(ray=ray_cluster)
    create_tenant(plane.store, "bob", quota_gpus=1)
    session = ray_cluster.cluster.head_node.get_session_dir_path()
    probe = ('ls "$0/sockets" >/dev/null 2>&1 && echo "READ sockets"; touch "$0/logs/planted" 2>/dev/null '
             '&& echo "READ planted"; ls /tmp >/dev/null && echo PROBED')
    try:
        job = _submit(plane, "bob", "ray-dir", ["/bin/sh", "-c", probe, session], workdir="/tmp")
        run(plane, job)
    finally:
        Path(session, "logs", "planted").unlink(missing_ok=True)
    log = rank_log(plane, job)
    assert "PROBED" in log and "READ" not in log, log


def test_a_ray_ranks_log_is_capped_as_a_local_ones(ray_cluster, plane_factory):
    """``isolation.max_log_bytes`` holds on Ray too: the plane cuts the log (on the shared state dir)."""
    plane = plane_factory(ray=ray_cluster, max_log_bytes=16 << 10)
    create_tenant(plane.store, "alice", quota_gpus=1)
    job = _submit(plane, "alice", "chatty", ["/bin/sh", "-c", "yes 0123456789abcdef | head -c 400000; "
                                             "echo; echo LAST-LINE"])
    run(plane, job)
    log = rank_log(plane, job)
    assert plane.store.job(job).state == "succeeded", log[-300:]
    assert len(log) <= 16 << 10 and "bytes of this log were cut here" in log and log.endswith("LAST-LINE\n")


def test_a_link_swapped_for_a_checkpoint_home_is_not_walked_by_the_quota_count(plane_factory):
    """A job whose checkpoint directory it may replace (a granted prefix, where the executor made the
    directories of its location for its uid) swaps it for a link to a directory of the plane's: the
    plane's quota count (at each submission and every minute) would walk it as root, whatever it is
    (``/``), and tell the tenant its size. It walks the location the job was given, never through a link."""
    plane = plane_factory()
    base = plane.state_dir.parent
    grant, secret = base / "grant", base / "plane-data"
    grant.mkdir(mode=0o711)
    secret.mkdir(mode=0o700)
    (secret / "blob").write_bytes(os.urandom(2 << 20))
    create_tenant(plane.store, "bob", quota_gpus=1)
    run_dir = grant / "r"
    spec = parse_spec({"name": "first", "gpus": 1, "max_restarts": 0, "command": ["true"],
                       "checkpoint": {"url": str(run_dir / "ck")}})
    first = plane.store.submit("bob", spec.model_dump(), time.time(), ckpt_location=str(run_dir / "ck"))
    run(plane, first.id)  # the executor made grant/r and grant/r/ck for bob's uid
    spec = parse_spec({"name": "swap", "gpus": 1, "max_restarts": 0, "workdir": str(run_dir),
                       "command": ["/bin/sh", "-c", f"rm -rf ck && ln -s {secret} ck && echo SWAPPED"]})
    swap = plane.store.submit("bob", spec.model_dump(), time.time()).id
    run(plane, swap)
    assert "SWAPPED" in rank_log(plane, swap) and (run_dir / "ck").is_symlink(), rank_log(plane, swap)
    used = locations.quota_use(locations.homes(plane.store.jobs(), plane.controller.ckpt_root), lambda t: 1)
    assert used["bob"][0] < 1 << 20, used

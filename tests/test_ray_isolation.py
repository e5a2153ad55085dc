"""Jobs on the Ray executor run as their own uids (``isolation.uid_base``; docs/control.md, Isolation).

A plane built in-process with the Ray executor on the session's Ray cluster (tests/ray_cluster.py,
whose workers run as root here) and driven step by step. A victim job (tenant alice) leaves a log, a
checkpoint, a file in its private area, a progress record and node memory; a hostile job (tenant bob)
tries to read them, the admin token, the database, the plane's environment and the Ray cluster's token
(file or environment), to list the state dir,
to signal the plane and its own rank actor, to widen what it does not own, to have the checkpoint agents
(root) copy the victim's node memory, to read, overwrite, list or delete the victim's peer-tier step with
its own agent token or none, and leaves a symbolic link in its private area for the next attempt
to follow. It writes what it managed into its log. The ranks run
``/bin/sh`` (this project's interpreter lives under /root, 0700: other uids cannot run it).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from iso_plane import worker_uid_base
from plane_proc import wait_until
from tidal.ckpt.tiers.directory import peer_job
from tidal.control.auth import ADMIN_TOKEN_FILE
from tidal.exec.isolation import IsolationConfig
from tidal.exec.ray_auth import anonymous_refused
from tidal.exec.ray_checks import (
    OPEN_OPTION,
    check_open_cluster,
    check_token_file,
    open_cluster_warning,
    verdict,
)

pytestmark = pytest.mark.slow
ROOT = os.geteuid() == 0
TERMINAL = ("succeeded", "failed", "cancelled")
SECRET = "plane-secret-4d2e81"

VICTIM = (
    'echo VICTIM-LOG-MARK; mkdir -p "$TIDAL_CKPT_URL" && echo VICTIM-CKPT-MARK > "$TIDAL_CKPT_URL/data" && '
    'echo VICTIM-HOME-MARK > "$HOME/secret" && echo VICTIM-SHM-MARK > "$TIDAL_SHM_DIR/state" && '
    "echo '{\"event\": \"committed\", \"step\": 5, \"tiers\": [\"shm\"], \"time\": 1}' "
    '> "$TIDAL_PROGRESS_DIR/progress-r00000.jsonl" && echo "uid $(id -u)" && '
    'if [ -x "$PY" ]; then "$PY" -I -c "$PEER"; fi'
)
# A plain Python (not this project's, which other uids cannot run) talks to the checkpoint agents.
PY = "/usr/bin/python3"
SRC = Path(__file__).resolve().parents[1] / "src"
# Its namespace in the agents is its peer tier's (tidal.ckpt.tiers.directory.peer_job of its location),
# its token the executor's (TIDAL_CKPT_AGENT_TOKEN).
NAMESPACE = '''
import hashlib, os, urllib.error, urllib.request as u
d = os.environ["TIDAL_CKPT_URL"]
ns = f"{os.path.basename(d)[:64]}-{hashlib.sha256(d.encode()).hexdigest()[:32]}"
auth = {"Authorization": "Bearer " + os.environ["TIDAL_CKPT_AGENT_TOKEN"]}
'''
PEER = NAMESPACE + '''
url = f"http://{os.environ['TIDAL_CKPT_AGENT']}/v1/jobs/{ns}/step_000000000005/r0.bin"
u.urlopen(u.Request(url, data=b"VICTIM-PEER-MARK", method="PUT", headers=auth), timeout=30).read()
print("peer tier:", u.urlopen(u.Request(url, headers=auth), timeout=30).read().decode())
'''
# Asks every node's agent (root) to copy the victim's node memory on every node into its own peer tier.
# Then, with its own token and with none, reads, lists, overwrites and deletes the victim's step there.
STEAL = NAMESPACE + '''
agents = [os.environ["TIDAL_CKPT_AGENT"], *filter(None, os.environ.get("TIDAL_CKPT_PEERS", "").split(","))]
base = os.path.dirname(os.path.dirname(os.environ["TIDAL_SHM_DIR"]))
for a in agents:
    for n in ("n1", "n2", "n3"):
        q = f"copy_from={base}/{n}/{os.environ['VICTIM']}/state&length=16"
        url = f"http://{a}/v1/jobs/{ns}/step_000000000001/{n}.bin"
        try:
            u.urlopen(u.Request(f"{url}?{q}", method="POST", headers=auth), timeout=30).read()
            print("COPIED", n, "by", a, u.urlopen(u.Request(url, headers=auth), timeout=30).read())
        except urllib.error.HTTPError as e:
            print("refused copy", e.code)
    v = f"http://{a}/v1/jobs/{os.environ['VNS']}"
    s = v + "/step_000000000005"
    for h in (auth, {}):
        for m, url, body in [("GET", v, None), ("GET", s + "/r0.bin", None), ("PUT", s + "/r0.bin", b"BOB"),
                             ("DELETE", s, None)]:
            try:
                r = u.urlopen(u.Request(url, data=body, method=m, headers=h), timeout=30)
                print("GOT VICTIM", m, r.read())
            except urllib.error.HTTPError as e:
                print("refused victim", e.code)
'''
HOSTILE = r'''
base=$(dirname "$(dirname "$TIDAL_SHM_DIR")")
v="$STATE/jobs/$VICTIM"
ln -s "$STATE/$TOKEN" "$HOME/token-link"
for f in "$STATE/$TOKEN" "$HOME/token-link" "$STATE/tidal.db" "$STATE/jobs/.uids.json" "$v/logs/rank-0.log" \
         "$v/ckpt/data" "$v/home/secret" "$v/attempt-1/progress/progress-r00000.jsonl" \
         "$v/attempt-1/launch.json" \
         "$base/n1/$VICTIM/state" "$base/n2/$VICTIM/state" "$base/n3/$VICTIM/state" \
         "/proc/$PLANE_PID/environ" "/proc/$PPID/environ" "$RAY_TOKEN_FILE"; do
  if c=$(cat "$f" 2>/dev/null); then echo "READ $f: $c"; else echo "denied $f"; fi
done
for d in "$STATE" "$STATE/jobs" "$v" "$v/ckpt" "$base" "$(dirname "$TIDAL_SHM_DIR")"; do
  if l=$(ls -A "$d" 2>/dev/null); then echo "LISTED $d: $l"; else echo "denied listing $d"; fi
done
for p in "$PLANE_PID" "$PPID"; do
  if kill -0 "$p" 2>/dev/null; then echo "SIGNALLED $p"; else echo "denied signal $p"; fi
done
for f in "$STATE/jobs/$TIDAL_JOB_ID" "$STATE/jobs/$TIDAL_JOB_ID/attempt-1" \
         "$STATE/jobs/$TIDAL_JOB_ID/logs/rank-0.log" "$base"; do
  if chmod 0777 "$f" 2>/dev/null; then echo "CHMODDED $f"; else echo "denied chmod $f"; fi
done
chmod 0777 "$HOME" "$TIDAL_PROGRESS_DIR" "$TIDAL_SHM_DIR" && echo "own dirs opened"
echo "uid $(id -u) gid $(id -g) groups $(id -G) nproc $(ulimit -p) core $(ulimit -c)"
env | grep -q '^RAY_AUTH_TOKEN' && echo "READ Ray's token variables: $(env | grep '^RAY_AUTH_TOKEN')"
if [ -x "$PY" ]; then "$PY" -I -c "$STEAL"; fi
rm -rf "$HOME/tmp" && ln -s "$STATE" "$HOME/tmp" && echo "home/tmp now links to the state dir"
exit 1
'''


def _job(plane, tenant: str, name: str, script: str, env: dict, restarts: int = 0) -> str:
    from tidal.control.spec import parse_spec

    spec = parse_spec({"name": name, "gpus": 1, "max_restarts": restarts,
                       "command": ["/bin/sh", "-c", script], "env": env})
    return plane.store.submit(tenant, spec.model_dump(), time.time()).id


def _run(plane, job_id: str) -> None:
    def ended():
        plane.controller.step(time.time())
        return plane.store.job(job_id).state in TERMINAL

    wait_until(f"{job_id} to end", ended, 90)


def _log(plane, job_id: str) -> str:
    return Path(plane.executor.log_path(job_id, 0)).read_text()


def _mode(p: Path) -> tuple[int, int]:
    st = os.lstat(p)
    return st.st_uid, stat.S_IMODE(st.st_mode)


@pytest.mark.skipif(not ROOT, reason="jobs run as their own uids only when tidal up and the Ray workers "
                    "run as root (docs/control.md, Isolation)")
def test_a_hostile_job_on_ray_reads_nothing_as_its_own_uid(ray_cluster, monkeypatch):
    from tidal.control.auth import create_tenant
    from tidal.control.config import ControlConfig
    from tidal.control.server import build, isolation_warning

    monkeypatch.setenv("TIDAL_TEST_SECRET", SECRET)  # in the plane's environment only
    base = Path(tempfile.mkdtemp(prefix="tidal-rayiso-"))  # other uids may pass through /tmp (not pytest's
    base.chmod(0o711)  # tmp_path, under a 0700 directory)
    ray_cluster.state_roots.append(base / "state" / "jobs")
    cfg = ControlConfig(loop_interval_s=0.1, restart_backoff_s=0.1,
                        isolation=IsolationConfig(uid_base=worker_uid_base(2)))
    plane = build(base / "state", "auto", None, cfg, executor="ray", ray_address=ray_cluster.address,
                  ckpt_agents=True)
    py = os.access(PY, os.X_OK)
    ex, sd = plane.executor, plane.state_dir
    try:
        # the test cluster has Ray's token authentication: tidal up runs jobs as their uids and says nothing
        assert ex.token_auth and isolation_warning(cfg, executor=ex) is None
        plane.controller.recover(time.time())
        create_tenant(plane.store, "alice", quota_gpus=1)
        create_tenant(plane.store, "bob", quota_gpus=1)
        victim = _job(plane, "alice", "victim", VICTIM, {"PY": PY, "PEER": PEER})
        _run(plane, victim)
        vlog = _log(plane, victim)
        assert plane.store.job(victim).state == "succeeded", vlog
        uid_v = plane.store.job(victim).handle["uid"]
        assert f"uid {uid_v}\n" in vlog and worker_uid_base(2) <= uid_v < worker_uid_base(2) + 65536
        assert not py or "peer tier: VICTIM-PEER-MARK\n" in vlog  # its node's agent takes its bytes
        # its own checkpoint, progress, private area and node memory work under its uid
        assert plane.store.job(victim).ckpt_step == 5
        assert (ex.job_dir(victim) / "ckpt" / "data").read_text() == "VICTIM-CKPT-MARK\n"
        node = plane.store.job(victim).handle["ranks"][0]["node"]
        shm = ex.shm_root / node / victim
        assert (shm / "state").read_text() == "VICTIM-SHM-MARK\n"
        for p in (ex.home_dir(victim), ex.attempt_dir(victim, 1) / "progress", ex.job_dir(victim) / "ckpt",
                  shm):
            assert _mode(p) == (uid_v, 0o700), p
        for p in (sd, sd / "jobs", ex.job_dir(victim)):  # its sandbox binds its own directories
            assert _mode(p) == (0, 0o700), p
        for p in (ex.attempt_dir(victim, 1), ex.shm_root, shm.parent):
            assert _mode(p) == (0, 0o711), p
        assert _mode(Path(ex.log_path(victim, 0))) == (0, 0o600)
        assert _mode(sd / ADMIN_TOKEN_FILE) == (0, 0o600)

        vns = peer_job(str(ex.job_dir(victim) / "ckpt"))
        env = {"STATE": str(sd), "VICTIM": victim, "TOKEN": ADMIN_TOKEN_FILE, "PLANE_PID": str(os.getpid()),
               "PY": PY, "STEAL": STEAL, "VNS": vns, "RAY_TOKEN_FILE": str(ray_cluster.token_file)}
        hostile = _job(plane, "bob", "peek", HOSTILE, env, restarts=1)
        _run(plane, hostile)
        log = _log(plane, hostile)
        token = (sd / ADMIN_TOKEN_FILE).read_text().strip()
        ray_token = ray_cluster.token_file.read_text()
        assert token not in log and SECRET not in log and "MARK" not in log and ray_token not in log, log
        assert not any(w in log for w in ("READ ", "LISTED ", "SIGNALLED ", "CHMODDED ", "COPIED ")), log
        assert not py or log.count("refused copy 403\n") == 9, log  # no agent copies a file a rank names
        assert not py or log.count("refused victim 403\n") == 3 * 2 * 4, log  # nor touches another's steps
        if py:  # the victim's step is whole at its agent (as the plane sees it, with the agents' token)
            agent = ex.agents.addresses[node]
            req = urllib.request.Request(f"http://{agent}/v1/jobs/{vns}/step_000000000005/r0.bin",
                                         headers={"Authorization": f"Bearer {ex.agents.agent_token}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.read() == b"VICTIM-PEER-MARK"
        assert log.count("denied ") == 15 + 6 + 2 + 4, log
        uid_h = ex.uids.owner("tenant", hostile, "bob")[0]  # bob's (the handle went with the failed launch)
        assert f"uid {uid_h} gid {uid_h} groups {uid_h} nproc 4096 core 0\n" in log and uid_h != uid_v, log
        assert "own dirs opened" in log and "home/tmp now links to the state dir" in log
        # The restart refused to follow the link (a chown of the state dir to bob), and closed the home again.
        job = plane.store.job(hostile)
        assert job.state == "failed" and "not a directory (refused)" in (job.message or ""), job.message
        assert _mode(sd) == (0, 0o700) and _mode(sd / ADMIN_TOKEN_FILE) == (0, 0o600)
        assert _mode(ex.home_dir(hostile)) == (uid_h, 0o700)
        assert log.count("=== tidal: ") == 1  # attempt 2 never ran
    finally:
        for job_id in list(ex._jobs):
            ex.kill(job_id)
            ex.release(job_id)
        if ex.agents is not None:
            ex.agents.stop_all()
        plane.store.close()
        shutil.rmtree(base, ignore_errors=True)


def _check_alive(address: str, token: str | None) -> str:
    """The GCS's answer to a call with ``token`` in Ray's header (or none): OK or the gRPC status."""
    import grpc
    from ray.core.generated import gcs_service_pb2 as pb
    from ray.core.generated import gcs_service_pb2_grpc as pb_grpc

    meta = (("authorization", f"Bearer {token}"),) if token is not None else None
    with grpc.insecure_channel(address) as ch:
        try:
            pb_grpc.NodeInfoGcsServiceStub(ch).CheckAlive(pb.CheckAliveRequest(), timeout=10, metadata=meta)
        except grpc.RpcError as e:
            return e.code().name
    return "OK"


def test_the_cluster_refuses_a_client_without_its_token(ray_cluster):
    """The session's cluster runs with Ray's token authentication: its GCS answers a call with the token
    and refuses one without it or with another (so a job, which has no token, cannot submit tasks that run
    as root); the token is a 0600 file of root's in a 0700 directory, named by a variable a job's clean
    environment never carries."""
    from tidal.exec.isolation import clean_env

    path = ray_cluster.token_file
    token = path.read_text()
    assert _mode(path) == (os.geteuid(), 0o600) and _mode(path.parent) == (os.geteuid(), 0o700)
    assert anonymous_refused(ray_cluster.address) is True
    assert _check_alive(ray_cluster.address, None) == "UNAUTHENTICATED"
    assert _check_alive(ray_cluster.address, "0" * len(token)) == "UNAUTHENTICATED"
    assert _check_alive(ray_cluster.address, token) == "OK"
    env = clean_env(IsolationConfig(uid_base=210000), Path("/nonexistent/home"), {}, {}, omp_threads=1)
    assert not any(k.startswith("RAY_AUTH") for k in env) and token not in str(env), env


def test_tidal_up_without_the_clusters_token_is_one_line(ray_cluster, tmp_path):
    """``tidal up --executor ray`` joining the session's cluster in token mode without its token (none in
    the environment, no ``~/.ray/auth_token``): one line that says what is missing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update({"RAY_AUTH_MODE": "token", "HOME": str(tmp_path), "PYTHONPATH": str(SRC)})
    jobs = str(tmp_path / "jobs")
    code = (f"from tidal.exec.ray_exec import RayExecutor\ntry:\n    RayExecutor({jobs!r}, address="
            f"{ray_cluster.address!r})\nexcept ValueError as e:\n    print('ERROR', e)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (f"ERROR cannot join the Ray cluster at {ray_cluster.address}: it refuses clients without its "
            "token (RAY_AUTH_MODE=token; give the cluster's token in RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)\n"
            ) in out.stdout, out.stdout + out.stderr


def test_a_token_file_others_can_read_is_refused():
    """Ray's token in a file any user can read (Ray writes ``~/.ray/auth_token`` with the umask's mode)
    would hand it to every job: ``tidal up`` with uids refuses it in one line; 0600, or a directory
    others cannot pass, is fine."""
    base = Path(tempfile.mkdtemp(prefix="tidal-raytoken-"))  # under /tmp, which others may pass
    try:
        base.chmod(0o755)
        d = base / "etc-ray"
        d.mkdir(mode=0o755)
        f = d / "auth-token"
        f.write_text("t" * 64)
        f.chmod(0o644)
        msg = (r"^isolation: Ray's token file .* is readable by every user \(mode 0644\): a job "
               r"could read it and run code as the workers' user on any node; chmod 600 it$")
        with pytest.raises(ValueError, match=msg):
            check_token_file(f)
        (base / "link").symlink_to(f)
        with pytest.raises(ValueError, match=msg):
            check_token_file(base / "link")
        f.chmod(0o600)
        check_token_file(f)
        f.chmod(0o644)
        d.chmod(0o750)
        check_token_file(f)
        check_token_file(None)
        check_token_file(base / "missing")
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap (apt-get install bubblewrap)")
def test_a_rank_as_the_workers_user_cannot_read_rays_token_through_its_workdir(tmp_path, monkeypatch):
    """Where the Ray workers are not root every rank runs as their user, who can read Ray's token (the
    workers need it): a job naming the token's directory, or one above it, as its workdir would read it
    and run code outside its sandbox. A rank actor hides that directory (``ray_dirs``) as the state dir."""
    import dataclasses

    from tidal.contract import RAY_AUTH_TOKEN_ENV, RAY_AUTH_TOKEN_PATH_ENV
    from tidal.exec import sandbox
    from tidal.exec.ray_auth import write_token
    from tidal.exec.ray_rank import ray_dirs

    home, attempt = tmp_path / "home", tmp_path / "attempt"
    (attempt / "progress").mkdir(parents=True)
    token = write_token(home / ".ray")
    monkeypatch.setenv(RAY_AUTH_TOKEN_PATH_ENV, str(token))
    monkeypatch.delenv(RAY_AUTH_TOKEN_ENV, raising=False)
    binds = sandbox.Binds(named=(str(home),), hidden=(), attempt=str(attempt), own=(), shm=None)
    binds = dataclasses.replace(binds, hidden=(*binds.hidden, *ray_dirs()))  # as the rank actor does
    probe = ["/bin/sh", "-c", 'cat "$0"; ls "$1"; echo PROBED', str(token), str(home / ".ray")]
    # owner None: the rank keeps this process's user (as the workers' user keeps theirs)
    cmd = sandbox.command(sandbox.find_bwrap(), probe, binds, env={}, python=sys.executable, owner=None,
                          cwd=str(home))
    try:
        got = subprocess.run(cmd, pass_fds=sandbox.bind_fds(cmd), capture_output=True, text=True, timeout=60)
    finally:
        sandbox.close_fds(cmd)
    assert "PROBED" in got.stdout, got.stdout + got.stderr
    assert token.read_text() not in got.stdout and token.name not in got.stdout, got.stdout


def test_workers_not_root_is_one_line():
    """What ``tidal up`` says when the Ray workers (asked on each node at start) cannot switch uids; the
    cluster's token never goes to jobs."""
    with pytest.raises(ValueError, match="isolation.pass_env: RAY_AUTH_TOKEN would hand every job"):
        IsolationConfig(pass_env=("PATH", "RAY_AUTH_TOKEN"))
    from tidal.exec.ray_exec import RayExecutor

    with pytest.raises(ValueError, match="isolation.max_memory_bytes: the Ray executor sets no memory"):
        RayExecutor("/nonexistent/jobs", isolation=IsolationConfig(max_memory_bytes=2**30))
    # a cluster without token authentication: refused for sandboxed jobs, unless the operator opts out
    with pytest.raises(ValueError, match=r"^isolation: the Ray cluster accepts clients without a token, so a"
                       ) as e:
        check_open_cluster(False, False)
    assert "\n" not in str(e.value) and f"{OPEN_OPTION}: true" in str(e.value)
    check_open_cluster(False, True)
    check_open_cluster(True, False)
    assert IsolationConfig.from_dict({"ray_open_cluster": True}).ray_open_cluster
    with pytest.raises(ValueError, match="isolation.ray_open_cluster must be true or false, got 'yes'"):
        IsolationConfig.from_dict({"ray_open_cluster": "yes"})
    from tidal.control.config import ControlConfig
    from tidal.control.server import isolation_warning

    class Open:
        token_auth, uids = False, object()

    class OpenNoUids:
        token_auth, uids = False, None

    assert isolation_warning(None, executor=Open()) == open_cluster_warning()
    assert isolation_warning(None, executor=OpenNoUids()) == open_cluster_warning()

    class NoUids:
        token_auth, uids = True, None

    assert "on Ray without uids" in (isolation_warning(None, executor=NoUids()) or "")
    off = isolation_warning(ControlConfig.from_dict({"isolation": "none"}), euid=0, executor=NoUids())
    assert off is not None and "isolation is off" in off
    assert OPEN_OPTION in open_cluster_warning()
    assert verdict({"n1": 0, "n2": 0}, [], ["n1", "n2"]) is None
    msg = verdict({"n1": 0, "n2": 1000}, [], ["n1", "n2"])
    assert msg == ("isolation.uid_base: the Ray workers run as uid 1000 on n2, not root: they cannot start "
                   "ranks as jobs' uids (start Ray as root, or remove uid_base)")
    msg = verdict({"n1": 0}, ["n2"], ["n1", "n2"], timeout_s=60)
    assert msg is not None and msg.startswith("isolation.uid_base: no Ray worker answered on n2 within 60 s")
    for answers, late in [({}, ["n1", "n2"]), ({"n1": 5}, [])]:
        assert "\n" not in (verdict(answers, late, ["n1", "n2"]) or "-")


def test_a_node_that_cannot_sandbox_is_one_line(tmp_path, monkeypatch):
    """What a node answers at start (asked by a task pinned to it), and what ``tidal up`` makes of it."""
    from tidal.exec.ray_checks import _sandbox_verdict, sandbox_verdict

    if shutil.which("bwrap"):
        assert _sandbox_verdict([str(tmp_path)]) is None
        venv = tmp_path / "venv"
        why = _sandbox_verdict([str(venv)])
        assert why == f"{venv} is not there (tidal up's interpreter and code must be at the same paths)"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on this node
    why = _sandbox_verdict([])
    assert why is not None and why.startswith("the sandbox needs bwrap (apt-get install -y bubblewrap)")
    msg = sandbox_verdict({"n1": None, "n2": why, "n3": why}, ["n1", "n2", "n3"])
    assert msg == f"isolation: Ray node n2 cannot sandbox ranks (and on n3): {why}" and "\n" not in msg
    assert sandbox_verdict({"n1": None}, ["n1"]) is None
    late = sandbox_verdict({"n1": None}, ["n1", "n2"], timeout_s=60)
    assert late == "isolation: no Ray worker answered on n2 within 60 s (asked whether it can sandbox ranks)"

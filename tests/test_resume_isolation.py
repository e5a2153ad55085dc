"""``checkpoint: {resume_from: JOB}`` with ``isolation: {uid_base, per: job}``: the new job (its own uid)
takes over the location the ended job (another uid) wrote, resumes from its newest step and writes
its own there; what the earlier job planted in the location (links, a FIFO) moves nothing outside it.

The ranks are a plain Python (:data:`iso_plane.PY`, which other uids can run) using the checkpoint
engine's directory tier, commit and retention (standard library only) from this checkout.
"""

from __future__ import annotations

import os
import stat
import subprocess
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from iso_plane import PY, ROOT, SRC, plain_python_reaches_src, planes, rank_log, run
from tidal.control.auth import create_tenant

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not ROOT, reason="jobs run as their own uids only when tidal up runs as root")]

# One training step: resume from the newest committed step (its state is the ids of the jobs that
# wrote it), write the next with this job's id appended, commit it, keep only it (retention).
TRAIN = r'''
import os, sys
sys.path.insert(0, os.environ["SRC"])
from tidal.ckpt.engine import commit as cm
from tidal.ckpt.tiers.directory import DirTier
t = DirTier("disk", os.environ["TIDAL_CKPT_URL"], fsync=False)
t.check()
have = t.committed_steps()
step = have[-1] if have else 0
state = t.read_bytes(step, "r0.bin").decode() if have else ""
print(f"resumed from step {step}: {state!r}", flush=True)
t.write_bytes(step + 1, "r0.bin", (state + os.environ["TIDAL_JOB_ID"] + ";").encode())
cm.commit(t, step + 1, {"step": step + 1})
print("removed", cm.cleanup(t, keep=1, committed_step=step + 1))
print("committed", step + 1, "as uid", os.getuid())
'''
# The earlier job, before its step: links out of its location, a hard link to its own file outside it
# and a FIFO (the hand-over must neither follow, nor move, nor block on them).
PLANT = r'''
set -e
loc="$TIDAL_CKPT_URL"; mkdir -p "$loc/extra"
echo mine > "$HOME/own"
ln -s "$TARGET" "$loc/shadow"
ln -s "$HOME" "$loc/home-link"
ln -s "$HOME" "$loc/extra/deeper"
ln "$HOME/own" "$loc/extra/hard"
mkfifo "$loc/fifo"
'''


@pytest.fixture
def plane():
    why = plain_python_reaches_src()
    if why is not None:
        pytest.skip(why)
    with planes() as make:
        yield make(uid_base=200000, per="job")


def _submit(plane, client: TestClient, token: str, name: str, checkpoint: dict | None = None,
            plant: str | None = None, env: dict | None = None) -> str:
    train = [PY, "-I", "-c", TRAIN]
    command = ["/bin/sh", "-c", PLANT + 'exec "$@"', "plant", *train] if plant else train
    spec = {"name": name, "gpus": 1, "max_restarts": 0, "command": command,
            "env": {"SRC": str(SRC), **(env or {})}, **({"checkpoint": checkpoint} if checkpoint else {})}
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _owner(p: Path) -> int:
    return os.lstat(p).st_uid


def test_resume_from_an_ended_job_of_another_uid(plane):
    client = TestClient(plane.app())
    token = create_tenant(plane.store, "alice", quota_gpus=1)
    a = _submit(plane, client, token, "first")
    run(plane, a)
    assert plane.store.job(a).state == "succeeded", rank_log(plane, a)
    loc = plane.executor.job_dir(a) / "ckpt"
    assert "committed 1" in rank_log(plane, a)
    b = _submit(plane, client, token, "second", {"resume_from": a})
    run(plane, b)
    log = rank_log(plane, b)
    assert plane.store.job(b).state == "succeeded", log
    uid_a, uid_b = plane.store.job(a).handle["uid"], plane.store.job(b).handle["uid"]
    assert uid_a != uid_b
    assert f"resumed from step 1: '{a};'" in log and f"committed 2 as uid {uid_b}" in log, log
    assert "removed [1]" in log  # its retention pruned the earlier job's step: the location is its own
    assert sorted(os.listdir(loc)) == ["step_000000000002"]
    assert {_owner(p) for p in (loc, *loc.rglob("*"))} == {uid_b}
    # the earlier job's own things stay where and whose they were
    assert _owner(plane.executor.home_dir(a)) == uid_a
    assert _owner(plane.executor.attempt_dir(a, 1) / "progress") == uid_a
    assert _owner(plane.executor.log_path(a, 0)) == 0
    # and a third job resumes the chain (from the second job's uid)
    c = _submit(plane, client, token, "third", {"resume_from": b})
    run(plane, c)
    assert f"resumed from step 2: '{a};{b};'" in rank_log(plane, c), rank_log(plane, c)


def test_what_the_earlier_job_planted_moves_nothing_outside(plane):
    client = TestClient(plane.app())
    token = create_tenant(plane.store, "alice", quota_gpus=1)
    target = plane.state_dir.parent / "shadow"  # root's, as /etc/shadow
    target.write_text("root-secret\n")
    target.chmod(0o644)
    a = _submit(plane, client, token, "planter", plant="yes", env={"TARGET": str(target)})
    run(plane, a)
    assert plane.store.job(a).state == "succeeded", rank_log(plane, a)
    uid_a = plane.store.job(a).handle["uid"]
    home, loc = plane.executor.home_dir(a), plane.executor.job_dir(a) / "ckpt"
    assert os.stat(home / "own").st_nlink == 2
    b = _submit(plane, client, token, "resumer", {"resume_from": a})
    run(plane, b)
    log = rank_log(plane, b)
    assert plane.store.job(b).state == "succeeded", log
    uid_b = plane.store.job(b).handle["uid"]
    assert f"resumed from step 1: '{a};'" in log and f"committed 2 as uid {uid_b}" in log, log
    assert (_owner(target), stat.S_IMODE(os.stat(target).st_mode), target.read_text()) == (0, 0o644,
                                                                                            "root-secret\n")
    assert _owner(home) == uid_a and _owner(home / "own") == uid_a  # not through a link, nor a hard link
    assert stat.S_ISFIFO(os.lstat(loc / "fifo").st_mode)


def test_a_process_of_the_earlier_uid_still_running_stops_the_take_over(plane):
    client = TestClient(plane.app())
    token = create_tenant(plane.store, "alice", quota_gpus=1)
    a = _submit(plane, client, token, "first")
    run(plane, a)
    uid_a = plane.store.job(a).handle["uid"]
    left = subprocess.Popen(["sleep", "60"], user=uid_a, group=uid_a, extra_groups=[])
    try:
        b = _submit(plane, client, token, "second", {"resume_from": a})
        run(plane, b)
        job = plane.store.job(b)
        assert job.state == "failed" and f"process {left.pid} of uid {uid_a}" in job.message, job.message
        assert _owner(plane.executor.job_dir(a) / "ckpt") == uid_a
    finally:
        left.kill()
        left.wait()

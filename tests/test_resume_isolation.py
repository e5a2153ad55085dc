"""``checkpoint: {resume_from: JOB}`` with ``isolation: {uid_base, per: job}``: the new job (its own uid)
takes over the location the ended job (another uid) wrote, resumes from its newest step and writes
its own there; what the earlier job planted in the location (links, a FIFO) moves nothing outside it.

The ranks are a plain Python (:data:`iso_plane.PY`, which other uids can run) using the checkpoint
engine's directory tier, commit and retention (standard library only) from this checkout.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from iso_plane import PY, ROOT, SRC, plain_python_reaches_src, planes, rank_log, run, worker_uid_base
from tidal.contract import FENCE_FILE
from tidal.control.auth import create_tenant
from tidal.exec.handover import HandOverError, hand_over

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
        yield make(uid_base=worker_uid_base(), per="job")


@pytest.fixture
def unsandboxed_plane():
    """In its sandbox a job cannot plant links out of its checkpoint directory at all (each of its
    directories is a mount of its own, so a hard link across them is EXDEV, and nothing outside is
    there to link to): the handover's own refusal is tested on ranks without it."""
    why = plain_python_reaches_src()
    if why is not None:
        pytest.skip(why)
    with planes() as make:
        yield make(mode="none", uid_base=worker_uid_base(), per="job")


def _submit(plane, client: TestClient, token: str, name: str, checkpoint: dict | None = None,
            plant: bool = False, env: dict | None = None) -> str:
    train = [PY, "-I", "-c", TRAIN]
    command = ["/bin/sh", "-c", PLANT + 'exec "$@"', "plant", *train] if plant else train
    spec = {"name": name, "gpus": 1, "max_restarts": 0, "command": command,
            "env": {"SRC": str(SRC), **(env or {})}, **({"checkpoint": checkpoint} if checkpoint else {})}
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _owner(p: Path) -> int:
    return os.lstat(p).st_uid


def test_resume_from_an_ended_job_of_another_uid(plane, caplog):
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
    assert sorted(os.listdir(loc)) == [FENCE_FILE, "step_000000000002"]
    fence = json.loads((loc / FENCE_FILE).read_text())
    assert (fence["job"], fence["attempt"], _owner(loc / FENCE_FILE)) == (b, 1, 0)  # the plane's, for b
    assert {_owner(p) for p in (loc, *loc.rglob("*")) if p.name != FENCE_FILE} == {uid_b}
    # the earlier job's own things stay where and whose they were
    assert _owner(plane.executor.home_dir(a)) == uid_a
    assert _owner(plane.executor.attempt_dir(a, 1) / "progress") == uid_a
    assert _owner(plane.executor.log_path(a, 0)) == 0
    # a third job resumes the first again: the location is the second's now (its uid's, moved too)
    c = _submit(plane, client, token, "third", {"resume_from": a})
    run(plane, c)
    assert f"resumed from step 2: '{a};{b};'" in rank_log(plane, c), rank_log(plane, c)
    assert "fence.json" not in caplog.text  # the plane's fence is neither moved nor reported as left
    # a job that never ran (cancelled while pending) has no location yet: the plane makes it for the next
    never = _submit(plane, client, token, "never")
    assert client.post(f"/v1/jobs/{never}/cancel", headers={"Authorization": f"Bearer {token}"}).is_success
    run(plane, never)
    d = _submit(plane, client, token, "after-never", {"resume_from": never})
    run(plane, d)
    assert "resumed from step 0: ''" in rank_log(plane, d) and "committed 1" in rank_log(plane, d)
    assert _owner(plane.executor.job_dir(never) / "ckpt") == plane.store.job(d).handle["uid"]


def test_what_the_earlier_job_planted_moves_nothing_outside(unsandboxed_plane):
    plane = unsandboxed_plane
    client = TestClient(plane.app())
    token = create_tenant(plane.store, "alice", quota_gpus=1)
    target = plane.state_dir.parent / "shadow"  # root's, as /etc/shadow
    target.write_text("root-secret\n")
    target.chmod(0o644)
    a = _submit(plane, client, token, "planter", plant=True, env={"TARGET": str(target)})
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
    assert stat.S_ISFIFO(os.lstat(loc / "fifo").st_mode) and _owner(loc / "fifo") == uid_a
    assert _owner(loc / "extra") == uid_b and _owner(loc / "extra" / "deeper") == uid_a


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


# ---------------------------------------------------------------------------- the hand-over itself
A, B, OTHER = (worker_uid_base(1) + n for n in (301, 302, 303))


def _make(p: Path, uid: int, text: str | None = None) -> Path:
    if text is None:
        p.mkdir(mode=0o700)
    else:
        p.write_text(text)
    os.lchown(p, uid, uid)
    return p


def test_hand_over_moves_only_the_earlier_uids_plain_entries(tmp_path):
    outside = _make(tmp_path / "outside", A)
    mine = _make(outside / "mine", A, "a")
    loc = _make(tmp_path / "loc", A)
    step = _make(loc / "step_000000000001", A)
    _make(step / "r0.bin", A, "data").chmod(0o6755)  # set-id bits: cleared when it moves
    _make(step / "foreign", OTHER, "x")
    os.symlink(outside, loc / "dir-link")
    os.symlink(mine, step / "file-link")
    for link in (loc / "dir-link", step / "file-link"):
        os.lchown(link, A, A)
    os.link(mine, step / "hard")
    os.mkfifo(loc / "fi\nfo")  # a name on two lines: the log line naming it stays one line
    os.chown(loc / "fi\nfo", A, A)
    mnt = _make(loc / "mnt", A)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tidal-test", str(mnt)],
                             capture_output=True).returncode == 0
    try:
        if mounted:  # its root and a file in it are A's too: only the filesystem keeps them
            os.chown(mnt, A, A)
            _make(mnt / "on-another-fs", A, "m")
        got = hand_over(loc, [A], (B, B))
        owners = {str(p.relative_to(tmp_path)): os.lstat(p).st_uid for p in (outside, mine, *loc.rglob("*"))}
        again = hand_over(loc, [A], (B, B))
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=True)
    assert os.lstat(loc).st_uid == B
    assert owners == {"outside": A, "outside/mine": A, "loc/step_000000000001": B,
                      "loc/step_000000000001/r0.bin": B, "loc/step_000000000001/foreign": OTHER,
                      "loc/dir-link": A, "loc/step_000000000001/file-link": A,
                      "loc/step_000000000001/hard": A, "loc/fi\nfo": A, "loc/mnt": A if mounted else B,
                      **({"loc/mnt/on-another-fs": A} if mounted else {})}
    assert got.moved == 3 + (0 if mounted else 1)
    assert not any("\n" in line for line in got.skipped)
    why = "\n".join(got.skipped)
    for part in (f"foreign: owned by uid {OTHER}", "dir-link: a symbolic link", "file-link: a symbolic link",
                 "hard: 2 hard links", "/fi\\nfo: not a regular", *["mnt: another filesystem"] * mounted):
        assert part in why, why
    assert again.moved == 0 and not any(str(B) in line for line in again.skipped)  # B's: nothing to say
    assert stat.S_IMODE(os.stat(step / "r0.bin").st_mode) == 0o755


def test_hand_over_refuses_a_link_a_deep_or_a_huge_tree_changing_nothing(tmp_path):
    loc = _make(tmp_path / "loc", A)
    os.symlink(loc, tmp_path / "link")
    with pytest.raises(HandOverError, match=r"checkpoint location .*/link: not a directory \(or a symbolic"):
        hand_over(tmp_path / "link", [A], (B, B))
    d = loc
    for i in range(4):
        d = _make(d / f"d{i}", A)
    with pytest.raises(HandOverError, match=r"loc/d0/d1/d2 is more than 3 directories deep"):
        hand_over(loc, [A], (B, B), max_depth=3)
    for i in range(6):
        _make(loc / f"f{i}", A, "x")
    with pytest.raises(HandOverError, match=r"more than 8 entries \(at .*\); not a checkpoint location's"):
        hand_over(loc, [A], (B, B), max_entries=8)
    assert {os.lstat(p).st_uid for p in (loc, *loc.rglob("*"))} == {A}  # refused before any change
    assert hand_over(tmp_path / "missing", [A], (B, B)).moved == 0
    assert hand_over(loc, [B], (B, B)).moved == 0  # its own uid: nothing to do
    assert hand_over(loc, [A], (B, B)).moved == 11



def test_an_entry_swapped_under_the_walk_is_refused_and_not_changed(tmp_path, monkeypatch):
    """Between the ``lstat`` of a name and its change, the name comes to be a hard link to root's file
    (as if the earlier uid still ran): the pinned inode is not the one checked, nothing of root's moves."""
    loc = _make(tmp_path / "loc", A)
    step = _make(loc / "step_000000000001", A)
    _make(step / "r0.bin", A, "data")
    victim = tmp_path / "victim"
    victim.write_text("root's")
    listings = []
    real = os.scandir

    class Swapping:
        def __init__(self, fd):
            self.it = real(fd)

        def __enter__(self):
            return self.it.__enter__()

        def __exit__(self, *exc):
            self.it.__exit__(*exc)
            listings.append(1)
            if len(listings) == 4:  # the second walk has just listed the step: swap its file
                os.link(victim, step / ".swap")
                os.replace(step / ".swap", step / "r0.bin")

    monkeypatch.setattr(os, "scandir", Swapping)
    with pytest.raises(HandOverError, match=r"step_000000000001/r0.bin changed during the hand-over"):
        hand_over(loc, [A], (B, B))
    assert (os.stat(victim).st_uid, victim.read_text()) == (0, "root's")

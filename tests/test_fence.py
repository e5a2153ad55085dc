"""The fence of a checkpoint location (tidal.ckpt.fence): a stale attempt's commits are refused.

The scenario test runs two local executors as two nodes sharing one checkpoint directory: attempt 1 of
a job (a real training worker) is "partitioned" (it holds, as a lost node's rank that nobody reaped),
the second node launches attempt 2 on the same location, and the stale rank, let go, trains on: its
next commit is refused and it exits with EXIT_FENCED, while attempt 2 restores from the newest step
committed before the fence and commits the only steps after it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from iso_plane import worker_uid_base
from tidal import ckpt
from tidal import contract as c
from tidal.ckpt import fence
from tidal.ckpt.agent.auth import KEY_FILE
from tidal.ckpt.engine import commit
from tidal.ckpt.tiers.directory import DirTier, failure_name
from tidal.exec.isolation import IsolationConfig
from tidal.exec.local import LocalExecutor
from tidal.exec.protocol import LaunchRequest

WORKER = Path(__file__).parent / "workers" / "train_worker.py"


# ------------------------------------------------------------------------------ the fence file
def test_write_read_check(tmp_path):
    d = tmp_path / "ck"
    assert fence.write(d, "j", 1) is None  # no directory yet: nothing to protect, nothing made
    assert not d.exists()
    d.mkdir()
    assert fence.read(d) is None
    fence.check(d, fence.Claim("j", 1), 3)  # no fence: as before
    assert fence.write(d, "j", 2) == d / c.FENCE_FILE
    doc = fence.read(d)
    assert (doc["job"], doc["attempt"]) == ("j", 2)
    assert oct(os.stat(d / c.FENCE_FILE).st_mode & 0o777) == "0o644"
    assert [p.name for p in d.iterdir()] == [c.FENCE_FILE]  # no temporary left
    fence.check(d, fence.Claim("j", 2), 3)
    fence.check(d, fence.Claim("j", 3), 3)  # the plane could not write attempt 3's: still this job's
    with pytest.raises(ckpt.FencedError) as e:
        fence.check(d, fence.Claim("j", 1), 7)
    msg = str(e.value)
    assert "\n" not in msg and f"step 7: commit refused: checkpoint location {d}" in msg
    assert "fenced for job 'j' attempt 2" in msg and "job 'j' attempt 1" in msg
    fence.write(d, "k", 1)
    with pytest.raises(ckpt.FencedError, match="fenced for job 'k' attempt 1"):
        fence.check(d, fence.Claim("j", 5), 1)  # resume_from: another job took the location over


@pytest.mark.parametrize("body", [b"", b"\x00\x00", b"[1]", b'{"job": "j", "attempt": "2"}',
                                  b'{"job": "j", "attempt": true}',
                                  b'{"job": "j", "attempt": 2}' + b" " * 5000])
def test_a_fence_that_is_not_one_refuses(tmp_path, body):
    (tmp_path / c.FENCE_FILE).write_bytes(body)
    with pytest.raises(ckpt.FencedError, match=f"checkpoint fence {tmp_path / c.FENCE_FILE}: not a fence"):
        fence.check(tmp_path, fence.Claim("j", 1), 1)


def test_planted_links_are_not_followed(tmp_path):
    """The location is the job's own directory: a link planted there never makes the plane write elsewhere."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    d = tmp_path / "ck"
    d.mkdir()
    (d / c.FENCE_FILE).symlink_to(victim)
    with pytest.raises(ckpt.FencedError, match="cannot be read"):  # the rank refuses a linked fence
        fence.check(d, fence.Claim("j", 1), 1)
    odd = tmp_path / "odd"
    odd.mkdir()
    os.mkfifo(odd / c.FENCE_FILE)  # never blocks on a FIFO
    with pytest.raises(ckpt.FencedError, match="not a regular file"):
        fence.check(odd, fence.Claim("j", 1), 1)
    os.remove(odd / c.FENCE_FILE)
    (odd / c.FENCE_FILE).mkdir()  # nor reads a directory
    with pytest.raises(ckpt.FencedError, match="not a regular file"):
        fence.check(odd, fence.Claim("j", 1), 1)
    fence.write(d, "j", 1)  # replaces the link itself
    assert victim.read_text() == "keep" and not (d / c.FENCE_FILE).is_symlink()
    assert fence.read(d)["attempt"] == 1


JOB_UID = worker_uid_base() + 1  # a job's uid (isolation.uid_base): its links are not the plane's to follow


@pytest.mark.skipif(os.geteuid() != 0, reason="links owned by a job's uid need root to make")
def test_a_link_a_job_planted_anywhere_in_the_path_is_not_followed(tmp_path):
    """The home, or a directory above it that the job may write (under an admin's grant), swapped for a
    link (the job's uid) to another job's location: the plane writes no fence there, and launches the
    attempt unfenced. A link an administrator set up (the plane's own user) is followed."""
    victim = tmp_path / "victim-ckpt"
    victim.mkdir()
    grant = tmp_path / "grant"
    grant.mkdir()
    (grant / "home").symlink_to(victim)  # the home itself
    (grant / "runs").symlink_to(tmp_path)  # a directory above the home: grant/runs/victim-ckpt
    for link in ("home", "runs"):
        os.lchown(grant / link, JOB_UID, JOB_UID)
    for home in (grant / "home", grant / "runs" / "victim-ckpt"):
        with pytest.raises(OSError, match="does not trust"):
            fence.write(home, "hostile", 9)
        assert fence.fence_launch({c.ENV_CKPT_URL: str(home)}, "hostile", 9) is None  # warned, unfenced
    assert not (victim / c.FENCE_FILE).exists()
    data = tmp_path / "data"
    data.symlink_to(tmp_path)  # the administrator's: /data -> /mnt/data
    assert fence.write(data / "victim-ckpt", "victim", 2) == data / "victim-ckpt" / c.FENCE_FILE
    assert fence.read(victim) == {**fence.read(victim), "job": "victim", "attempt": 2}


def test_claim_and_home_from_the_environment(tmp_path):
    assert fence.Claim.from_env({c.ENV_JOB_ID: "j", c.ENV_ATTEMPT: "3"}) == fence.Claim("j", 3)
    assert fence.Claim.from_env({c.ENV_JOB_ID: "j"}) is None  # outside the plane: not checked
    assert fence.Claim.from_env({c.ENV_JOB_ID: "j", c.ENV_ATTEMPT: "x"}) is None
    assert fence.Claim.from_env({c.ENV_JOB_ID: "j", c.ENV_ATTEMPT: "0"}) is None
    assert fence.home_dir({c.ENV_CKPT_URL: str(tmp_path / "a")}) == tmp_path / "a"
    assert fence.home_dir({c.ENV_CKPT_URL: f"file://{tmp_path}/a"}) == tmp_path / "a"
    assert fence.home_dir({c.ENV_CKPT_URL: "rel/a"}, tmp_path) == tmp_path / "rel" / "a"
    assert fence.home_dir({c.ENV_CKPT_URL: "s3://bucket/p"}) is None
    assert fence.home_dir({c.ENV_CKPT_TIERS: '["s3://bucket/p", "/elsewhere"]'}) is None  # home: S3
    tiers = json.dumps(["shm", str(tmp_path / "b"), {"url": "s3://bucket/p", "every": 2}])
    assert fence.home_dir({c.ENV_CKPT_TIERS: tiers, c.ENV_CKPT_URL: "ignored"}) == tmp_path / "b"
    assert fence.home_dir({c.ENV_CKPT_TIERS: "{not json"}) is None
    assert fence.home_dir({}) is None


# ------------------------------------------------------------------------------ the engine
def test_the_checkpointer_refuses_a_fenced_commit(tmp_path):
    d = tmp_path / "ck"
    stale = ckpt.Checkpointer(d, keep=0, claim=fence.Claim("j", 1), status_path=False)
    try:
        stale.save(1, {"w": torch.ones(4)}).wait()
        fence.write(d, "j", 2)
        with pytest.raises(ckpt.FencedError, match="step 2: commit refused"):
            stale.save(2, {"w": torch.full((4,), 2.0)}).wait()
        assert ckpt.steps(d) == [1]  # nothing of step 2 is visible, in any tier
    finally:
        stale.close()
    for claim, step in ((fence.Claim("j", 2), 3), (False, 4)):  # the owner; a checkpointer without a claim
        with ckpt.Checkpointer(d, keep=0, claim=claim, status_path=False) as cp:
            cp.save(step, {"w": torch.full((4,), float(step))}).wait()
    assert ckpt.steps(d) == [1, 3, 4]
    state = {"w": torch.zeros(4)}
    assert ckpt.load(d, state) == 4 and state["w"].tolist() == [4.0] * 4


def test_other_ranks_learn_that_rank_0_was_fenced(tmp_path):
    tier = DirTier("disk", tmp_path, fsync=False)
    commit.mark_failed(tier, 5, "abc", ckpt.FencedError("step 5: commit refused: ..."))
    with pytest.raises(ckpt.FencedError, match="step 5: commit refused"):
        commit.wait_committed(tier, 5, "abc", timeout_s=5)
    commit.mark_failed(tier, 6, "abd", "disk full")
    with pytest.raises(ckpt.SaveError, match="disk full") as e:
        commit.wait_committed(tier, 6, "abd", timeout_s=5)
    assert not isinstance(e.value, ckpt.FencedError)
    assert tier.read_bytes(6, failure_name("abd")) == b"disk full"


# ------------------------------------------------------------------------------ a stale attempt
def _wait_log(ex: LocalExecutor, job: str, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = Path(ex.log_path(job, 0)).read_text(errors="replace")
        if text in out:
            return out
        assert ex.observe(time.time())[job].alive, f"{job} ended before printing {text!r}:\n{out[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"{job}: no {text!r} within {timeout_s} s")


def _exit_code(ex: LocalExecutor, job: str, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ob = ex.observe(time.time())[job]
        if ob.done:
            return ob.ranks[0].exit_code
        time.sleep(0.05)
    raise AssertionError(f"{job} still running after {timeout_s} s")


def _records(ex: LocalExecutor, job: str, attempt: int) -> list[dict]:
    path = ex.attempt_dir(job, attempt) / c.PROGRESS_DIRNAME / c.progress_file(0)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_stale_attempt_is_fenced_out(tmp_path):
    url = tmp_path / "ckpt"
    hold = tmp_path / "partition-healed"
    env = {c.ENV_CKPT_URL: str(url), c.ENV_CKPT_INTERVAL_STEPS: "2", c.ENV_CKPT_KEEP: "0",
           "OMP_NUM_THREADS": "1"}
    # two nodes of one plane: one range of uids (as root), the test's directory (the hold file) the workdir
    iso = IsolationConfig(uid_base=worker_uid_base()) if os.geteuid() == 0 else IsolationConfig()
    node1, node2 = (LocalExecutor(tmp_path / n, slots=1, isolation=iso) for n in ("node1", "node2"))
    try:
        # Attempt 1 on node 1: steps 2 and 4 committed, then its node is "lost" (the rank holds).
        node1.launch(LaunchRequest("j", 1, (sys.executable, str(WORKER), "--steps", "1000", "--pad-mib", "1",
                                            "--hold-after", "4", "--hold-file", str(hold)),
                                   {"local": 1}, env=env, workdir=str(tmp_path)), time.time())
        _wait_log(node1, "j", "holding 4")
        assert ckpt.steps(url) == [2, 4]
        # The plane restarts the job on node 2 as attempt 2: the executor fences the location first.
        # (Both nodes are one plane's: they share its key, so the job keeps its checkpoint key.)
        shutil.copy2(tmp_path / "node1" / KEY_FILE, tmp_path / "node2" / KEY_FILE)
        node2.launch(LaunchRequest("j", 2, (sys.executable, str(WORKER), "--steps", "10", "--pad-mib", "1"),
                                   {"local": 1}, env=env, workdir=str(tmp_path)), time.time())
        doc = json.loads((url / c.FENCE_FILE).read_text())
        assert (doc["job"], doc["attempt"]) == ("j", 2)
        hold.touch()  # the partition heals: the stale rank trains on and tries to commit step 6
        assert _exit_code(node1, "j") == c.EXIT_FENCED
        log1 = Path(node1.log_path("j", 0)).read_text()
        line = next(x for x in log1.splitlines() if "commit refused" in x)
        assert f"checkpoint location {url} is fenced for job 'j' attempt 2" in line and "step 6" in line
        assert line.endswith(f"exiting with code {c.EXIT_FENCED}")
        stale = _records(node1, "j", 1)
        assert [r["step"] for r in stale if r["event"] == "committed"] == [2, 4]
        assert [(r["step"], r["exit_code"]) for r in stale if r["event"] == "fenced"] == [(6, c.EXIT_FENCED)]
        assert _exit_code(node2, "j") == 0
    finally:
        for ex in (node1, node2):
            if "j" in ex._jobs:
                ex.kill("j")
    assert "restored 4" in Path(node2.log_path("j", 0)).read_text()  # the newest step before the fence
    legit = _records(node2, "j", 2)
    mine = [r["step"] for r in legit if r["event"] == "committed"]
    assert mine == [6, 8, 10]
    assert ckpt.steps(url) == [2, 4, 6, 8, 10]  # after the fence: attempt 2's steps only


# ------------------------------------------------------------------------------ an S3 home
@pytest.mark.slow
def test_an_s3_home_is_claimed_by_its_rank_0_and_checked_before_each_commit(s3):
    """An S3 home is fenced, so a stale attempt cannot commit manifests over the new attempt's: the
    new attempt's rank 0 PUTs ``<prefix>/fence.json`` when its checkpointer starts (with the job's own
    credentials: the plane makes no S3 request, so a job's ``AWS_ENDPOINT_URL`` cannot point the plane at
    an address of its choosing) and every rank 0 GETs it before each manifest. A crafted or oversized
    object refuses; a stale attempt starting late never claims the location back."""
    from tidal.ckpt.tiers.s3 import S3Tier

    assert fence.fence_launch({c.ENV_CKPT_URL: s3.url, "AWS_ENDPOINT_URL": "http://169.254.169.254"},
                              "j", 2) is None  # the plane: nothing to do for an S3 home
    tier = S3Tier(s3.url)
    stale = ckpt.Checkpointer(s3.url, keep=0, claim=fence.Claim("j", 1), status_path=False)
    try:
        assert fence.read_s3(tier)["attempt"] == 1  # attempt 1 claimed it when it started
        stale.save(1, {"w": torch.ones(4)}).wait()
        with ckpt.Checkpointer(s3.url, keep=0, claim=fence.Claim("j", 2), status_path=False) as cp:
            assert fence.read_s3(tier)["attempt"] == 2  # attempt 2 starts: the location is its own
            with pytest.raises(ckpt.FencedError, match=r"step 2: commit refused: .* for job 'j' attempt 2"):
                stale.save(2, {"w": torch.full((4,), 2.0)}).wait()
            assert ckpt.steps(s3.url) == [1] and tier.step_files().keys() == {1}  # the fence is no step
            late = ckpt.Checkpointer(s3.url, keep=0, claim=fence.Claim("j", 1), status_path=False)
            late.close()
            assert fence.read_s3(tier)["attempt"] == 2  # a stale attempt starting late claims nothing
            cp.save(3, {"w": torch.full((4,), 3.0)}).wait()
            assert ckpt.steps(s3.url) == [1, 3]
            tier.write_top(c.FENCE_FILE, b"\x00" * 100)  # crafted after the start: not a fence, refuses
            with pytest.raises(ckpt.FencedError, match="not a fence"):
                cp.save(4, {"w": torch.full((4,), 4.0)}).wait()
    finally:
        stale.close()
    tier.write_top(c.FENCE_FILE, b"{" + b" " * 5000 + b"}")  # too large to be one
    with pytest.raises(ckpt.FencedError, match="not a fence"):
        fence.read_s3(tier)
    with ckpt.Checkpointer(s3.url, keep=0, claim=fence.Claim("j", 3), status_path=False) as cp:
        cp.save(5, {"w": torch.full((4,), 5.0)}).wait()  # a new attempt replaces what is not a fence
    assert fence.read_s3(tier)["attempt"] == 3 and ckpt.steps(s3.url) == [1, 3, 5]


def test_an_s3_fence_that_cannot_be_reached_lets_the_commit_go_on(caplog):
    """Through an S3 outage the engine commits to its other tiers (and nothing reaches S3): the fence's
    GET failing must not fence the job out. A fence that answers is obeyed."""
    import logging

    from tidal.ckpt.errors import TierError

    class Store:
        location = "s3://bucket/job"

        def __init__(self, answer):
            self.answer = answer

        def read_top(self, name, limit):
            assert name == c.FENCE_FILE and limit == fence.MAX_FENCE_BYTES
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    with caplog.at_level(logging.WARNING, logger="tidal.ckpt.fence"):
        fence.check_s3(Store(TierError("tier 's3': connection refused")), fence.Claim("j", 1), 5)
    assert "fence s3://bucket/job/fence.json cannot be read" in caplog.text and "unchecked" in caplog.text
    fence.check_s3(Store(None), fence.Claim("j", 1), 5)  # no fence
    newer = json.dumps({"job": "j", "attempt": 2}).encode()
    with pytest.raises(ckpt.FencedError, match="step 5: commit refused: checkpoint location s3://bucket/job"):
        fence.check_s3(Store(newer), fence.Claim("j", 1), 5)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidal.ckpt.fence"):
        assert fence.claim_s3(Store(TierError("down")), fence.Claim("j", 1)) is False  # training starts
    assert "cannot be written" in caplog.text

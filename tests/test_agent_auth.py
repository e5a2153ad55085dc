"""Checkpoint agents with a key (``tidal.ckpt.agent.auth``): two real agent processes on loopback, each
the other's buddy, started as the executor starts them (the key in their own environment). Job A
checkpoints through the real peer tier with its token; job B, with its own valid token, cannot read,
list, overwrite or delete A's step on either agent; no token, forged tokens (another key, truncated,
NUL bytes, a huge header) and a job token on the agents' own endpoints get 403 with a one-line reason,
and nothing changes. A restores its step, from its own agent and from the buddy; a plane restart
keeps the key, so A's token stays valid. Every agent is stopped by pid, also when a test fails.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tidal import ckpt
from tidal.ckpt.agent.auth import KEY_FILE, agent_token, job_token, load_or_create_key, read_key
from tidal.ckpt.agent.proc import AgentProcess
from tidal.ckpt.errors import TierError, TierSpecError
from tidal.ckpt.tiers.peer import PeerTier
from tidal.contract import ENV_CKPT_AGENT_KEY, ENV_CKPT_AGENT_TOKEN

A, B = "job-a", "job-b"  # the two jobs' namespaces in the agents


@pytest.fixture
def agents(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))
    for k in ("TIDAL_CKPT_AGENT", "TIDAL_CKPT_PEERS", ENV_CKPT_AGENT_TOKEN, ENV_CKPT_AGENT_KEY):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "state").mkdir()
    key = load_or_create_key(tmp_path / "state")  # what the plane does at start
    procs = [AgentProcess(tmp_path / f"mem-{n}", node=n, resync_s=0.2, key=key) for n in "ab"]
    procs[0].buddy, procs[1].buddy = procs[1].address, procs[0].address
    try:
        for p in procs:
            p.start()
        yield key, procs[0], procs[1]
    finally:
        for p in procs:
            p.stop()


def raw(address: str, method: str, path: str, token: str | None = None, body: bytes | None = None,
        auth: str | None = None) -> tuple[int, dict]:
    """One request on a fresh connection; ``auth``: the whole Authorization header, as given."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        hdrs = {"Authorization": auth} if auth is not None else (
            {"Authorization": f"Bearer {token}"} if token else {})
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if r.getheader("Content-Type") == "application/json" else {})
    finally:
        conn.close()


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 8, generator=g), "step": step}


def attacks(bob: PeerTier) -> list:
    """Everything a job can do to a step through the peer tier: list, read, write, remove."""
    buf = memoryview(bytearray(4))
    return [bob.committed, lambda: bob.read_bytes(1, "manifest.json"), lambda: bob.file_sizes(1),
            lambda: bob.write_bytes(1, "manifest.json", b"{}"),
            lambda: bob.write_file(1, "r00000-evil.safetensors", memoryview(b"x" * 64)),
            lambda: bob.open_file(1, "manifest.json").read_ranges([(0, 4)], buf),
            lambda: bob.remove_file(1, "manifest.json"), lambda: bob.remove_step(1)]


def test_a_job_reaches_only_its_own_steps(agents, tmp_path, monkeypatch):
    key, a, b = agents
    tok_a, tok_b, plane = job_token(key, A), job_token(key, B), agent_token(key)
    tiers = ["shm", {"kind": "peer", "agent": a.address, "job": A}]
    monkeypatch.setenv(ENV_CKPT_AGENT_TOKEN, tok_a)  # what the executor gives A's ranks
    with ckpt.Checkpointer(tiers=tiers) as cp:
        h = cp.save(1, state(1))
        h.wait()
        assert h.committed == ["shm", "peer"]
    monkeypatch.delenv(ENV_CKPT_AGENT_TOKEN)

    def held(agent) -> dict:
        """A's step on ``agent`` as the plane sees it (the agent token)."""
        st, doc = raw(agent.address, "GET", f"/v1/jobs/{A}", plane)
        assert st == 200
        return doc["steps"]

    before = held(a)
    assert set(before) == {"1"} and "manifest.json" in before["1"]["files"]
    # The buddy holds a replica: pushed with the agent token.
    rows = lambda: [r for r in a.status()["steps"] if r["job"] == A and r["node"] == "a"]  # noqa: E731
    deadline = time.monotonic() + 20
    while not (b.status()["steps"] and rows() and rows()[0]["replicated"]):
        assert time.monotonic() < deadline, (a.status(), b.status())
        time.sleep(0.05)
    assert [(r["job"], r["step"], r["from"]) for r in b.status()["steps"]] == [(A, 1, "replica")]

    # Job B, with its own valid token, through the real peer tier, at A's agent and at the buddy.
    for agent in (a, b):
        bob = PeerTier(A, agent=agent.address, token=tok_b)
        for attempt in attacks(bob):
            with pytest.raises(TierError, match="HTTP 403: the steps of 'job-a': the token given is not"):
                attempt()
        bob.discard(1, "manifest.json")  # best effort: refused quietly
        for c in bob._clients.values():
            c.drop()
    for k, v, why in [(ENV_CKPT_AGENT_TOKEN, "ab\r\nX-Evil: 1", "TOKEN: expected the hex token"),
                      (ENV_CKPT_AGENT_KEY, "12", "KEY: expected 64 hex digits")]:
        monkeypatch.setenv(k, v)
        with pytest.raises(TierSpecError, match=why):
            PeerTier(A, agent=a.address)
        monkeypatch.delenv(k)
    # B's token is good for B's own namespace, and nothing of A's shows there.
    assert PeerTier(B, agent=a.address, token=tok_b).committed() == {}

    wrong = hmac.new(b"k" * 32, b"tidal-ckpt-agent/job\0" + A.encode(), hashlib.sha256).hexdigest()
    forged = {
        "no token": None,
        "B's token": f"Bearer {tok_b}",
        "another key": f"Bearer {wrong}",
        "truncated": f"Bearer {tok_a[:-1]}",
        "half": f"Bearer {tok_a[:32]}",
        "NUL appended": f"Bearer {tok_a}\0",
        "NUL bytes": "Bearer " + "\0" * 64,
        "huge": "Bearer " + tok_a * 800,  # ~51 KiB of header
        "not bearer": f"Basic {tok_a}",
        "empty": "Bearer ",
        "agent token of another key": f"Bearer {agent_token(b'k' * 32)}",
    }
    paths = [("GET", f"/v1/jobs/{A}"), ("GET", f"/v1/jobs/{A}/step_000000000001"),
             ("GET", f"/v1/jobs/{A}/step_000000000001/manifest.json"),
             ("PUT", f"/v1/jobs/{A}/step_000000000001/manifest.json"),
             ("DELETE", f"/v1/jobs/{A}/step_000000000001"),
             ("POST", f"/v1/jobs/{A}/step_000000000001/x.bin?copy_from=/dev/shm/tidal/x&length=1")]
    for why, auth in forged.items():
        for method, path in paths:
            st, doc = raw(a.address, method, path, body=b"{}" if method == "PUT" else None,
                          auth=auth if auth is not None else None)
            assert st == 403, (why, method, path, st, doc)
            assert "\n" not in doc["error"] and "job-a" in doc["error"], doc
    assert raw(a.address, "GET", f"/v1/jobs/{A}")[1]["error"] == (
        "the steps of 'job-a' need a token (Authorization: Bearer $TIDAL_CKPT_AGENT_TOKEN)")
    # A job's token is not the agents': their replica trees stay closed to it (listing, writing, deleting).
    replica = f"/v1/replicas/a/{A}/step_000000000001"
    for method, path in [("GET", "/v1/replicas/a"), ("PUT", f"{replica}/manifest.json"), ("DELETE", replica)]:
        for tok in (tok_a, tok_b, None):
            st, doc = raw(b.address, method, path, tok, body=b"{}" if method == "PUT" else None)
            assert st == 403 and doc["error"] == "this endpoint is the agents' own: " + (
                "the token given is not theirs" if tok else "no token given"), (method, path, doc)
    # /status answers everyone (the peer tier learns the buddy from it), but lists steps to the agents only.
    for tok in (None, tok_a):
        st, doc = raw(a.address, "GET", "/status", tok)
        assert st == 200 and doc["auth"] is True and "steps" not in doc
        assert doc["buddy"]["address"] == b.address

    # Nothing was stored or removed, at A's agent or at the buddy.
    assert held(a) == before
    st, doc = raw(b.address, "GET", "/v1/replicas/a", plane)
    assert st == 200 and set(doc["jobs"]) == {A} and set(doc["jobs"][A]["1"]) == set(before["1"]["files"])

    # A plane restart keeps the key (same file, 0600): A's token stays valid, A restores its step,
    # from its own agent and, its node gone, from the buddy.
    key_file = tmp_path / "state" / KEY_FILE
    assert load_or_create_key(tmp_path / "state") == key and (os.stat(key_file).st_mode & 0o777) == 0o600
    tok_again = job_token(load_or_create_key(tmp_path / "state"), A)
    assert tok_again == tok_a
    monkeypatch.setenv(ENV_CKPT_AGENT_TOKEN, tok_again)
    for agent in (a, b):
        target = {"w": torch.zeros(32, 8), "step": -1}
        assert ckpt.load([{"kind": "peer", "agent": agent.address, "job": A}], target) == 1
        assert torch.equal(target["w"], state(1)["w"]) and target["step"] == 1
        if agent is a:
            a.kill()
    # The operator's `tidal ckpt ls` with the plane's key lists A's steps; the plane (agent token) frees them.
    from typer.testing import CliRunner

    from tidal.ckpt.cli import app

    monkeypatch.delenv(ENV_CKPT_AGENT_TOKEN)
    for env, code in [({ENV_CKPT_AGENT_KEY: key.hex()}, 0), ({ENV_CKPT_AGENT_TOKEN: tok_b}, 1)]:
        r = CliRunner().invoke(app, ["ls", f"peer://{A}", "--json"],
                               env={"TIDAL_CKPT_AGENT": b.address, **env})
        assert r.exit_code == code, r.output
        assert code or [s["step"] for s in json.loads(r.stdout)["steps"]] == [1]
        assert not code or "403" in r.output
    assert PeerTier(A, agent=b.address, token=plane).committed_steps() == [1]
    PeerTier(A, agent=b.address, token=plane).remove_step(1)
    assert PeerTier(A, agent=b.address, token=tok_a).committed_steps() == []


def test_key_files_and_an_agent_given_a_bad_key(tmp_path):
    """The key file: created 0600 once, refused when others may read it or when it is a link; an agent
    given a bad key exits with a one-line error naming the file (or the variable)."""
    key = load_or_create_key(tmp_path)
    path = tmp_path / KEY_FILE
    assert read_key(path) == key and len(key) == 32
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]  # (written through a temporary file)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"key file .*: mode 0o644; expected 0600"):
        load_or_create_key(tmp_path)
    path.chmod(0o600)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(ValueError, match="key file .*link: "):
        read_key(tmp_path / "link")
    (tmp_path / "short").write_text("abcd\n")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(ValueError, match="expected 64 hex digits"):
        read_key(tmp_path / "short")
    cmd = [sys.executable, "-m", "tidal.ckpt.agent", "--listen", "127.0.0.1:0", "--mem-dir",
           str(tmp_path / "m")]
    env = {k: v for k, v in os.environ.items() if k != ENV_CKPT_AGENT_KEY}
    for extra, env_key, want in [
        (["--no-copy-from", "--key-file", str(tmp_path / "short")], None,
         f"key file {tmp_path / 'short'}: expected 64 hex digits"),
        ([], "zz" * 32, "$TIDAL_CKPT_AGENT_KEY: expected 64 hex digits"),
    ]:
        r = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=60,
                           env={**env, **({ENV_CKPT_AGENT_KEY: env_key} if env_key else {})})
        assert r.returncode == 2 and want in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("tiers, job", [
    (["shm", "/ckpt/jobs/j1/ckpt", "peer"], "j1"),
    (["peer", {"url": "s3://bucket/runs/r7", "every": 3}], "j2"),
    (["peer"], "j 3/x"),
    (["shm", "peer://p-test"], "p"),
])
def test_the_executor_signs_the_namespace_the_ranks_peer_tier_uses(tiers, job, monkeypatch):
    """``agent_namespace`` (what the executor signs for a rank) is the namespace of the peer tier that
    rank builds from its ``TIDAL_CKPT_TIERS`` and ``TIDAL_JOB_ID``."""
    from tidal.ckpt.tiers.config import build, resolve
    from tidal.exec.ray_names import agent_namespace

    monkeypatch.setenv("TIDAL_JOB_ID", job)
    home, cfgs = resolve(tiers, default_keep=0)
    peer = build(next(c for c in cfgs if c.kind == "peer"), home)
    monkeypatch.setenv("TIDAL_JOB_ID", "another-job")  # the executor's own environment says nothing
    assert agent_namespace({"TIDAL_CKPT_TIERS": json.dumps(tiers)}, job) == peer.job
    assert agent_namespace({"TIDAL_CKPT_URL": "/ckpt/jobs/j1/ckpt"}, "j1") == "ckpt-" + hashlib.sha256(
        b"/ckpt/jobs/j1/ckpt").hexdigest()[:32]
    assert agent_namespace({"TIDAL_CKPT_TIERS": "{not json"}, "j1") == "j1"  # the runtime fails on it


def test_a_jobs_namespace_is_too_wide_to_search_for_and_always_a_valid_name(tmp_path, monkeypatch):
    """A job's namespace (the one its token is made for) is its location's name and a 128-bit digest:
    a tenant cannot search for a location of its own that has another job's name and digest (48 bits,
    as it was, are within reach). A location whose name is as long as a name may be still gives a
    directory name the filesystem takes."""
    from tidal.ckpt.tiers.config import peer_namespace
    from tidal.ckpt.tiers.directory import shm_root_for

    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))
    ns = peer_namespace(str(tmp_path / "tenants" / "a" / "run"), None, "j")
    name, digest = ns.rsplit("-", 1)
    assert name == "run" and len(digest) * 4 >= 128 and int(digest, 16) >= 0
    assert ns != peer_namespace(str(tmp_path / "tenants" / "b" / "run"), None, "k")
    long = tmp_path / ("x" * 255)
    root = shm_root_for(long)
    root.mkdir(parents=True)  # ENAMETOOLONG with the whole name before the digest
    assert root.name.endswith(peer_namespace(str(long), None, "j")[-32:])

"""The peer-memory tier with real agents: separate processes on loopback ports, each with its own
memory directory, standing in for the nodes of a cluster (A's buddy is B, B's is C, C's is A).

Node loss is ``kill -9`` of an agent plus deleting its memory directory and the job's shm tier; a
restore then reads from the buddy, resharded. Every agent is stopped by pid at the end of each test,
also when it fails.
"""

from __future__ import annotations

import http.client
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from dist_harness import run_workers
from tidal import ckpt
from tidal.ckpt.agent.proc import AgentProcess
from tidal.ckpt.agent.server import Agent
from tidal.ckpt.tiers.directory import shm_root_for
from tidal.ckpt.tiers.peer import PeerTier

ROWS, COLS = 48, 20


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "shm"
    monkeypatch.setenv("TIDAL_SHM_DIR", str(d))  # the agents inherit it: they may copy slots from there
    monkeypatch.delenv("TIDAL_CKPT_AGENT", raising=False)
    monkeypatch.delenv("TIDAL_CKPT_PEERS", raising=False)
    return d


@pytest.fixture
def nodes(tmp_path, shm):
    """Three agents in a ring, started; stopped by pid afterwards whatever happened."""
    procs = [AgentProcess(tmp_path / f"mem-{n}", node=n, resync_s=0.2) for n in "abc"]
    for i, p in enumerate(procs):
        p.buddy = procs[(i + 1) % 3].address
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.arange(COLS, dtype=torch.int64) * step,
            "step": step}


def eventually(fn, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (v := fn()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
    return v


def rows_of(st: dict, node: str, job: str) -> list[dict]:
    return [r for r in st["steps"] if r["job"] == job and r["node"] == node]


def test_node_loss_restores_from_the_buddy_resharded(nodes, tmp_path, shm):
    a, b, c = nodes
    job = "run1"
    tiers = ["shm", {"kind": "peer", "agent": a.address, "job": job}]
    with ckpt.Checkpointer(tiers=tiers, keep=2) as cp:
        for step in (1, 2, 3):
            h = cp.save(step, state(step))
            h.wait()
            assert h.committed == ["shm", "peer"]
    st = cp.status()  # after close: retention has run
    assert st.tier("peer").steps == (2, 3) and st.tier("peer").durable and st.newest_durable_step == 3
    # A holds the steps it was handed (copied from the staging slot, not sent over HTTP); B a replica of each.
    sa, sb = a.status(), b.status()
    assert [(r["step"], r["from"], r["committed"], r["replicated"]) for r in rows_of(sa, "a", job)] == [
        (2, "own", True, True), (3, "own", True, True)]
    assert [(r["step"], r["from"], r["committed"]) for r in rows_of(sb, "a", job)] == [(2, "replica", True),
                                                                                      (3, "replica", True)]
    assert (
        sa["copied_bytes"] >= 3 * ROWS * COLS * 4 and sa["received_bytes"] < 20_000
    )  # sidecars and manifests
    assert sa["buddy"]["address"] == b.address and sa["buddy"]["reachable"] and not c.status()["steps"]

    a.kill()  # node A is gone: its agent, its memory, the job's shared memory
    shutil.rmtree(a.mem_dir)
    shutil.rmtree(shm_root_for(f"peer://{job}"))
    # The job restarts on node B, on three ranks holding row blocks of another layout.
    on_b = ["shm", {"kind": "peer", "agent": b.address, "job": job}]
    want = state(3)
    for r0, r1 in [(0, 7), (7, 30), (30, 48)]:
        part = torch.full((r1 - r0, COLS), float("nan"))
        target = {
            "w": ckpt.LocalShard(part, (r0, 0), (ROWS, COLS)),
            "b": torch.zeros(COLS, dtype=torch.int64),
            "step": -1,
        }
        stats = ckpt.LoadStats()
        assert ckpt.load(on_b, target, stats=stats) == 3
        assert (
            torch.equal(part, want["w"][r0:r1])
            and torch.equal(target["b"], want["b"])
            and target["step"] == 3
        )
        assert stats.bytes_by_tier == {"peer": stats.bytes_read}
        # pieces smaller than one checksum block are read whole (and checked), never more
        assert (
            stats.bytes_needed
            <= stats.bytes_read
            <= sum(t.numel() * t.element_size() for t in (want["w"], want["b"]))
        )
        assert stats.manifest_tier == "peer" and stats.fallbacks == []
    assert ckpt.steps(on_b) == [2, 3]
    from typer.testing import CliRunner

    from tidal.ckpt.cli import app

    r = CliRunner().invoke(app, ["ls", f"peer://{job}", "--json"], env={"TIDAL_CKPT_AGENT": b.address})
    assert r.exit_code == 0, r.output
    assert [(s["step"], s["tiers"]) for s in json.loads(r.stdout)["steps"]] == [(2, ["peer"]), (3, ["peer"])]
    # inspect / verify / export read the peer tier too (Range requests to the buddy's agent).
    r = CliRunner().invoke(app, ["verify", f"peer://{job}", "--all"], env={"TIDAL_CKPT_AGENT": b.address})
    assert r.exit_code == 0, r.output
    assert (
        "OK   step 2 tier peer: 2 piece(s) in 1 file(s)" in r.stdout and "OK   step 3 tier peer" in r.stdout
    )
    replica = next((b.mem_dir / "replica" / "a" / job / "step_000000000003").glob("*.safetensors"))
    with open(replica, "r+b") as f:  # flip a byte of the last piece: verify names the object and tensor
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    r = CliRunner().invoke(app, ["verify", json.dumps([{"kind": "peer", "agent": b.address, "job": job}]),
                                 "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and [(p["tier"], p["step"], p["file"]) for p in doc["problems"]] == [
        ("peer", 3, f"peer://{job}/step_000000000003/{replica.name}")]
    assert "checksum mismatch" in doc["problems"][0]["problem"]
    with open(replica, "r+b") as f:
        f.seek(-1, 2)
        f.write(last)
    # Or from a node that names the dead agent and knows the others (TIDAL_CKPT_PEERS).
    via_peers = ["shm", {"kind": "peer", "agent": a.address, "peers": [c.address, b.address], "job": job}]
    target = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.int64), "step": -1}
    assert ckpt.load(via_peers, target, step=2) == 2 and torch.equal(target["w"], state(2)["w"])


def test_agent_restart_takes_up_its_memory_and_refills_an_empty_buddy(nodes, shm):
    a, b, _ = nodes
    tiers = [{"url": "shm"}, {"kind": "peer", "agent": a.address, "job": "j2"}]
    with ckpt.Checkpointer(tiers=tiers) as cp:
        cp.save(5, state(5)).wait()
    a.kill()  # the agent process dies, the node (and its memory directory) lives
    b.kill()  # the buddy node is replaced by an empty one
    shutil.rmtree(b.mem_dir)
    a.start()
    b.start()
    assert [(r["step"], r["committed"]) for r in rows_of(a.status(), "a", "j2")] == [(5, True)]
    # A pushes its committed step to the new B on its own (resync), manifest last.
    eventually(lambda: [r for r in rows_of(b.status(), "a", "j2") if r["committed"]])
    a.kill()
    shutil.rmtree(a.mem_dir)
    shutil.rmtree(shm_root_for("peer://j2"))
    target = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.int64), "step": -1}
    stats = ckpt.LoadStats()
    assert ckpt.load(["shm", {"kind": "peer", "agent": b.address, "job": "j2"}], target, stats=stats) == 5
    assert torch.equal(target["w"], state(5)["w"]) and set(stats.bytes_by_tier) == {"peer"}


def test_buddy_outage_holds_the_commit_back_until_it_returns(nodes, shm):
    a, b, _ = nodes
    tiers = ["shm", {"kind": "peer", "agent": a.address, "job": "j3"}]
    peer = PeerTier("j3", agent=a.address)
    cp = ckpt.Checkpointer(tiers=tiers, retry_max_s=0.3)
    try:
        cp.save(1, state(1)).wait()
        b.kill()
        h = cp.save(2, state(2))
        h.wait(timeout=30, fast_only=True)
        assert h.committed == ["shm"] and h.pending == ["peer"]
        st = eventually(lambda: cp.status() if cp.status().tier("peer").last_error else None)
        assert b.address in st.tier("peer").last_error and st.tier("peer").backlog == (2,)
        assert peer.committed_steps() == [1]  # never visible while only one node holds it
        assert a.status()["buddy"]["reachable"] is False
        b.start()
        h.wait(timeout=30)
        assert h.committed == ["shm", "peer"]
    finally:
        cp.close(timeout_s=30)
    assert peer.committed_steps() == [1, 2]
    assert [r["step"] for r in rows_of(b.status(), "a", "j3") if r["committed"]] == [1, 2]


@pytest.mark.slow
def test_two_ranks_commit_through_one_agent_and_reshard_from_the_buddy(nodes, shm, tmp_path):
    a, b, _ = nodes
    outs = run_workers("peer_worker", 2, [a.address, "j4"], shm_dir=shm, timeout=120)
    assert all("committed 2 shm+peer" in o for o in outs), outs
    a.kill()
    shutil.rmtree(a.mem_dir)
    full = torch.arange(40 * 12, dtype=torch.float32).reshape(40, 12) + 2
    for r0, r1 in [(0, 13), (13, 40)]:
        part = torch.zeros(r1 - r0, 12)
        target = {"w": ckpt.LocalShard(part, (r0, 0), (40, 12)), "rep": torch.zeros(5), "step": 0}
        stats = ckpt.LoadStats()
        assert ckpt.load([{"kind": "peer", "agent": b.address, "job": "j4"}], target, stats=stats) == 2
        assert torch.equal(part, full[r0:r1]) and torch.equal(target["rep"], torch.full((5,), 2.0))
        assert set(stats.bytes_by_tier) == {"peer"}


def test_peer_spec_errors_name_what_to_set(shm, monkeypatch):
    monkeypatch.setenv("TIDAL_JOB_ID", "my job")
    with pytest.raises(ckpt.TierError, match="no checkpoint agent configured.*TIDAL_CKPT_AGENT"):
        ckpt.Checkpointer(tiers=["shm", "peer"])
    monkeypatch.setenv("TIDAL_CKPT_AGENT", "127.0.0.1:9")
    with pytest.raises(ckpt.TierError, match=r"127.0.0.1:9 unreachable.*is `tidal ckpt agent` running"):
        ckpt.Checkpointer(tiers=["shm", "peer"])
    from tidal.ckpt.tiers.config import resolve

    home, cfgs = resolve(["shm", "peer"], default_keep=1)
    assert home == "peer://my-job" and cfgs[1].location == "peer://my-job" and cfgs[1].kind == "peer"


# -- the agent's HTTP API, in this process ----------------------------------------------------------

@pytest.fixture
def agent(tmp_path, shm):
    ag = Agent("127.0.0.1:0", tmp_path / "mem", allow_copy_from=[str(shm)]).start()
    try:
        yield ag
    finally:
        ag.close()


def call(ag: Agent, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, _, port = ag.address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


def test_an_agent_with_no_copy_from_reads_no_file_a_client_names(shm, tmp_path):
    """``--no-copy-from`` (an agent as root while jobs run as their own uids, on Ray): a staging slot even
    under the default root is refused (403: the peer tier then sends the bytes), bytes sent are taken."""
    from tidal.ckpt.agent.server import main

    slot = shm / "tidal" / "slot"
    slot.parent.mkdir(parents=True)
    slot.write_bytes(b"x" * 64)
    ag = Agent("127.0.0.1:0", tmp_path / "mem", allow_copy_from=[]).start()
    try:
        p = "/v1/jobs/j/step_000000000001/r00000-x.safetensors"
        status, body, _ = call(ag, "POST", f"{p}?copy_from={slot}&length=64&hold=1")
        assert status == 403 and b"outside the allowed roots []" in body
        assert call(ag, "PUT", p, b"y" * 64)[0] == 200 and call(ag, "GET", p)[1] == b"y" * 64
    finally:
        ag.close()
    with pytest.raises(SystemExit):
        main(["--listen", "127.0.0.1:0", "--mem-dir", str(tmp_path / "m2"), "--no-copy-from",
              "--allow-copy-from", str(shm)])


def test_agent_api_ranges_copy_roots_and_commit_check(agent, shm, tmp_path):
    p = "/v1/jobs/j/step_000000000007"
    assert call(agent, "PUT", f"{p}/r00000-x.safetensors", b"0123456789")[0] == 200
    assert call(agent, "GET", f"{p}/r00000-x.safetensors", headers={"Range": "bytes=2-5"})[:2] == (
        206,
        b"2345",
    )
    assert call(agent, "GET", f"{p}/r00000-x.safetensors", headers={"Range": "bytes=8-20"})[1] == b"89"
    assert call(agent, "GET", f"{p}/r00000-x.safetensors", headers={"Range": "bytes=10-11"})[0] == 416
    assert call(agent, "GET", f"{p}/nope")[0] == 404
    assert call(agent, "GET", "/v1/jobs/j/step_000000000007/..%2Fx")[0] == 400  # names are single segments
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 64)
    status, body, _ = call(agent, "POST", f"{p}/r00001-x.safetensors?copy_from={outside}&length=64")
    assert status == 403 and b"outside the allowed roots" in body
    slot = shm / "slot"
    slot.parent.mkdir(parents=True, exist_ok=True)
    slot.write_bytes(bytes(range(256)) * 4)
    assert call(agent, "POST", f"{p}/r00001-x.safetensors?copy_from={slot}&length=1000")[0] == 200
    assert call(agent, "GET", f"{p}/r00001-x.safetensors")[1] == (bytes(range(256)) * 4)[:1000]
    # Held (what the peer tier sends): without a buddy the local copy starts at once.
    assert call(agent, "POST", f"{p}/r00002-x.safetensors?copy_from={slot}&length=24&hold=1")[0] == 202
    assert json.loads(call(agent, "POST", f"{p}/r00002-x.safetensors?wait=copy")[1])["copied"] is True
    assert call(agent, "GET", f"{p}/r00002-x.safetensors")[1] == bytes(range(24))
    assert call(agent, "DELETE", f"{p}/r00002-x.safetensors")[0] == 200
    # A manifest whose data file (of a rank whose sidecar is here) is not whole is refused: 409.
    assert call(agent, "PUT", f"{p}/r00000-x.json?sync=1", b"{}")[0] == 200
    man = {"save_id": "x", "files": [{"name": "r00000-x.safetensors", "rank": 0, "size_bytes": 11}]}
    status, body, _ = call(agent, "PUT", f"{p}/manifest.json?sync=1", json.dumps(man).encode())
    assert status == 409 and b"10 bytes here" in body
    man["files"][0]["size_bytes"] = 10
    assert call(agent, "PUT", f"{p}/manifest.json?sync=1", json.dumps(man).encode())[0] == 200
    idx = json.loads(call(agent, "GET", "/v1/jobs/j")[1])
    assert set(idx["steps"]["7"]["files"]) == {"manifest.json", "r00000-x.json", "r00000-x.safetensors",
                                              "r00001-x.safetensors"}
    st = json.loads(call(agent, "GET", "/status")[1])
    assert st["format"] == "tidal-ckpt-agent" and st["buddy"] is None and st["copied_bytes"] == 1024
    assert [(r["job"], r["step"], r["from"], r["committed"]) for r in st["steps"]] == [("j", 7, "own", True)]
    assert (
        call(agent, "DELETE", p)[0] == 200 and json.loads(call(agent, "GET", "/v1/jobs/j")[1])["steps"] == {}
    )


def test_held_handoff_pushes_first_copies_after_and_commits_on_the_buddy(tmp_path, shm):
    """hold=1: the agent answers at once, pushes the slot to its buddy, copies it after; the commit
    needs only the buddy's copy, and the local copy ends before wait=copy answers."""
    buddy = Agent("127.0.0.1:0", tmp_path / "mem-b").start()
    ag = Agent("127.0.0.1:0", tmp_path / "mem-a", buddy=buddy.address, allow_copy_from=[str(shm)]).start()
    try:
        p = "/v1/jobs/j/step_000000000003"
        slot = shm / "slot"
        slot.parent.mkdir(parents=True, exist_ok=True)
        payload = bytes(range(256)) * 4096
        slot.write_bytes(payload + b"tail")
        status, body, _ = call(
            ag, "POST", f"{p}/r00000-x.safetensors?copy_from={slot}&length={len(payload)}&hold=1"
        )
        assert status == 202 and json.loads(body) == {"bytes": len(payload), "held": True}
        assert (
            call(ag, "PUT", f"{p}/r00000-x.json?sync=1", b"{}")[0] == 200
        )  # answered once the buddy has both
        man = {
            "save_id": "x",
            "files": [{"name": "r00000-x.safetensors", "rank": 0, "size_bytes": len(payload)}],
        }
        assert call(ag, "PUT", f"{p}/manifest.json?sync=1", json.dumps(man).encode())[0] == 200
        assert json.loads(call(ag, "POST", f"{p}/r00000-x.safetensors?wait=copy")[1]) == {
            "copied": True,
            "error": None,
        }
        slot.write_bytes(b"x" * len(payload))  # the rank reuses its slot: both copies keep the step's bytes
        assert call(ag, "GET", f"{p}/r00000-x.safetensors")[1] == payload
        replica = tmp_path / "mem-b" / "replica" / ag.node / "j" / "step_000000000003"
        assert (replica / "r00000-x.safetensors").read_bytes() == payload and (
            replica / "manifest.json"
        ).is_file()
        assert json.loads(call(ag, "GET", "/status")[1])["copied_bytes"] == len(payload)
        assert call(ag, "POST", f"{p}/nope.safetensors?wait=copy")[0] == 404
    finally:
        ag.close()
        buddy.close()


def test_held_handoff_with_a_stalled_buddy_copies_anyway_and_honours_a_removal(tmp_path, shm):
    """A buddy that takes the connection but never reads: the local copy starts once the push stalls
    (so the slot is not held for the buddy's sake), and an object removed meanwhile does not reappear."""
    import socket

    stalled = socket.create_server(("127.0.0.1", 0))  # accepts TCP connections, never answers
    ag = Agent("127.0.0.1:0", tmp_path / "mem", buddy=f"127.0.0.1:{stalled.getsockname()[1]}",
               allow_copy_from=[str(shm)]).start()
    try:
        ag.stall_s = 0.5
        slot = shm / "slot"
        slot.parent.mkdir(parents=True, exist_ok=True)
        size = 48 << 20  # far more than loopback socket buffers take
        slot.write_bytes(b"\x01" * size)
        p = "/v1/jobs/j/step_000000000004"
        q = f"copy_from={slot}&length={size}&hold=1"
        assert call(ag, "POST", f"{p}/r00000-x.safetensors?{q}")[0] == 202
        assert call(ag, "POST", f"{p}/r00001-y.safetensors?{q}")[0] == 202
        assert call(ag, "DELETE", f"{p}/r00001-y.safetensors")[0] == 200  # e.g. the upload queue dropped it
        assert json.loads(call(ag, "POST", f"{p}/r00000-x.safetensors?wait=copy")[1])["copied"] is True
        assert call(ag, "POST", f"{p}/r00001-y.safetensors?wait=copy")[0] == 404
        files = json.loads(call(ag, "GET", p)[1])["files"]
        assert files == {"r00000-x.safetensors": size}  # copied here although the push never finished
        ho = ag.step_handoffs("j", 4)["r00000-x.safetensors"]
        assert ho.pushed is None and ho.copied == ""
    finally:
        stalled.close()  # resets the push; the replicator gives up on it
        ag.close()


def test_cli_agent_serves_status_under_its_own_pid(tmp_path, shm):
    """``tidal ckpt agent`` replaces itself with the light agent process: same pid, so a launcher that
    started it can stop it by pid."""
    import subprocess
    import sys

    from tidal.ckpt.tiers.peer import AgentClient
    from tidal.net import free_ports

    addr = f"127.0.0.1:{free_ports(1)[0]}"
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tidal.ckpt.cli import app; app()",
            "agent",
            "--listen",
            addr,
            "--mem-dir",
            str(tmp_path / "mem"),
            "--node",
            "n1",
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        client = AgentClient(addr, timeout_s=5, connect_timeout_s=0.5)

        def status():
            try:
                return client.json("GET", "/status")
            except OSError:
                assert proc.poll() is None, (tmp_path / "agent.log").read_text()
                return None

        st = eventually(status, timeout_s=60)
        assert st["pid"] == proc.pid and st["node"] == "n1" and st["mem_dir"] == str(tmp_path / "mem")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0


def test_without_node_shared_memory_the_bytes_go_over_http(nodes, tmp_path):
    a, b, _ = nodes
    tiers = [{"kind": "peer", "agent": a.address, "job": "j6"}, str(tmp_path / "disk")]
    with ckpt.Checkpointer(tiers=tiers) as cp:  # no "shm": the staging slot is private memory
        h = cp.save(1, state(1))
        h.wait()
        assert h.committed == ["disk", "peer"] and cp.shm_tier is None
    st = a.status()
    assert st["copied_bytes"] == 0 and st["received_bytes"] >= ROWS * COLS * 4
    target = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.int64), "step": -1}
    a.kill()
    assert ckpt.load([{"kind": "peer", "agent": b.address, "job": "j6"}], target) == 1
    assert torch.equal(target["w"], state(1)["w"])

"""Checkpoints against a co-tenant: another user on the same node, who knows no secret.

The other tenant is real: a forked child that drops to another uid (:data:`OTHER`) before it acts, so
these tests need root (they are skipped otherwise). The shared-memory base is a fresh world-writable
sticky directory, as ``/dev/shm`` is.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import stat
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tidal import ckpt
from tidal.ckpt.agent.proc import AgentProcess
from tidal.ckpt.agent.server import Agent
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.directory import shm_root_for
from tidal.contract import ENV_CKPT_KEY

OTHER = 200123  # the other tenant's uid and gid

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


def as_other(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child as uid/gid :data:`OTHER`; fail the test if it raises."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the other tenant's part failed"


@pytest.fixture
def shm(monkeypatch):
    """A world-writable sticky base like ``/dev/shm``, as ``TIDAL_SHM_DIR``."""
    base = Path(tempfile.mkdtemp(prefix="tidal-cotenant-"))
    base.chmod(0o1777)
    monkeypatch.setenv("TIDAL_SHM_DIR", str(base))
    monkeypatch.delenv(ENV_CKPT_KEY, raising=False)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def save(url: Path, step: int, value: float, **kw) -> None:
    cp = ckpt.Checkpointer(url, **kw)
    try:
        cp.save(step, {"w": torch.full((64,), value), "lr": value}).wait()
    finally:
        cp.close()


def loaded(url: Path, **kw) -> tuple[int, float, ckpt.LoadStats]:
    st = {"w": torch.zeros(64), "lr": 0.0}
    stats = ckpt.LoadStats()
    step = ckpt.load(url, st, stats=stats, **kw)
    assert torch.equal(st["w"], torch.full((64,), st["lr"]))
    return step, st["lr"], stats


# -- 1. a shared-memory folder another user created first ---------------------------------------------

@as_root
def test_a_step_planted_in_a_tidal_folder_another_user_created_first_is_never_loaded(shm, tmp_path, caplog):
    url = tmp_path / "run"
    # The other tenant builds a valid step 2 (any user can run Tidal) in the folder the job will use.
    evil = shm / "evil"
    save(evil, 2, 666.0, shm=False, status_path=False)
    for p in [evil, *evil.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    ns = shm_root_for(url)

    def plant() -> None:
        os.makedirs(ns, 0o777)
        shutil.copytree(evil / mf.step_dirname(2), ns / mf.step_dirname(2))

    as_other(plant)
    assert (ns.parent.stat().st_uid, ns.stat().st_uid) == (OTHER, OTHER)
    save(url, 1, 1.0, shm=False)  # nor is its status file written there
    assert not (ns / "status.json").exists()
    assert ckpt.steps(url) == [1]  # the planted step is not even listed
    step, lr, _ = loaded(url)
    assert (step, lr) == (1, 1.0)
    assert f"{ns.parent}: owned by uid {OTHER}" in caplog.text
    with pytest.raises(ckpt.TierError, match=rf"{ns.parent}.*owned by uid {OTHER}.*TIDAL_SHM_DIR"):
        ckpt.Checkpointer(url)


@as_root
def test_a_job_folder_that_others_may_write_is_refused_even_in_a_folder_of_ours(shm, tmp_path):
    url = tmp_path / "run"
    save(url, 1, 1.0)
    ns = shm_root_for(url)
    assert stat.S_IMODE(ns.parent.stat().st_mode) == stat.S_IMODE(ns.stat().st_mode) == 0o700
    os.chown(ns, OTHER, OTHER)  # another user's folder, in which it may swap steps
    with pytest.raises(ckpt.TierError, match=rf"{ns}: owned by uid {OTHER}"):
        ckpt.Checkpointer(url)
    assert loaded(url)[2].manifest_tier == "disk"
    os.chown(ns, 0, 0)
    ns.chmod(0o777)  # our own, left open (by an older version): narrowed before use
    ckpt.Checkpointer(url).close()
    assert stat.S_IMODE(ns.stat().st_mode) == 0o700
    ns.rename(tmp_path / "gone")
    ns.symlink_to(tmp_path / "gone")  # a link in place of the folder is not followed
    with pytest.raises(ckpt.TierError, match=rf"{ns}: a symbolic link or not a directory"):
        ckpt.Checkpointer(url)


# -- 2. private files ----------------------------------------------------------------------------------

@as_root
def test_everything_a_save_creates_is_private_whatever_the_umask(shm, tmp_path):
    url = tmp_path / "run"
    old = os.umask(0)
    try:
        save(url, 1, 1.0)
    finally:
        os.umask(old)
    ns = shm_root_for(url)
    made = [p for root in (url, ns, ns.parent) for p in [root, *root.rglob("*")]]
    assert any(p.name == "status.json" for p in made) and any(p.name == mf.MANIFEST for p in made)
    loose = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made
             if stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert loose == {}
    shutil.copy(url / mf.step_dirname(1) / mf.MANIFEST, shm / "copied")  # readable by its owner only

    def read() -> None:
        for p in (shm / "copied", ns / mf.step_dirname(1) / mf.MANIFEST):
            with pytest.raises(PermissionError):
                p.read_bytes()

    os.chmod(shm / "copied", 0o600)
    as_other(read)


# -- 3. keyed manifests --------------------------------------------------------------------------------

def forge(url: Path, step: int, lr: float) -> None:
    """What anyone who may write into a tier can do: change a value, recompute the checksum."""
    for p in [url, shm_root_for(url)]:
        m = p / mf.step_dirname(step) / mf.MANIFEST
        if m.exists():
            doc = json.loads(m.read_bytes())
            doc["objects"] = [{"path": ["lr"], "value": lr}]
            doc["checksum"] = mf.canonical_checksum(doc)
            m.write_text(json.dumps(doc))


def test_checksums_alone_do_not_stop_a_forged_step_a_key_does(shm, tmp_path, caplog):
    key = os.urandom(32)
    url = tmp_path / "run"
    save(url, 1, 1.0, key=key)
    save(url, 2, 2.0, key=key)
    assert json.loads((url / mf.step_dirname(2) / mf.MANIFEST).read_bytes())["mac"].startswith("hmac-sha256:")
    forge(url, 2, 666.0)
    st = {"w": torch.zeros(64), "lr": 0.0}
    assert ckpt.load(url, st) == 2 and st["lr"] == 666.0  # without the key the checksums hold: loaded
    step, lr, stats = loaded(url, key=key)
    assert (step, lr) == (1, 1.0)
    assert "field 'mac' does not match the checkpoint key" in stats.skipped_steps[0]
    assert "falling back to step 1" in caplog.text
    with pytest.raises(ckpt.ManifestError, match="'mac' does not match"):
        ckpt.load(url, st, step=2, key=key)


def test_a_key_from_the_environment_signs_and_refuses_a_step_written_without_it(shm, tmp_path, monkeypatch):
    url = tmp_path / "run"
    save(url, 1, 1.0)  # no key: checksums only
    monkeypatch.setenv(ENV_CKPT_KEY, os.urandom(32).hex())
    save(url, 2, 2.0)
    assert loaded(url)[:2] == (2, 2.0)
    shutil.rmtree(url / mf.step_dirname(2))
    shutil.rmtree(shm_root_for(url) / mf.step_dirname(2))
    with pytest.raises(ckpt.ManifestError, match="no field 'mac', but a checkpoint key is set"):
        loaded(url)  # the only step has no MAC: nothing is loaded
    monkeypatch.setenv(ENV_CKPT_KEY, "not hex")
    with pytest.raises(ValueError, match=r"\$TIDAL_CKPT_KEY: expected hex digits"):
        ckpt.Checkpointer(url)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ckpt.load(url, {}, key=b"short")


# -- 4. the agent copies no file for a client who could not read it ----------------------------------------

def call(address: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@as_root
def test_the_agent_copies_no_staging_slot_for_a_client_that_could_not_read_it(shm, tmp_path):
    victim, attacker = shm / "tidal" / "victim-job" / "slots", shm / "tidal" / "attacker-job" / "slots"
    for d, uid in ((victim, OTHER + 1), (attacker, OTHER)):
        d.mkdir(parents=True)
        for p in (d, d.parent):
            os.chown(p, uid, uid)
            p.chmod(0o700)
    secret, own = victim / "r00000-slot0.safetensors", attacker / "r00000-slot0.safetensors"
    secret.write_bytes(b"s" * 4096)
    own.write_bytes(b"o" * 4096)
    for f, uid in ((secret, OTHER + 1), (own, OTHER)):
        os.chown(f, uid, uid)
        f.chmod(0o600)
    ag = Agent("127.0.0.1:0", tmp_path / "mem").start()  # default roots: $TIDAL_SHM_DIR/tidal
    p = "/v1/jobs/attacker/step_000000000001/r00000-x.safetensors"

    def attack() -> None:
        status, body = call(ag.address, "POST", f"{p}?copy_from={secret}&length=4096")
        want = f"a file of uid {OTHER + 1}; the caller is uid {OTHER}"
        assert status == 403 and want.encode() in body, body
        assert call(ag.address, "GET", p)[0] == 404
        assert call(ag.address, "POST", f"{p}?copy_from={own}&length=4096")[0] == 200  # its own: copied
        assert call(ag.address, "GET", p) == (200, b"o" * 4096)

    try:
        as_other(attack)
    finally:
        ag.close()


# -- 5. the agent's memory and the key of its environment -----------------------------------------------

def held_puts(address: str, n: int, length: int) -> list[socket.socket]:
    """``n`` connections, each a PUT of ``length`` bytes that sends one byte of its body and holds."""
    host, _, port = address.rpartition(":")
    out = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"PUT /v1/jobs/j/step_000000000001/r{i:05d}-x.safetensors HTTP/1.1\r\nHost: a\r\n"
                  f"Content-Length: {length}\r\n\r\nx".encode())
        out.append(s)
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_held_uploads_neither_grow_the_agent_nor_outnumber_its_connection_cap(tmp_path):
    with AgentProcess(tmp_path / "mem") as ag:
        before = rss_bytes(ag.pid)
        socks = held_puts(ag.address, 200, 64 << 20)
        try:
            time.sleep(1.0)  # every connection accepted or refused meanwhile
            grown = rss_bytes(ag.pid) - before
            refused = 0
            for s in socks[128:]:  # beyond the cap (128): answered at once, closed
                s.settimeout(10)
                refused += s.recv(100).startswith(b"HTTP/1.1 503")
        finally:
            for s in socks:
                s.close()
        assert refused == 72
        assert grown < 64 << 20, f"the agent grew by {grown >> 20} MiB"  # (4 MiB per upload: 800 MiB)
        for _ in range(100):  # and it serves on, once the closed connections' threads ended
            with contextlib.suppress(ckpt.TierError):
                assert ag.status()["free_bytes"] > 0
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the agent does not serve after the held uploads closed")


def test_a_slow_upload_is_cut_and_concurrent_ones_cannot_share_the_same_free_space(tmp_path):
    ag = Agent("127.0.0.1:0", tmp_path / "mem", upload_grace_s=0.5,
               min_upload_rate_bytes_per_s=1 << 20).start()
    try:
        (s,) = held_puts(ag.address, 1, 1 << 20)
        s.settimeout(30)
        assert b" 408 " in s.recv(1000).split(b"\r\n")[0]  # a pause longer than the grace: cut
        s.close()
        st = os.statvfs(tmp_path / "mem")
        ag.reserve_bytes = st.f_bavail * st.f_frsize - (300 << 20)  # room left: 300 MiB
        first = held_puts(ag.address, 1, 200 << 20)  # promised 200 MiB while it uploads
        time.sleep(0.2)
        conn = http.client.HTTPConnection(*ag.address.rsplit(":", 1), timeout=30)
        conn.putrequest("PUT", "/v1/jobs/j/step_000000000001/r00009-x.safetensors")
        conn.putheader("Content-Length", str(200 << 20))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 507 and b"promised to uploads under way" in r.read()
        conn.close()
        first[0].close()
    finally:
        ag.close()


@as_root
def test_the_agents_key_given_in_its_environment_is_not_left_in_proc_environ(tmp_path):
    key = os.urandom(32)
    with AgentProcess(tmp_path / "mem", key=key) as ag:
        environ = Path(f"/proc/{ag.pid}/environ").read_bytes()
        assert key.hex().encode() not in environ and b"TIDAL_CKPT_AGENT_KEY" not in environ
        assert b"--key-fd" in Path(f"/proc/{ag.pid}/cmdline").read_bytes()  # a number, not the key
        assert key.hex().encode() not in Path(f"/proc/{ag.pid}/cmdline").read_bytes()
        assert ag.status()["auth"] is True  # the key still holds

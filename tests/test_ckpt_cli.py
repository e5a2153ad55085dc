"""``tidal ckpt`` on real checkpoints: ls, inspect, verify, export, and readable errors.

Checkpoints are written by ``tidal.ckpt.Checkpointer`` (single process, shared memory redirected to
a temporary directory), except one two-rank checkpoint assembled from the engine's own plan and
manifest builders so that export has to stitch tensors from pieces in two files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpt_handmade import write_two_rank_checkpoint
from tidal import ckpt
from tidal.ckpt.cli import app
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.directory import shm_root_for

runner = CliRunner()


# -- helpers ---------------------------------------------------------------------------------------

def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(8, 4, generator=g),
            "b": torch.arange(5, dtype=torch.int64) * step,
            "h": torch.randn(3, 2, generator=g).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
        },
        "scale": torch.tensor(3.5, dtype=torch.float64),
        "optim": {"param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]},
        "step": step,
    }


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    m = state["model"]
    return {"model/w": m["w"], "model/b": m["b"], "model/h": m["h"], "model/mask": m["mask"],
            "scale": state["scale"]}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def cli_cmd() -> list[str]:
    """The installed ``tidal`` console script once both sub-apps exist, else this module directly."""
    script = Path(sys.executable).parent / "tidal"
    if script.exists() and importlib.util.find_spec("tidal.bench.cli") is not None:
        return [str(script), "ckpt"]
    return [sys.executable, "-m", "tidal.ckpt.cli"]


def run_proc(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*cli_cmd(), *(str(a) for a in args)], capture_output=True, text=True, env=env,
                          timeout=120)


def disk_file(url: Path, step: int) -> Path:
    man = mf.read(url / mf.step_dirname(step))
    return url / mf.step_dirname(step) / man.files[0]["name"]


def piece(url: Path, step: int, name: str) -> mf.StoredPiece:
    return mf.read(url / mf.step_dirname(step)).tensors[name].pieces[0]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "shm"
    monkeypatch.setenv("TIDAL_SHM_DIR", str(d))
    return d


@pytest.fixture
def url(tmp_path, shm) -> Path:
    u = tmp_path / "ck"
    with ckpt.Checkpointer(u, keep=3) as cp:
        for s in (10, 20):
            cp.save(s, make_state(s)).wait()
    return u


def no_traceback(r) -> None:
    text = (r.stdout or "") + (r.stderr or "")
    assert "Traceback" not in text, text


# -- ls --------------------------------------------------------------------------------------------

def test_ls_subprocess_lists_steps_tiers_and_layout(url):
    r = run_proc("ls", url)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "world 1" in ln]
    assert len(lines) == 2
    assert lines[0].split("│")[1].strip() == "10" and lines[1].split("│")[1].strip() == "20"
    for ln in lines:
        assert "shm + disk" in ln and "replicated" in ln

    r = run("ls", url, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["step"] for s in doc["steps"]] == [10, 20]
    man = mf.read(url / mf.step_dirname(20))
    s20 = doc["steps"][1]
    assert s20["tiers"] == ["shm", "disk"]
    assert s20["world_size"] == 1 and s20["files"] == 1
    assert s20["bytes"] == sum(t.numel() * t.element_size() for t in tensors_of(make_state(20)).values())
    assert s20["file_bytes"] == man.files[0]["size_bytes"] == disk_file(url, 20).stat().st_size
    assert s20["layout"] == "world 1: 5× replicated"
    assert abs(s20["created_unix_s"] - time.time()) < 600
    assert doc["errors"] == []


def test_ls_disk_only_when_shm_is_gone(url):
    shutil.rmtree(shm_root_for(url))
    doc = json.loads(run("ls", url, "--json").stdout)
    assert [s["tiers"] for s in doc["steps"]] == [["disk"], ["disk"]]


def test_ls_nothing_committed_is_a_clean_error(tmp_path, shm):
    (tmp_path / "empty").mkdir()
    r = run("ls", tmp_path / "empty")
    assert r.exit_code == 1
    assert "no committed checkpoint step" in r.stderr and r.stdout == ""
    no_traceback(r)

    r = run("verify", tmp_path / "missing")
    assert r.exit_code == 1 and "does not exist" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    no_traceback(r)

    refused = {"COLUMNS": "200", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
               "AWS_SECRET_ACCESS_KEY": "s"}
    r = runner.invoke(app, ["inspect", "s3://bucket/x"], env=refused)
    assert r.exit_code == 1 and "no committed checkpoint step at s3://bucket/x" in r.stderr
    assert "tier 's3' (s3://bucket/x) could not be listed" in r.stderr and "AWS_ENDPOINT_URL" in r.stderr
    no_traceback(r)

    r = run("inspect", '["shm", "/x", ')
    assert r.exit_code == 1 and "is not valid JSON" in r.stderr
    r = run("verify", '["shm", "gs://b/x"]')
    assert r.exit_code == 1 and "gs://" in r.stderr
    no_traceback(r)


# -- inspect ---------------------------------------------------------------------------------------

def test_inspect_lists_entries_dtypes_shapes_and_objects(url):
    r = run("inspect", url)
    assert r.exit_code == 0, r.stderr
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[1:-1]]
            for ln in r.stdout.splitlines() if ln.startswith("│")}
    assert rows["model/w"][:5] == ["model/w", "F32", "[8, 4]", "1", "128 B"]
    assert rows["model/b"][1:3] == ["I64", "[5]"]
    assert rows["model/h"][1:3] == ["BF16", "[3, 2]"]
    assert rows["model/mask"][1:3] == ["BOOL", "[3]"]
    assert rows["scale"][1:3] == ["F64", "[]"]
    assert rows["model/w"][5] == "replicated"
    assert rows["step"][1] == "20"
    assert json.loads(rows["optim"][1]) == {"param_groups": [{"betas": [0.9, 0.99], "lr": 0.1}]}
    assert "step 20" in r.stdout and "world 1: 5× replicated" in r.stdout

    r = run("inspect", url, "--step", 10, "--pieces")
    assert r.exit_code == 0, r.stderr
    p = piece(url, 10, "model/w")
    assert f"1 block crc32 0x{p.blocks[0]:08x}" in r.stdout and f"{p.start}..{p.start + p.nbytes}" in r.stdout
    assert p.file in r.stdout


def test_inspect_json(url):
    r = run("inspect", url, "--step", 10, "--json", "--pieces")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 10 and doc["world_size"] == 1 and doc["tier"] == "shm"
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert set(by_name) == set(tensors_of(make_state(10)))
    w = by_name["model/w"]
    assert (w["dtype"], w["shape"], w["num_pieces"], w["bytes"], w["path"]) == (
        "F32",
        [8, 4],
        1,
        128,
        ["model", "w"],
    )
    p = piece(url, 10, "model/w")
    assert w["pieces"] == [{"offsets": [0, 0], "lengths": [8, 4], "file": p.file, "key": "model/w",
                            "start": p.start, "end": p.start + p.nbytes, "nbytes": 128, "crc32": None,
                            "blocks": 1}]
    objs = {o["name"]: o["value"] for o in doc["objects"]}
    assert objs == {"step": 10, "optim": {"param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}}


def test_inspect_unknown_step(url):
    r = run("inspect", url, "--step", 15)
    assert r.exit_code == 1
    assert "step 15 is not committed" in r.stderr and "[10, 20]" in r.stderr
    no_traceback(r)


def test_inspect_truncates_long_values(tmp_path, shm):
    u = tmp_path / "long"
    with ckpt.Checkpointer(u) as cp:
        cp.save(1, {"w": torch.zeros(2), "notes": "x" * 500, "[red]odd[/red]": 1}).wait()
    r = run("inspect", u)
    assert r.exit_code == 0, r.stderr
    assert "x" * 500 not in r.stdout and "…" in r.stdout
    assert "[red]odd[/red]" in r.stdout  # names are shown verbatim, not as markup


# -- verify ----------------------------------------------------------------------------------------

def test_verify_good_then_flipped_byte_names_tier_step_file_tensor(url):
    r = run("verify", url)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "OK   step 20 tier shm" in r.stdout and "OK   step 20 tier disk" in r.stdout

    f = disk_file(url, 20)
    p = piece(url, 20, "model/w")
    flip(f, p.start + 17)
    r = run_proc("verify", url)
    assert r.returncode == 1
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1, r.stdout
    assert "tier 'disk'" in fails[0] and "step 20" in fails[0] and str(f) in fails[0]
    assert "tensor 'model/w'" in fails[0] and "checksum mismatch" in fails[0]
    assert "OK   step 20 tier shm" in r.stdout  # the shared-memory copy is a different file

    r = run("verify", url, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False
    assert doc["problems"] == [{"tier": "disk", "step": 20, "file": str(f), "tensor": "model/w",
                                "problem": doc["problems"][0]["problem"]}]
    assert {(c["tier"], c["ok"]) for c in doc["checked"]} == {("shm", True), ("disk", False)}


def test_verify_flipped_byte_in_shm_copy(url):
    man = mf.read(url / mf.step_dirname(20))
    f = shm_root_for(url) / mf.step_dirname(20) / man.files[0]["name"]
    flip(f, man.tensors["model/b"].pieces[0].start)
    r = run("verify", url)
    assert r.exit_code == 1
    assert "tier 'shm' step 20" in r.stdout and "tensor 'model/b'" in r.stdout
    assert "OK   step 20 tier disk" in r.stdout


def test_verify_truncated_data_file(url):
    f = disk_file(url, 20)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 3)
    r = run("verify", url)
    assert r.exit_code == 1
    out = r.stdout
    assert f"file is {size - 3} bytes, the manifest says {size} (truncated)" in out
    assert "does not parse as safetensors" in out
    # the last piece in the file runs past the end
    last = max(mf.read(f.parent).tensors.values(), key=lambda t: t.pieces[0].start)
    assert f"tensor '{last.name}'" in out and "truncated" in out
    assert all("tier 'disk' step 20" in ln for ln in out.splitlines() if ln.startswith("FAIL"))


def test_verify_missing_data_file(url):
    f = disk_file(url, 20)
    f.unlink()
    r = run("verify", url, "--tier", "disk")
    assert r.exit_code == 1
    assert "data file is missing" in r.stdout and str(f) in r.stdout


def test_verify_header_disagrees_with_manifest(url):
    """A header edited to another same-size dtype still parses, but no longer matches the manifest."""
    f = disk_file(url, 20)
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n]
    assert header.count(b'"I64"') == 1
    f.write_bytes(data[:8] + header.replace(b'"I64"', b'"F64"') + data[8 + n :])
    r = run("verify", url, "--tier", "disk")
    assert r.exit_code == 1
    assert "tensor 'model/b'" in r.stdout and "stored as F64 [5], the manifest says I64 [5]" in r.stdout


def test_verify_header_that_is_no_safetensors_header(url):
    """An entry whose bytes no longer match its dtype and shape breaks the format itself."""
    f = disk_file(url, 20)
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n]
    assert header.count(b'"I64","shape":[5]') == 1
    f.write_bytes(data[:8] + header.replace(b'"I64","shape":[5]', b'"I64","shape":[4]') + data[8 + n :])
    r = run("verify", url, "--tier", "disk")
    assert r.exit_code == 1
    assert "does not parse as safetensors" in r.stdout and "do not fit its dtype and shape" in r.stdout


def test_verify_all_and_tier_filter(url):
    flip(disk_file(url, 10), piece(url, 10, "model/h").start)
    assert run("verify", url).exit_code == 0  # newest step only
    r = run("verify", url, "--all")
    assert r.exit_code == 1
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and "step 10" in fails[0] and "model/h" in fails[0]
    assert run("verify", url, "--all", "--tier", "shm").exit_code == 0
    r = run("verify", url, "--step", 10, "--all")
    assert r.exit_code == 1 and "cannot be used together" in r.stderr
    r = run("verify", url, "--step", 11)
    assert r.exit_code == 1 and "step 11 is not committed" in r.stderr


# -- damaged manifests -----------------------------------------------------------------------------

def test_hand_edited_manifest_shape(url):
    mpath = url / mf.step_dirname(20) / mf.MANIFEST
    doc = json.loads(mpath.read_text())
    w = next(t for t in doc["tensors"] if t["name"] == "model/w")
    w["shape"] = [8, 5]
    mpath.write_text(json.dumps(doc))
    r = run_proc("ls", url)  # the manifest's checksum catches the edit first
    assert r.returncode == 1 and "field 'checksum' does not match" in r.stderr and str(mpath) in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    doc["checksum"] = mf.canonical_checksum(doc)  # an edit that also recomputes the checksum
    mpath.write_text(json.dumps(doc))

    r = run_proc("ls", url)
    assert r.returncode == 1
    assert "tier 'disk' step 20" in r.stderr and str(mpath) in r.stderr and "model/w" in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr

    r = run("inspect", url)  # the shm copy is intact and shown, but the damage is reported
    assert r.exit_code == 1 and "tier 'disk' step 20" in r.stderr and "model/w" in r.stderr
    assert "tier shm" in r.stdout

    r = run("verify", url)
    assert r.exit_code == 1 and "FAIL tier 'disk' step 20" in r.stdout and "OK   step 20 tier shm" in r.stdout


def test_truncated_manifest_everywhere(url):
    for root in (url, shm_root_for(url)):
        mpath = root / mf.step_dirname(20) / mf.MANIFEST
        mpath.write_bytes(mpath.read_bytes()[:100])
    for cmd in (["ls", url], ["inspect", url], ["export", url, url.parent / "x.safetensors"]):
        r = run(*cmd)
        assert r.exit_code == 1, cmd
        assert "not valid JSON" in r.stderr, (cmd, r.stderr)
        assert r.stderr.strip().count("\n") == 0
        no_traceback(r)
    assert not (url.parent / "x.safetensors").exists()
    # the older step is still fine
    assert run("inspect", url, "--step", 10).exit_code == 0
    assert run("verify", url, "--step", 10).exit_code == 0


def test_manifest_moved_to_another_step_directory(url, tmp_path):
    shutil.rmtree(shm_root_for(url))
    mpath = url / mf.step_dirname(20) / mf.MANIFEST
    doc = json.loads(mpath.read_text())
    doc["step"] = 10
    doc["checksum"] = mf.canonical_checksum(doc)
    mpath.write_text(json.dumps(doc))
    for cmd in (["ls", url], ["inspect", url], ["export", url, tmp_path / "x.safetensors"]):
        r = run(*cmd)
        assert r.exit_code == 1, cmd
        assert "field 'step' is 10" in r.stderr and "step 20" in r.stderr, (cmd, r.stderr)
    r = run("verify", url)
    assert r.exit_code == 1 and "FAIL tier 'disk' step 20" in r.stdout


# -- export ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_export_roundtrip_bitwise(url, tmp_path):
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    r = run_proc("export", url, out)
    assert r.returncode == 0, r.stderr
    assert "exported step 20" in r.stdout and str(out) in r.stdout
    got = load_file(str(out))
    want = tensors_of(make_state(20))
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert bits(got[k]) == bits(t), k
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["tidal.step"] == "20"
    objs = {tuple(o["path"]): o["value"] for o in json.loads(meta["tidal.objects"])}
    assert objs == {("step",): 20, ("optim",): {"param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}}
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary left

    r = run("export", url, out, "--step", 10, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 10 and doc["tensors"] == 5 and doc["objects"] == 2 and doc["fallbacks"] == []
    assert bits(load_file(str(out))["model/w"]) == bits(make_state(10)["model"]["w"])


def test_export_one_entry_without_its_prefix(url, tmp_path):
    """--entry model: that entry's tensors only, named as its own state dict names them (what
    from_pretrained or load_state_dict expect), bit for bit; an entry with no tensor names the entries."""
    out = tmp_path / "model.safetensors"
    r = run("export", url, out, "--entry", "model", "--json")
    assert r.exit_code == 0, r.output
    got = load_file(str(out))
    want = make_state(20)["model"]
    assert set(got) == set(want)
    for k, t in want.items():
        assert bits(got[k]) == bits(t) and got[k].dtype == t.dtype, k
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["tidal.entry"] == "model" and json.loads(meta["tidal.objects"]) == []
    assert json.loads(r.stdout)["tensors"] == 4
    r = run("export", url, out, "--entry", "optim")
    assert r.exit_code == 1
    assert "--entry 'optim': no tensor under it; the checkpoint's entries: model, scale" in r.output


def test_export_falls_back_to_disk_when_shm_copy_is_corrupt(url, tmp_path):
    man = mf.read(url / mf.step_dirname(20))
    flip(
        shm_root_for(url) / mf.step_dirname(20) / man.files[0]["name"], man.tensors["model/w"].pieces[0].start
    )
    out = tmp_path / "o.safetensors"
    r = run("export", url, out)
    assert r.exit_code == 0, r.stderr
    assert "fell back" in r.stdout
    assert bits(load_file(str(out))["model/w"]) == bits(make_state(20)["model"]["w"])
    # both copies corrupt: a clean error naming the step, no output file
    flip(disk_file(url, 20), man.tensors["model/w"].pieces[0].start)
    out.unlink()
    r = run("export", url, out)
    assert r.exit_code == 1 and "checksum mismatch" in r.stderr and "step 20" in r.stderr
    no_traceback(r)
    assert not out.exists()


def test_export_assembles_pieces_from_two_ranks(tmp_path, shm):
    u = tmp_path / "two"
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(7, 3, generator=g), "e": torch.arange(5, dtype=torch.int64),
            "b": torch.randn(4, generator=g).to(torch.float16)}
    write_two_rank_checkpoint(u, 3, full, cut={"w": 3, "e": 2})

    r = run("inspect", u, "--json")
    assert r.exit_code == 0, r.stderr
    by_name = {t["name"]: t for t in json.loads(r.stdout)["tensors"]}
    assert (
        by_name["w"]["num_pieces"] == 2
        and by_name["e"]["num_pieces"] == 2
        and by_name["b"]["num_pieces"] == 1
    )
    assert by_name["w"]["layout"] == "[Shard(dim=0)] on mesh (2,)"
    doc = json.loads(run("ls", u, "--json").stdout)
    assert doc["steps"][0]["world_size"] == 2 and doc["steps"][0]["files"] == 2
    r = run("verify", u)
    assert r.exit_code == 0, r.stdout
    assert "in 2 file(s)" in r.stdout

    out = tmp_path / "two.safetensors"
    r = run("export", u, out)
    assert r.exit_code == 0, r.stderr
    got = load_file(str(out))
    assert set(got) == set(full)
    for k, t in full.items():
        assert got[k].dtype == t.dtype and bits(got[k]) == bits(t), k

    # the engine reads the same checkpoint into hand-split targets (three parts, across the saved cut)
    for a, b in [(0, 2), (2, 5), (5, 7)]:
        part = torch.full((b - a, 3), float("nan"))
        one = {"w": ckpt.LocalShard(part, (a, 0), (7, 3)), "e": torch.empty(5, dtype=torch.int64),
               "b": torch.empty(4, dtype=torch.float16), "step": 0}
        stats = ckpt.LoadStats()
        assert ckpt.load(u, one, stats=stats) == 3
        assert bits(part) == bits(full["w"][a:b])
        assert bits(one["e"]) == bits(full["e"]) and one["step"] == 3
        # pieces smaller than one checksum block are read whole (and checked)
        man = ckpt.read_manifest(u)[1]
        touched = [p for t in man.tensors.values() for p in t.pieces
                   if t.name != "w" or (p.box.offsets[0] < b and p.box.offsets[0] + p.box.lengths[0] > a)]
        assert stats.bytes_read == sum(p.nbytes for p in touched)


def test_local_shard_targets_from_a_single_process_checkpoint(url):
    want = make_state(20)["model"]["w"]
    for a, b in [(0, 3), (3, 8)]:
        for c, d in [(0, 1), (1, 4)]:
            part = torch.zeros(b - a, d - c)
            ckpt.load(url, {"model": {"w": ckpt.LocalShard(part, (a, c), (8, 4))}}, strict=False)
            assert bits(part) == bits(want[a:b, c:d])


def test_console_script_help():
    r = subprocess.run([*cli_cmd(), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for cmd in ("ls", "inspect", "verify", "export"):
        assert cmd in r.stdout


# ``tidal --help`` and the commands that only read a checkpoint, in one interpreter: torch is not loaded (its
# import is seconds of CPU; only ``export`` builds tensors).
NO_TORCH = """
import sys
from tidal.cli import main
url = sys.argv[1]
for args in (["--help"], ["ckpt", "ls", url], ["ckpt", "inspect", url], ["ckpt", "verify", url]):
    sys.argv = ["tidal", *args]
    try:
        main()
    except SystemExit as e:
        assert not e.code, (args, e.code)
sys.exit("torch" in sys.modules and "torch was loaded")
"""


def test_help_and_the_reading_commands_load_no_torch(url):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, str(url)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OK: 2 step copies verified" in r.stdout, r.stdout[-500:]  # they ran, to their end


# What ``python -m tidal.ckpt.cli CMD --help`` does (the module run as __main__), for each command in one
# interpreter: {cmd: [exit code, stdout]} as JSON.
AS_MODULE = """
import contextlib, io, json, runpy, sys
out = {}
for cmd in sys.argv[1:]:
    sys.argv, buf, code = ["tidal.ckpt.cli", cmd, "--help"], io.StringIO(), 0
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_module("tidal.ckpt.cli", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    out[cmd] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def test_every_command_runs_as_a_module_too():
    """``python -m tidal.ckpt.cli`` knows every command (``agent`` was registered after the
    ``__main__`` guard, so the module form lacked it)."""
    cmds = ("ls", "inspect", "verify", "export")
    r = subprocess.run([sys.executable, "-c", AS_MODULE, *cmds], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    got = json.loads(r.stdout)
    for cmd in cmds:
        assert got[cmd][0] == 0, (cmd, got[cmd][1][-500:], r.stderr[-500:])
    # agent becomes ``python -m tidal.ckpt.agent`` (exec, same pid): a process of its own
    r = subprocess.run([sys.executable, "-m", "tidal.ckpt.cli", "agent", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-500:]
    # the module's own options, every one (it hands its arguments over)
    assert all(o in r.stdout for o in ("--no-copy-from", "--key-file", "--allow-copy-from")), r.stdout

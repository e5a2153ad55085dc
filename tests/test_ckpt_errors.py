"""The engine's answers to bad input: mismatched state, unsaveable values, damaged files, no pickle.

Single process and fast. Shared memory is redirected to a temporary directory, so every checkpoint
has two tiers: ``shm`` (node memory, read first) and ``disk``.
"""

from __future__ import annotations

import _pickle
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tidal import ckpt
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.directory import DirTier, shm_root_for


@pytest.fixture(autouse=True)
def _shm(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g)},
            "step": seed, "sched": {"last_epoch": seed, "milestones": [1, 2]}}


def save(url: Path, step: int, st: dict) -> None:
    with ckpt.Checkpointer(url) as cp:
        cp.save(step, st).wait()


def data_file(root: Path, step: int) -> Path:
    d = root / mf.step_dirname(step)
    return d / mf.read(d).files[0]["name"]


def piece_start(root: Path, step: int, name: str) -> int:
    return mf.read(root / mf.step_dirname(step)).tensors[name].pieces[0].start


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


# -- state does not match the checkpoint -----------------------------------------------------------

def test_shape_mismatch_names_the_tensor_and_changes_nothing(tmp_path):
    save(tmp_path / "c", 1, state(1))
    target = state(0)
    target["model"]["w"] = torch.full((4, 5), 7.0)
    before_b = target["model"]["b"].clone()
    with pytest.raises(ckpt.StateError, match=r"tensor 'model/w'.*shape \[4, 5\].*shape \[4, 6\]"):
        ckpt.load(tmp_path / "c", target)
    assert bool((target["model"]["w"] == 7.0).all())
    assert same(target["model"]["b"], before_b) and target["step"] == 0  # nothing half-loaded


def test_dtype_mismatch_names_the_tensor(tmp_path):
    save(tmp_path / "c", 1, state(1))
    target = state(0)
    target["model"]["b"] = torch.zeros(6, dtype=torch.float64)
    with pytest.raises(ckpt.StateError, match=r"tensor 'model/b'.*dtype F64.*dtype F32"):
        ckpt.load(tmp_path / "c", target)


def test_missing_and_unexpected_keys(tmp_path):
    src = state(3)
    save(tmp_path / "c", 3, src)
    target = {"model": {"w": torch.zeros(4, 6), "extra": torch.ones(2)}, "step": -1, "other": "keep"}
    with pytest.raises(ckpt.StateError) as ei:
        ckpt.load(tmp_path / "c", target)
    msg = str(ei.value)
    assert "missing from the checkpoint: ['model/extra', 'other']" in msg
    assert "unexpected in the checkpoint: ['model/b', 'sched']" in msg
    assert "strict=False" in msg
    assert bool((target["model"]["w"] == 0).all()) and target["step"] == -1

    assert ckpt.load(tmp_path / "c", target, strict=False) == 3
    assert same(target["model"]["w"], src["model"]["w"])
    assert target["step"] == 3
    assert same(target["model"]["extra"], torch.ones(2)) and target["other"] == "keep"
    assert "sched" not in target


def test_tensor_versus_plain_value(tmp_path):
    save(tmp_path / "c", 1, state(1))
    target = state(0)
    target["step"] = torch.zeros(1)
    with pytest.raises(ckpt.StateError, match="entry 'step': state holds a tensor"):
        ckpt.load(tmp_path / "c", target)


# -- unsaveable values -----------------------------------------------------------------------------

def test_non_json_leaf_fails_at_save_and_loses_nothing(tmp_path):
    url = tmp_path / "c"
    with ckpt.Checkpointer(url, keep=2) as cp:
        cp.save(1, state(1)).wait()
        bad = state(2)
        bad["model"]["fn"] = object()
        with pytest.raises(ckpt.StateError, match=r"entry 'model/fn': value of type object"):
            cp.save(2, bad)
        assert ckpt.steps(url) == [1]
        target = state(0)
        assert ckpt.load(url, target) == 1
        assert same(target["model"]["w"], state(1)["model"]["w"]) and target["step"] == 1
        cp.save(3, state(3)).wait()  # the checkpointer is still usable after the refused save
    assert ckpt.steps(url) == [1, 3]
    target = state(0)
    assert ckpt.load(url, target, step=1) == 1
    assert same(target["model"]["b"], state(1)["model"]["b"])


def test_non_json_leaf_inside_a_plain_container_is_named(tmp_path):
    bad = state(1)
    bad["sched"]["fn"] = object()
    with ckpt.Checkpointer(tmp_path / "c") as cp, pytest.raises(ckpt.StateError, match=r"'sched/fn'"):
        cp.save(1, bad)


def test_unsupported_dtype_fails_at_save(tmp_path):
    with (
        ckpt.Checkpointer(tmp_path / "c") as cp,
        pytest.raises(ckpt.StateError, match="tensor 'z'.*complex128"),
    ):
        cp.save(1, {"z": torch.zeros(2, dtype=torch.complex128)})
    assert ckpt.steps(tmp_path / "c") == []


def test_int_keys_of_plain_values_round_trip(tmp_path):
    save(tmp_path / "c", 1, {"w": torch.zeros(1), "sched": {"milestones": {3: 0.1}}})
    target = {"w": torch.zeros(1), "sched": {"milestones": {3: 0.0}}}
    ckpt.load(tmp_path / "c", target)
    assert target["sched"]["milestones"] == {3: 0.1}


def test_step_saved_after_resuming_from_an_older_step_stays_on_disk(tmp_path):
    url = tmp_path / "c"
    with ckpt.Checkpointer(url, keep=1) as cp:
        for s in (10, 20):
            cp.save(s, state(s)).wait()
    with ckpt.Checkpointer(url, keep=1) as cp:  # a job resumed from step 10 saves step 11
        h = cp.save(11, state(11))
        h.wait()
        assert h.committed == ["shm", "disk"]
    # the abandoned run's step 20 is superseded: the next restore must continue from 11
    assert DirTier("disk", url, fsync=False).committed_steps() == [11]
    assert 20 not in ckpt.steps(url) and ckpt.steps(url)[-1] == 11


# -- damaged data ----------------------------------------------------------------------------------

def test_flipped_byte_in_the_only_copy_is_a_corruption_error(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    shutil.rmtree(shm_root_for(url))
    f = data_file(url, 5)
    flip(f, piece_start(url, 5, "model/w") + 9)
    with pytest.raises(ckpt.CorruptionError) as ei:
        ckpt.load(url, state(0))
    msg = str(ei.value)
    assert str(f) in msg and "step 5" in msg and "tensor 'model/w'" in msg and "checksum mismatch" in msg


def test_corrupt_shm_copy_falls_back_to_disk(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    shm_file = data_file(shm_root_for(url), 5)
    flip(shm_file, piece_start(url, 5, "model/b"))
    target = state(0)
    stats = ckpt.LoadStats()
    assert ckpt.load(url, target, stats=stats) == 5
    assert same(target["model"]["b"], state(5)["model"]["b"])
    assert same(target["model"]["w"], state(5)["model"]["w"])
    assert stats.manifest_tier == "shm"
    assert (
        len(stats.fallbacks) == 1 and "model/b" in stats.fallbacks[0] and str(shm_file) in stats.fallbacks[0]
    )
    assert stats.bytes_by_tier["disk"] == 6 * 4  # only the damaged piece came from disk


def test_both_copies_corrupt_names_both_tiers(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    for root in (shm_root_for(url), url):
        flip(data_file(root, 5), piece_start(url, 5, "model/w"))
    with pytest.raises(ckpt.CorruptionError) as ei:
        ckpt.load(url, state(0))
    assert "tier 'shm'" in str(ei.value) and "tier 'disk'" in str(ei.value)


def test_truncated_data_file(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    shutil.rmtree(shm_root_for(url))
    f = data_file(url, 5)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4)
    with pytest.raises(ckpt.CorruptionError, match=r"truncated.*step 5|step 5.*truncated"):
        ckpt.load(url, state(0))


def test_truncated_manifest(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    shutil.rmtree(shm_root_for(url))
    m = url / mf.step_dirname(5) / mf.MANIFEST
    m.write_bytes(m.read_bytes()[:57])
    with pytest.raises(ckpt.ManifestError, match=r"manifest\.json: not valid JSON"):
        ckpt.load(url, state(0))
    with pytest.raises(ckpt.ManifestError):
        ckpt.read_manifest(url)


def test_truncated_shm_manifest_falls_back_to_disk(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    m = shm_root_for(url) / mf.step_dirname(5) / mf.MANIFEST
    m.write_bytes(m.read_bytes()[:57])
    target = state(0)
    stats = ckpt.LoadStats()
    assert ckpt.load(url, target, stats=stats) == 5
    assert stats.manifest_tier == "disk"
    assert same(target["model"]["w"], state(5)["model"]["w"])


def test_hand_edited_manifest_is_rejected(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    shutil.rmtree(shm_root_for(url))
    m = url / mf.step_dirname(5) / mf.MANIFEST
    doc = json.loads(m.read_text())
    doc["tensors"][0]["shape"][0] += 1
    m.write_text(json.dumps(doc))
    with pytest.raises(ckpt.ManifestError, match="field 'checksum' does not match"):
        ckpt.load(url, state(0))
    doc["checksum"] = mf.canonical_checksum(doc)  # edited with care: the content is checked too
    m.write_text(json.dumps(doc))
    with pytest.raises(ckpt.ManifestError, match="do not tile"):
        ckpt.load(url, state(0))


def test_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.NotFoundError, match="no committed checkpoint step"):
        ckpt.load(tmp_path / "empty", state(0))
    with pytest.raises(ckpt.NotFoundError):
        ckpt.load(tmp_path / "does-not-exist", state(0))
    save(tmp_path / "c", 5, state(5))
    with pytest.raises(ckpt.NotFoundError, match=r"step 4 is not committed.*\[5\]"):
        ckpt.load(tmp_path / "c", state(0), step=4)


# -- no pickle -------------------------------------------------------------------------------------

def test_loading_never_unpickles(tmp_path, monkeypatch):
    url = tmp_path / "c"
    save(url, 5, state(5))

    def refuse(*a, **k):
        raise AssertionError("a checkpoint load must not unpickle")

    class RefusingUnpickler:
        def __init__(self, *a, **k):
            refuse()

    for mod in (pickle, _pickle):
        monkeypatch.setattr(mod, "load", refuse)
        monkeypatch.setattr(mod, "loads", refuse)
        monkeypatch.setattr(mod, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    for tiers in (None, "disk-only"):
        if tiers == "disk-only":
            shutil.rmtree(shm_root_for(url))
        target = state(0)
        assert ckpt.load(url, target) == 5
        assert same(target["model"]["w"], state(5)["model"]["w"]) and target["sched"]["milestones"] == [1, 2]


def test_stored_files_are_json_and_safetensors_only(tmp_path):
    url = tmp_path / "c"
    save(url, 5, state(5))
    for root in (url, shm_root_for(url)):
        d = root / mf.step_dirname(5)
        names = sorted(p.name for p in d.iterdir())
        assert names[0] == mf.MANIFEST and all(n.endswith(".safetensors") for n in names[1:]), names
        json.loads((d / mf.MANIFEST).read_bytes())
        for n in names[1:]:
            raw = (d / n).read_bytes()
            assert raw[:1] != b"\x80" and raw[:2] != b"PK"  # neither a pickle stream nor torch's zip
            hlen = int.from_bytes(raw[:8], "little")
            assert raw[8:9] == b"{" and json.loads(raw[8 : 8 + hlen])
            with safe_open(str(d / n), framework="pt") as f:
                assert sorted(f.keys()) == ["model/b", "model/w"]


def test_a_step_a_flaky_disk_will_not_remove_whole_is_logged_invisible_and_retried(tmp_path, monkeypatch,
                                                                                 caplog):
    """A disk that refuses to remove a file must not leave the step's files behind without a word (until
    the disk fills): the manifest goes first (the step is never loaded), what could not be removed is
    logged, naming the tier, the step and the file, and the next cleanup removes the rest."""
    import errno
    import logging
    import os

    tier = DirTier("disk", tmp_path, fsync=False)
    tier.write_file(5, "rank0.safetensors", memoryview(b"x" * 64))
    tier.write_file(5, mf.MANIFEST, memoryview(b"{}"))
    real_unlink = os.unlink

    def flaky(path, *a, **kw):
        if str(path).endswith("rank0.safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", flaky)
    with caplog.at_level(logging.WARNING, logger="tidal.ckpt.tiers.directory"):
        tier.remove_step(5)
    assert tier.step_files() == {5: {"rank0.safetensors"}}  # no manifest: never loaded
    line = caplog.text
    assert "tier 'disk': step 5 could not be removed whole" in line and "rank0.safetensors" in line
    assert "Input/output error" in line
    monkeypatch.setattr(os, "unlink", real_unlink)
    tier.remove_step(5)
    assert tier.step_files() == {} and not tier.step_dir(5).exists()

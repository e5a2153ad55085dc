"""What keeps a save's stall at the copy floor: housekeeping never runs during a copy, slots know which
steps link them, one flatten pass."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal import ckpt
from tidal.ckpt.engine import checkpointer as cpmod
from tidal.ckpt.engine import commit, persist
from tidal.ckpt.errors import StateError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.flatten import LocalShard, flatten
from tidal.ckpt.tiers.directory import shm_root_for


def state(v: float, n: int = 4) -> dict:
    return {"model": {f"w{i}": torch.full((64, 16), float(v) + i) for i in range(n)}, "step": int(v)}


def disk_steps(d: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in d.glob("step_*"))


@pytest.fixture
def shm_cleanup():
    roots: list[Path] = []
    yield roots
    import shutil

    for r in roots:
        shutil.rmtree(r, ignore_errors=True)


def test_cleanup_never_runs_while_a_save_copies(tmp_path, monkeypatch, shm_cleanup):
    """Retention of step N waits for step N+1's copy: run during it, it would lengthen the stall."""
    copying = threading.Event()
    overlaps: list[int] = []
    real_copy, real_cleanup = cpmod._copy_all, commit.cleanup

    def slow_copy(pairs):
        copying.set()
        try:
            threading.Event().wait(0.05)  # a copy long enough for a racing cleanup to land in it
            real_copy(pairs)
        finally:
            copying.clear()

    def watched_cleanup(tier, keep, step, *a, **kw):
        if copying.is_set():
            overlaps.append(step)
        return real_cleanup(tier, keep, step, *a, **kw)

    monkeypatch.setattr(cpmod, "_copy_all", slow_copy)
    monkeypatch.setattr(commit, "cleanup", watched_cleanup)
    d = tmp_path / "ck"
    shm_cleanup.append(shm_root_for(d))
    with ckpt.Checkpointer(d, keep=1) as cp:
        for s in range(6):
            cp.save(s, state(s)).wait()  # the next save starts right after the commit
    assert overlaps == []
    assert disk_steps(d) == [5]  # retention still happened (the last one at close)


def test_deferred_cleanup_runs_when_no_save_follows(tmp_path, shm_cleanup):
    d = tmp_path / "ck"
    shm_cleanup.append(shm_root_for(d))
    cp = ckpt.Checkpointer(d, keep=1)
    try:
        cp.save(1, state(1)).wait()
        cp.save(2, state(2)).wait()
        deadline = persist.CLEANUP_IDLE_S * 20
        import time

        t0 = time.monotonic()
        while (d / mf.step_dirname(1)).exists() and time.monotonic() - t0 < deadline:
            time.sleep(0.05)
        assert disk_steps(d) == [2]
    finally:
        cp.close()


def test_slot_reuse_uncommits_only_the_step_it_held(tmp_path, shm_cleanup):
    """A slot overwritten by a new save uncommits the shm step linking it, and no other: a step
    saved again into the other slot keeps its shm copy."""
    d = tmp_path / "ck"
    shm = shm_root_for(d)
    shm_cleanup.append(shm)
    with ckpt.Checkpointer(d, keep=0) as cp:
        cp.save(1, state(1)).wait()  # slot 0
        cp.save(2, state(2)).wait()  # slot 1
        cp.save(2, state(2.5)).wait()  # step 2 again, into slot 0: step 1's shm copy is gone
        shm_steps = sorted(
            int(p.name.split("_")[1]) for p in shm.glob("step_*") if (p / mf.MANIFEST).exists()
        )
        assert 1 not in shm_steps and 2 in shm_steps
        cp.save(3, state(3)).wait()  # slot 1 (held the first step 2, superseded): step 2 stays
        target, stats = state(0), ckpt.LoadStats()
        assert ckpt.load(str(d), target, step=2, stats=stats) == 2
        assert set(stats.bytes_by_tier) == {"shm"}  # served by the slot that holds it
        assert torch.equal(target["model"]["w0"], state(2.5)["model"]["w0"])


# -- flatten: one pass, same result as the obvious recursive definition --------------------------

def reference_flatten(state: dict) -> tuple[list[tuple], list[tuple]]:
    """The definition: tensors in walk order; a non-root container without tensors is one object."""
    tensors, objects = [], []

    def has_tensor(v):
        if isinstance(v, (torch.Tensor, LocalShard)):
            return True
        if isinstance(v, dict):
            return any(has_tensor(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return any(has_tensor(x) for x in v)
        return False

    def walk(path, v):
        if isinstance(v, (torch.Tensor, LocalShard)):
            tensors.append(path)
        elif isinstance(v, (dict, list)) and (path == () or has_tensor(v)):
            for k, x in (v.items() if isinstance(v, dict) else enumerate(v)):
                walk((*path, k), x)
        else:
            objects.append((path, v))

    walk((), state)
    return tensors, objects


leaf = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none(), st.booleans(),
                 st.builds(lambda n: torch.zeros(n), st.integers(0, 3)))
nested = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text("xyz", min_size=1, max_size=2), nested, max_size=4))
def test_flatten_matches_the_definition(s):
    tensors, objects = flatten(s)
    ref_t, ref_o = reference_flatten(s)
    assert [e.path for e in tensors] == ref_t
    assert [(o.path, o.value) for o in objects] == ref_o


def test_flatten_errors_still_name_the_entry():
    with pytest.raises(StateError, match="'a/b' is a tuple holding tensors"):
        flatten({"a": {"b": (torch.zeros(1),)}})
    with pytest.raises(StateError, match="entry 'a/1': value of type object"):
        flatten({"a": [1, object()]})
    with pytest.raises(StateError, match="keys must be str or int"):
        flatten({"a": {1.5: torch.zeros(1)}})
    tensors, objects = flatten({"a": {1.5: "x"}, "t": torch.zeros(2)})  # tensor-free: JSON decides
    assert [o.path for o in objects] == [("a",)] and [e.name for e in tensors] == ["t"]


def test_relaid_slot_leaves_the_steps_it_held_intact(tmp_path, shm_cleanup):
    """A slot re-laid out for a new layout is a new file: the shm steps linking the old one keep
    their bytes and stay committed (nothing to uncommit), and load correctly."""
    d = tmp_path / "ck"
    shm_cleanup.append(shm_root_for(d))
    with ckpt.Checkpointer(d, keep=0) as cp:
        cp.save(1, state(1)).wait()  # slot 0
        cp.save(2, state(2)).wait()  # slot 1
        cp.save(3, state(3, n=6)).wait()  # another layout, into slot 0: a new file
        target, stats = state(0), ckpt.LoadStats()
        assert ckpt.load(str(d), target, step=1, stats=stats) == 1
        assert set(stats.bytes_by_tier) == {"shm"}
        assert torch.equal(target["model"]["w3"], state(1)["model"]["w3"])


def test_pieces_start_on_cache_lines_and_the_file_stays_plain_safetensors(tmp_path):
    """A copy into a misaligned destination runs ~25 % slower: the data region and every piece whose
    size is a multiple of 64 bytes start on a 64-byte boundary; odd-sized pieces come after them, still
    naturally aligned, with no holes (safetensors allows none)."""
    from safetensors.torch import load_file

    from tidal.ckpt.format.flatten import flatten as flat
    from tidal.ckpt.format.plan import DATA_ALIGN, ITEMSIZE, PieceDesc, make_plan

    st = {
        "a": torch.zeros(3, dtype=torch.float64),
        "b": torch.ones(16, 16),
        "c": torch.zeros(5, dtype=torch.int8),
        "d": torch.full((7,), 2.0, dtype=torch.bfloat16),
        "e": torch.ones(64, dtype=torch.float16),
    }
    tensors, _ = flat(st)
    plan = make_plan(
        [[PieceDesc(e.name, e.path, e.dtype, e.global_shape, e.box, e.placement) for e in tensors]]
    )
    rf = plan.files[0]
    assert len(rf.header) % DATA_ALIGN == 0
    for p in rf.pieces:
        assert p.start % ITEMSIZE[plan.entries[p.name].dtype] == 0
        if p.nbytes % DATA_ALIGN == 0:
            assert p.start % DATA_ALIGN == 0, p
    ends = sorted((p.start, p.start + p.nbytes) for p in rf.pieces)
    assert ends[0][0] == len(rf.header)
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))  # no holes
    d = tmp_path / "ck"
    with ckpt.Checkpointer(d, shm=False) as cp:
        cp.save(1, st).wait()
    (f,) = (d / mf.step_dirname(1)).glob("*.safetensors")
    plain = load_file(str(f))  # the rank file is a plain safetensors file
    assert all(torch.equal(plain[k], v) for k, v in st.items())

"""Pure box math and save planning: no processes, no files."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from tidal.ckpt.errors import StateError
from tidal.ckpt.format.layout import Box, byte_runs, check_tiling, intersect
from tidal.ckpt.format.plan import PieceDesc, make_plan


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk semantics, as FSDP2 and Shard(d) use: ceil-sized chunks, trailing may be empty."""
    size = -(-n // parts)
    return [(min(i * size, n), max(0, min((i + 1) * size, n) - min(i * size, n))) for i in range(parts)]


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        (Box((0, 0), (4, 4)), Box((2, 2), (4, 4)), Box((2, 2), (2, 2))),
        (Box((0,), (3,)), Box((3,), (3,)), None),  # touching, not overlapping
        (Box((0, 5), (10, 5)), Box((3, 0), (2, 6)), Box((3, 5), (2, 1))),
        (Box((), ()), Box((), ()), Box((), ())),
    ],
)
def test_intersect(a, b, want):
    assert intersect(a, b) == want
    assert intersect(b, a) == want


def test_box_rejects_negative_and_rank_mismatch():
    with pytest.raises(ValueError, match="must be >= 0"):
        Box((-1,), (2,))
    with pytest.raises(ValueError, match="differ in rank"):
        Box((0, 0), (1,))


def test_byte_runs_match_numpy_slicing():
    """Reading the runs from a C-ordered piece yields exactly the sub-box's bytes, nothing more."""
    rng = random.Random(0)
    for _ in range(300):
        ndim = rng.randint(1, 4)
        piece_len = [rng.randint(1, 6) for _ in range(ndim)]
        piece_off = [rng.randint(0, 3) for _ in range(ndim)]
        piece = Box(tuple(piece_off), tuple(piece_len))
        sub_off = [o + rng.randint(0, n - 1) for o, n in zip(piece_off, piece_len, strict=True)]
        sub_len = [rng.randint(1, o + n - s) for o, n, s in zip(piece_off, piece_len, sub_off, strict=True)]
        sub = Box(tuple(sub_off), tuple(sub_len))
        data = np.arange(int(np.prod(piece_len)), dtype=np.int32).reshape(piece_len)
        raw = data.tobytes()
        runs = byte_runs(piece, sub, 4)
        got = b"".join(raw[s : s + runs.run_bytes] for s in runs.starts)
        rel = sub.relative_to(piece)
        want = data[tuple(slice(o, o + n) for o, n in zip(rel.offsets, rel.lengths, strict=True))].tobytes()
        assert got == want
        assert runs.total_bytes == sub.numel * 4  # read amplification 1.00


def test_byte_runs_coalesce_full_trailing_dims():
    piece = Box((0, 0, 0), (8, 4, 5))
    runs = byte_runs(piece, Box((2, 0, 0), (3, 4, 5)), 2)
    assert runs.starts == (2 * 20 * 2,) and runs.run_bytes == 3 * 20 * 2  # one contiguous run
    runs = byte_runs(piece, Box((0, 1, 0), (2, 2, 5)), 4)
    assert len(runs.starts) == 2 and runs.run_bytes == 2 * 5 * 4


def test_check_tiling():
    shape = (10, 6)
    rows = [Box((o, 0), (n, 6)) for o, n in chunks(10, 3)]
    assert check_tiling(shape, rows) is None
    assert "cover 48 of 60" in check_tiling(shape, rows[:2])
    assert "overlap" in check_tiling(shape, [*rows, Box((0, 0), (1, 1))])
    assert "outside" in check_tiling(shape, [Box((9, 0), (2, 6))])


def desc(name, shape, box, dtype="F32"):
    return PieceDesc(name, (name,), dtype, tuple(shape), box, "test")


def test_plan_dedupes_replicas_and_spreads_writers():
    # 4 ranks all hold the same 8 replicated tensors: each is written once, 2 per rank.
    per_rank = [[desc(f"t{i}", (16,), Box((0,), (16,))) for i in range(8)] for _ in range(4)]
    plan = make_plan(per_rank)
    counts = [len(f.pieces) for f in plan.files]
    assert counts == [2, 2, 2, 2]
    written = sorted(p.name for f in plan.files for p in f.pieces)
    assert written == sorted(f"t{i}" for i in range(8))


def test_plan_tp_dp_replicas_written_once():
    # 2-D mesh (dp=2, tp=2): ranks (0,1) and (2,3) hold the two column halves twice over.
    shape = (6, 8)
    halves = [Box((0, 0), (6, 4)), Box((0, 4), (6, 4))]
    per_rank = [[desc("w", shape, halves[r % 2])] for r in range(4)]
    plan = make_plan(per_rank)
    pieces = plan.pieces_of("w")
    assert sorted(p.box.offsets for p in pieces) == [(0, 0), (0, 4)]
    assert len({p.rank for p in pieces}) == 2


def test_plan_layout_is_aligned_and_step_independent():
    per_rank = [[desc("a", (3,), Box((0,), (3,)), "U8"), desc("b", (5,), Box((0,), (5,)), "F64"),
                 desc("c", (7,), Box((0,), (7,)), "F16"), desc("d", (2,), Box((0,), (2,)), "I32")]]
    plan = make_plan(per_rank)
    f = plan.files[0]
    assert len(f.header) % 8 == 0
    sizes = {"a": 1, "b": 8, "c": 2, "d": 4}
    for p in f.pieces:
        assert p.start % sizes[p.name] == 0
    assert [p.name for p in f.pieces] == ["b", "d", "c", "a"]
    assert make_plan(per_rank).fingerprint == plan.fingerprint


def test_plan_rejects_disagreeing_ranks_and_gaps():
    with pytest.raises(StateError, match="ranks disagree on it"):
        make_plan([[desc("w", (4,), Box((0,), (4,)))], [desc("w", (5,), Box((0,), (5,)))]])
    with pytest.raises(StateError, match="do not tile"):
        make_plan([[desc("w", (4,), Box((0,), (2,)))], [desc("w", (4,), Box((0,), (2,)))]])
    with pytest.raises(StateError, match="rank 1 is missing"):
        make_plan([[desc("w", (4,), Box((0,), (4,))), desc("v", (1,), Box((0,), (1,)))],
                   [desc("w", (4,), Box((0,), (4,)))]])


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.product([1, 2, 3, 4], [1, 2, 3, 4])))
def test_reshard_reads_cover_each_new_shard_exactly(saved, loaded):
    """Row-sharded (FSDP-like) on `saved` ranks -> `loaded` ranks: intersections tile each target."""
    stored = [Box((o, 0), (n, 3)) for o, n in chunks(13, saved) if n]
    for o, n in chunks(13, loaded):
        target = Box((o, 0), (n, 3))
        parts = [b for b in (intersect(s, target) for s in stored) if b is not None]
        assert sum(p.numel for p in parts) == target.numel

"""Layout math: boxes, intersections and byte runs. Pure: no I/O, no torch.

A piece is a *box* (per-dimension ``offsets`` and ``lengths``) of a global tensor, stored C-contiguously,
so the bytes of a sub-box are equally long contiguous *runs*."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle ``[offsets, offsets + lengths)`` inside a global tensor shape."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box offsets {self.offsets} and lengths {self.lengths} differ in rank")
        if self.offsets and (min(self.offsets) < 0 or min(self.lengths) < 0):
            raise ValueError(f"box offsets {self.offsets} / lengths {self.lengths} must be >= 0")

    @staticmethod
    @functools.cache  # every save describes every replicated tensor as a whole box
    def whole(shape: tuple[int, ...]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape, strict=True))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets, strict=True)), self.lengths)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or ``None`` when they do not overlap (or overlap is empty)."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offs, lens = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return Box(tuple(offs), tuple(lens))


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-contiguous element strides of ``shape``."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


@dataclass(frozen=True)
class Runs:
    """Byte runs of a sub-box inside a C-contiguous piece: ``starts`` relative to the piece's first byte,
    each ``run_bytes`` long; concatenated in order, they are the sub-box's bytes in C order."""

    starts: tuple[int, ...]
    run_bytes: int

    @property
    def total_bytes(self) -> int:
        return len(self.starts) * self.run_bytes


def byte_runs(piece: Box, sub: Box, itemsize: int) -> Runs:
    """The contiguous byte runs of ``sub`` (global coordinates) inside stored ``piece``."""
    rel = sub.relative_to(piece)
    shape = piece.lengths
    if rel.ndim == 0:
        return Runs((0,), itemsize)
    if rel.numel == 0:
        return Runs((), 0)
    st = strides(shape)
    # Find the innermost dims the sub-box covers completely: they merge into one run together with
    # the first dim (from the inside) that it covers only partly.
    k = rel.ndim - 1
    while k > 0 and rel.offsets[k] == 0 and rel.lengths[k] == shape[k]:
        k -= 1
    run_elems = rel.lengths[k] * st[k]
    outer = [range(rel.offsets[d], rel.offsets[d] + rel.lengths[d]) for d in range(k)]
    base = rel.offsets[k] * st[k]
    starts = [(base + sum(i * st[d] for d, i in enumerate(idx))) * itemsize
              for idx in itertools.product(*outer)]
    return Runs(tuple(starts), run_elems * itemsize)


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], ops: list[int] | None = None) -> str | None:
    """``None`` when distinct ``boxes`` exactly tile ``shape`` (no gap, no overlap), else a sentence
    saying what is wrong. Duplicate boxes must be removed by the caller.

    O(n log n) for the layouts sharding produces (any guillotine partition): the boxes are split
    recursively into groups separated by a cut through no box, and each group must fill its slab. A
    part no cut splits (a pinwheel) is checked pair by pair. Work is bounded (``ops[0]`` counts it),
    so a crafted manifest cannot stall a load.
    """
    total = math.prod(shape)
    nd = len(shape)
    for b in boxes:
        if not b.within(shape):
            return f"piece {b.offsets}+{b.lengths} lies outside global shape {tuple(shape)}"
    covered = sum(b.numel for b in boxes)
    if covered > total:
        return f"pieces overlap: they hold {covered} elements of global shape {tuple(shape)} ({total})"
    if covered != total:
        return f"pieces cover {covered} of {total} elements of global shape {tuple(shape)}"
    if total == 0:
        return None
    n = len(boxes)
    budget = 64 * (n + 1) * (n.bit_length() + 1) * max(1, nd) + 10_000
    count = ops if ops is not None else [0]
    stack: list[tuple[tuple[int, ...], tuple[int, ...], list[Box]]] = [
        (tuple(0 for _ in shape), tuple(shape), [b for b in boxes if b.numel > 0])]
    while stack:
        lo, hi, group = stack.pop()
        m = len(group)
        count[0] += m
        if m == 1:
            b = group[0]
            if b.offsets != lo or b.ends != hi:
                return (f"piece {b.offsets}+{b.lengths} does not fill the slab {lo}..{hi} it alone lies in: "
                        "the pieces overlap or leave a gap there")
            continue
        for d in range(nd):
            order = sorted(group, key=lambda b: b.offsets[d])
            count[0] += m * max(1, m.bit_length())
            parts: list[list[Box]] = [[order[0]]]
            end = order[0].offsets[d] + order[0].lengths[d]
            for b in order[1:]:
                if b.offsets[d] >= end:
                    parts.append([b])
                else:
                    parts[-1].append(b)
                end = max(end, b.offsets[d] + b.lengths[d])
            if len(parts) == 1:
                continue
            at = lo[d]
            for part in parts:
                first = part[0].offsets[d]
                stop = max(b.offsets[d] + b.lengths[d] for b in part)
                if first != at:
                    return f"no piece covers indices {at}..{first} of dimension {d} in the slab {lo}..{hi}"
                stack.append((lo[:d] + (first,) + lo[d + 1:], hi[:d] + (stop,) + hi[d + 1:], part))
                at = stop
            if at != hi[d]:
                return f"no piece covers indices {at}..{hi[d]} of dimension {d} in the slab {lo}..{hi}"
            break
        else:  # no cut splits this part: pair by pair, within the budget
            count[0] += m * (m - 1) // 2
            if count[0] > budget:
                return (f"{n} pieces form a layout too irregular to check in bounded time "
                        "(no cut through the tensor separates them)")
            if sum(b.numel for b in group) != math.prod(h - o for o, h in zip(lo, hi, strict=True)):
                return f"pieces leave a gap or overlap in the slab {lo}..{hi}"
            for i in range(m):
                for j in range(i + 1, m):
                    ov = intersect(group[i], group[j])
                    if ov is not None and ov.numel > 0:
                        return f"pieces {group[i].offsets} and {group[j].offsets} overlap"
        if count[0] > budget:
            return f"{n} pieces form a layout too irregular to check in bounded time"
    return None

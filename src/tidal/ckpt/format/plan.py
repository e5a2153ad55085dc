"""Save planning: who writes which piece, and where each piece sits in its safetensors file. Pure.

Every rank runs :func:`make_plan` on the same exchanged descriptions and gets the same plan. Replicas
are written once, by the holder with the fewest bytes so far; each rank's file has its header padded to
``DATA_ALIGN`` bytes, then the pieces whose size is a multiple of it, then the others by element size,
so every piece is aligned. The layout depends only on the pieces, so a staging slot is reused."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field

from tidal.ckpt.errors import StateError
from tidal.ckpt.format.layout import Box, check_tiling

DATA_ALIGN = 64  # the data region starts on a cache line; so does every piece whose size is a multiple of it
ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


@dataclass(frozen=True)
class PieceDesc:
    """What one rank holds of one tensor entry (exchanged between ranks as JSON)."""

    name: str
    path: tuple
    dtype: str
    shape: tuple[int, ...]
    box: Box
    layout: str

    def to_json(self) -> list:
        return [self.name, list(self.path), self.dtype, list(self.shape), list(self.box.offsets),
                list(self.box.lengths), self.layout]

    @staticmethod
    def from_json(v: list) -> PieceDesc:
        name, path, dtype, shape, offs, lens, layout = v
        return PieceDesc(name, tuple(path), dtype, tuple(shape), Box(tuple(offs), tuple(lens)), layout)


@dataclass(frozen=True)
class PlannedPiece:
    name: str  # entry name
    box: Box
    rank: int  # writer
    key: str  # tensor name inside the safetensors file
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class RankFile:
    rank: int
    pieces: list[PlannedPiece] = field(default_factory=list)
    header: bytes = b""  # 8-byte length prefix + JSON header, padded

    @property
    def size_bytes(self) -> int:
        return len(self.header) + sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class EntryInfo:
    """One tensor entry, described globally (a stored one adds its pieces: ``manifest.StoredTensor``)."""

    name: str
    path: tuple
    dtype: str
    shape: tuple[int, ...]
    layout: str


@dataclass
class SavePlan:
    world_size: int
    entries: dict[str, EntryInfo]  # by name, in sorted order
    files: list[RankFile]  # index = rank
    fingerprint: str  # same plan <=> same fingerprint (used to reuse staging buffers)

    @functools.cached_property
    def _by_name(self) -> dict[str, list[PlannedPiece]]:
        index: dict[str, list[PlannedPiece]] = {}
        for f in self.files:
            for p in f.pieces:
                index.setdefault(p.name, []).append(p)
        return index

    def pieces_of(self, name: str) -> list[PlannedPiece]:
        """The pieces of one entry, in rank order (indexed once: a manifest asks for every entry)."""
        return list(self._by_name.get(name, ()))


def piece_key(name: str, box: Box, shape: tuple[int, ...]) -> str:
    if box.offsets == tuple(0 for _ in shape) and box.lengths == tuple(shape):
        return name
    return name + "@" + ",".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.lengths, strict=True))


def make_plan(per_rank: list[list[PieceDesc]]) -> SavePlan:
    """Deduplicate replicas, check that each entry's pieces tile it, and assign writers."""
    world = len(per_rank)
    entries: dict[str, EntryInfo] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, descs in enumerate(per_rank):
        for d in descs:
            info = entries.get(d.name)
            if info is None:
                entries[d.name] = EntryInfo(d.name, d.path, d.dtype, d.shape, d.layout)
            elif (info.dtype, info.shape) != (d.dtype, d.shape):
                raise StateError(f"tensor '{d.name}': ranks disagree on it: dtype {info.dtype} shape "
                                 f"{list(info.shape)} on one rank, dtype {d.dtype} shape {list(d.shape)} on "
                                 f"rank {rank}")
            if d.box.numel == 0 and math.prod(d.shape) > 0:
                continue  # an empty shard (uneven sharding) holds nothing to write
            holders.setdefault((d.name, d.box), []).append(rank)
    names_per_rank = [{d.name for d in descs} for descs in per_rank]
    all_names = set(entries)
    for rank, names in enumerate(names_per_rank):
        if names != all_names:
            missing = sorted(all_names - names)[:5]
            raise StateError(f"rank {rank} is missing tensors held by other ranks: {missing}")
    by_entry: dict[str, list[Box]] = {}
    for (name, box) in holders:
        by_entry.setdefault(name, []).append(box)
    for name, boxes in by_entry.items():
        problem = check_tiling(entries[name].shape, boxes)
        if problem:
            raise StateError(f"tensor '{name}': the pieces held by the ranks do not tile it: {problem}")

    # Assign writers: biggest pieces first, each to the least-loaded holder.
    load = [0] * world
    order = sorted(holders.items(), key=lambda kv: (-_nbytes(entries[kv[0][0]], kv[0][1]), kv[0][0],
                                                    kv[0][1].offsets))
    assigned: list[list[tuple[str, Box, int]]] = [[] for _ in range(world)]
    for (name, box), ranks in order:
        nb = _nbytes(entries[name], box)
        writer = min(ranks, key=lambda r: (load[r], r))
        load[writer] += nb
        assigned[writer].append((name, box, nb))

    files = []
    for rank in range(world):
        items = sorted(assigned[rank], key=lambda t: (t[2] % DATA_ALIGN != 0, -ITEMSIZE[entries[t[0]].dtype],
                                                      t[0], t[1].offsets))
        files.append(_layout_file(rank, items, entries))
    h = hashlib.sha256()
    for f in files:
        h.update(f.header)
    return SavePlan(world, dict(sorted(entries.items())), files, h.hexdigest()[:16])


def _nbytes(info: EntryInfo, box: Box) -> int:
    return box.numel * ITEMSIZE[info.dtype]


def _layout_file(rank: int, items: list[tuple[str, Box, int]], entries: dict[str, EntryInfo]) -> RankFile:
    header: dict = {"__metadata__": {"format": "tidal-ckpt", "rank": str(rank)}}
    pos = 0
    keyed = []
    for name, box, nb in items:
        key = piece_key(name, box, entries[name].shape)
        header[key] = {"dtype": entries[name].dtype, "shape": list(box.lengths),
                       "data_offsets": [pos, pos + nb]}
        keyed.append((name, box, key, pos, nb))
        pos += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((DATA_ALIGN - (len(raw) + 8) % DATA_ALIGN) % DATA_ALIGN)  # JSON may end in spaces
    head = struct.pack("<Q", len(raw)) + raw
    pieces = [PlannedPiece(n, b, rank, k, len(head) + p, nb) for n, b, k, p, nb in keyed]
    return RankFile(rank, pieces, head)

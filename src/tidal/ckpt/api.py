"""Loading (= resharding) and listing committed steps.

``load`` is collective when a process group is in use (ranks agree on the step); each rank then
reads on its own: for every tensor it holds now, it intersects its box with the stored pieces and
reads exactly the byte runs of those intersections, from the fastest tier that has the piece.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.ckpt import comm
from tidal.ckpt import manifest as mf
from tidal.ckpt.errors import CorruptionError, NotFoundError, StateError
from tidal.ckpt.flatten import ST_TO_DTYPE, TensorEntry, flatten, path_name, set_path
from tidal.ckpt.layout import Box, byte_runs, intersect
from tidal.ckpt.plan import ITEMSIZE
from tidal.ckpt.tiers import DirTier, newest_manifest, tiers_for


@dataclass
class LoadStats:
    """What a ``load`` did on this rank. ``read_amplification`` is 1.0 when only needed bytes were read."""

    step: int = -1
    manifest_tier: str = ""
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    pieces_read: int = 0
    fallbacks: list[str] = field(default_factory=list)

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def steps(url: str | os.PathLike) -> list[int]:
    """Committed steps at ``url`` in any tier (node shared memory or the directory), ascending."""
    out: set[int] = set()
    for t in tiers_for(url):
        out.update(t.committed_steps())
    return sorted(out)


def load(url: str | os.PathLike, state: dict, step: int | None = None, process_group: Any = None, *,
         strict: bool = True, verify: bool = True, stats: LoadStats | None = None) -> int:
    """Fill ``state`` in place from a committed step (the newest by default); return the step.

    Tensors (plain, DTensor, LocalShard) are filled in place with the part this rank holds now,
    whatever layout they were saved from. Non-tensor values are replaced. ``strict`` requires the
    checkpoint and ``state`` to hold exactly the same entries. ``verify`` checks the CRC-32 of
    every piece read whole (partial reads are verified by ``tidal ckpt verify``).
    """
    stats = stats if stats is not None else LoadStats()
    tiers = tiers_for(url)
    available = sorted({s for t in tiers for s in t.committed_steps()})
    if step is None:
        if not available:
            raise NotFoundError(f"no committed checkpoint step at {url}")
        chosen = comm.all_min(available[-1], process_group)
    else:
        chosen = step
    if chosen not in available:
        raise NotFoundError(f"step {chosen} is not committed at {url}; committed steps: {available[-10:]}")
    tier, man = newest_manifest(tiers, chosen)
    holding = [t for t in tiers if chosen in t.committed_steps()]
    holding.sort(key=lambda t: t is not tier)  # the tier whose manifest we read comes first
    stats.step, stats.manifest_tier = chosen, tier.name
    _fill(man, holding, state, strict=strict, verify=verify, stats=stats)
    return chosen


def _fill(man: mf.Manifest, tiers: list[DirTier], state: dict, *, strict: bool, verify: bool,
          stats: LoadStats) -> None:
    tensors, objects = flatten(state)
    stored_objects = {tuple(p): v for p, v in man.objects}
    want_t = {e.name: e for e in tensors}
    want_o = {tuple(o.path): o for o in objects}
    stored_o_names = {path_name(p): p for p in stored_objects}
    # An entry may be a tensor on one side and a plain value on the other.
    for name in want_t:
        if name in stored_o_names:
            raise StateError(f"entry '{name}': state holds a tensor but step {man.step} stores a plain value")
    for p in want_o:
        if path_name(p) in man.tensors:
            raise StateError(f"entry '{path_name(p)}': state holds a plain value but step {man.step} stores a tensor")
    missing = [n for n in want_t if n not in man.tensors] + [path_name(p) for p in want_o if p not in stored_objects]
    unexpected = [n for n in man.tensors if n not in want_t] + [
        path_name(p) for p in stored_objects if p not in want_o and path_name(p) not in want_t]
    if strict and (missing or unexpected):
        raise StateError(
            f"state and step {man.step} hold different entries (pass strict=False to load the common ones): "
            f"missing from the checkpoint: {sorted(missing)[:10]}{' …' if len(missing) > 10 else ''}; "
            f"unexpected in the checkpoint: {sorted(unexpected)[:10]}{' …' if len(unexpected) > 10 else ''}"
        )
    for name, entry in want_t.items():
        st = man.tensors.get(name)
        if st is None:
            continue
        if tuple(entry.global_shape) != st.shape or entry.dtype != st.dtype:
            raise StateError(
                f"tensor '{name}': state expects dtype {entry.dtype} shape {list(entry.global_shape)}, "
                f"step {man.step} stores dtype {st.dtype} shape {list(st.shape)}"
            )
    reader = _Reader(man, tiers, verify, stats)
    try:
        for name, entry in want_t.items():
            st = man.tensors.get(name)
            if st is not None:
                reader.fill(entry, st)
    finally:
        reader.close()
    for p, o in want_o.items():
        if p in stored_objects:
            set_path(state, o.path, _conform(stored_objects[p], o.value))


def _conform(stored: Any, like: Any) -> Any:
    """JSON has no tuples: give back tuples where the target state had them (e.g. Adam's betas)."""
    if isinstance(like, tuple) and isinstance(stored, list) and len(like) == len(stored):
        return tuple(_conform(s, x) for s, x in zip(stored, like, strict=True))
    if isinstance(like, list) and isinstance(stored, list) and len(like) == len(stored):
        return [_conform(s, x) for s, x in zip(stored, like, strict=True)]
    if isinstance(like, dict) and isinstance(stored, dict):  # JSON keys are strings: restore int keys
        keys = {str(k): k for k in like}
        return {keys.get(k, k): _conform(v, like[keys[k]]) if k in keys else v for k, v in stored.items()}
    return stored


class _Reader:
    def __init__(self, man: mf.Manifest, tiers: list[DirTier], verify: bool, stats: LoadStats) -> None:
        self.man, self.tiers, self.verify, self.stats = man, tiers, verify, stats
        self._fds: dict[tuple[str, str], int] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _fd(self, tier: DirTier, file: str) -> int:
        key = (tier.name, file)
        if key not in self._fds:
            self._fds[key] = os.open(tier.step_dir(self.man.step) / file, os.O_RDONLY)
        return self._fds[key]

    def fill(self, entry: TensorEntry, st: mf.StoredTensor) -> None:
        local = entry.local
        self.stats.bytes_needed += entry.box.numel * ITEMSIZE[st.dtype]
        for piece in st.pieces:
            sub = intersect(piece.box, entry.box) if entry.box.ndim else piece.box
            if sub is None or sub.numel == 0:
                continue
            data = self._read(st, piece, sub)
            dst = local[_slices(sub.relative_to(entry.box))] if entry.box.ndim else local
            with torch.no_grad():
                dst.copy_(data.view(ST_TO_DTYPE[st.dtype]).view(sub.lengths))

    def _read(self, st: mf.StoredTensor, piece: mf.StoredPiece, sub: Box) -> torch.Tensor:
        itemsize = ITEMSIZE[st.dtype]
        runs = byte_runs(piece.box, sub, itemsize)
        whole = sub == piece.box
        errors = []
        for tier in self.tiers:
            where = f"{tier.step_dir(self.man.step) / piece.file} (step {self.man.step}, tier '{tier.name}')"
            try:
                fd = self._fd(tier, piece.file)
            except OSError as e:
                errors.append(f"{where}: {e.strerror}")
                self.stats.fallbacks.append(f"{tier.name}:{piece.file}: {e.strerror}")
                continue
            buf = torch.empty(runs.total_bytes, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            try:
                pos = 0
                for start in runs.starts:
                    n = os.preadv(fd, [mv[pos : pos + runs.run_bytes]], piece.start + start)
                    if n != runs.run_bytes:
                        raise CorruptionError(f"{where}: file is truncated (tensor '{st.name}' needs bytes "
                                              f"{piece.start + start}..{piece.start + start + runs.run_bytes})")
                    pos += n
                self.stats.bytes_read += runs.total_bytes
                self.stats.bytes_by_tier[tier.name] = self.stats.bytes_by_tier.get(tier.name, 0) + runs.total_bytes
                if self.verify and whole and zlib.crc32(mv) != piece.crc32:
                    raise CorruptionError(f"{where}: checksum mismatch in tensor '{st.name}' "
                                          f"piece at offsets {list(piece.box.offsets)}")
            except CorruptionError as e:
                errors.append(str(e))
                self.stats.fallbacks.append(str(e))
                continue
            self.stats.pieces_read += 1
            return buf
        raise CorruptionError("; ".join(errors) or f"tensor '{st.name}': no tier holds {piece.file}")


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def read_manifest(url: str | os.PathLike, step: int | None = None) -> tuple[DirTier, mf.Manifest]:
    """The manifest of ``step`` (newest by default) from the fastest tier holding it."""
    tiers = tiers_for(url)
    available = sorted({s for t in tiers for s in t.committed_steps()})
    if not available:
        raise NotFoundError(f"no committed checkpoint step at {url}")
    s = available[-1] if step is None else step
    if s not in available:
        raise NotFoundError(f"step {s} is not committed at {url}; committed steps: {available[-10:]}")
    return newest_manifest(tiers, s)

"""Reading pieces of a step for ``load``: exact byte ranges, fastest tier first, with fallback.

The bytes a rank needs of a piece are runs (``layout.byte_runs``), merged; in a version-2 step they
are widened to whole checksum blocks (``widen``), every block read is checked and the runs cut out. A
missing or truncated file, a bad block or an unreachable tier falls back to the next tier (an
unreachable one is skipped for the rest of the load)."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from tidal.ckpt.errors import CorruptionError, TierError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.flatten import ST_TO_DTYPE, TensorEntry
from tidal.ckpt.format.layout import Box, intersect
from tidal.ckpt.format.layout import byte_runs as _byte_runs
from tidal.ckpt.format.plan import ITEMSIZE
from tidal.ckpt.tiers.protocol import RangeReader, Tier, TruncatedRead


def widen(ranges: Sequence[tuple[int, int]], start: int, nbytes: int, block: int) -> list[tuple[int, int]]:
    """``ranges`` (absolute, sorted) widened to whole blocks of the piece at ``start``, merged."""
    out: list[list[int]] = []
    for off, n in ranges:
        lo = start + (off - start) // block * block
        hi = min(start + -(-(off + n - start) // block) * block, start + nbytes)
        if out and out[-1][1] >= lo:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]


def coalesce(starts: Sequence[int], run_bytes: int, base: int) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges covering runs of ``run_bytes`` at ``base + start``, merged."""
    out: list[list[int]] = []
    for s in starts:
        off = base + s
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += run_bytes
        else:
            out.append([off, run_bytes])
    return [(o, n) for o, n in out]


class PieceReader:
    """Reads the pieces of one step for one ``load`` on one rank: one after another when every tier is
    local, ``parallel`` at a time when a remote tier is among them, so that request latency overlaps."""

    def __init__(self, man: mf.Manifest, tiers: list[Tier], verify: bool, stats, parallel: int = 8) -> None:
        self.man, self.tiers, self.verify, self.stats = man, tiers, verify, stats
        self.parallel = parallel if any(not t.fast for t in tiers) else 1
        self._open: dict[tuple[str, str], RangeReader] = {}
        self._dead: dict[str, str] = {}  # tier name -> why it was given up for this load
        self._lock = threading.Lock()

    def close(self) -> None:
        for r in self._open.values():
            r.close()
        self._open.clear()

    def _reader(self, tier: Tier, file: str) -> RangeReader:
        key = (tier.name, file)
        with self._lock:
            if key not in self._open:
                self._open[key] = tier.open_file(self.man.step, file)
            return self._open[key]

    def fill_all(self, items: list[tuple[TensorEntry, mf.StoredTensor]]) -> None:
        """Fill every entry's local tensor with its part of the stored tensor."""
        jobs = []
        for entry, st in items:
            self.stats.bytes_needed += entry.box.numel * ITEMSIZE[st.dtype]
            for piece in st.pieces:
                sub = intersect(piece.box, entry.box) if entry.box.ndim else piece.box
                if sub is not None and sub.numel > 0:
                    jobs.append((entry, st, piece, sub))
        if self.parallel <= 1 or len(jobs) <= 1:
            for job in jobs:
                self._fill_one(*job)
            return
        with ThreadPoolExecutor(min(self.parallel, len(jobs)), thread_name_prefix="tidal-load") as pool:
            futures = [pool.submit(self._fill_one, *job) for job in jobs]
            wait(futures)
        for f in futures:
            f.result()  # the first failure, in piece order

    def _fill_one(self, entry: TensorEntry, st: mf.StoredTensor, piece: mf.StoredPiece, sub: Box) -> None:
        data = self._read(st, piece, sub)
        dst = entry.local[_slices(sub.relative_to(entry.box))] if entry.box.ndim else entry.local
        with torch.no_grad():
            dst.copy_(data.view(ST_TO_DTYPE[st.dtype]).view(sub.lengths))

    def _fallback(self, errors: list[str], msg: str, note: str | None = None) -> None:
        errors.append(msg)
        with self._lock:
            self.stats.fallbacks.append(note or msg)

    def _read(self, st: mf.StoredTensor, piece: mf.StoredPiece, sub: Box) -> torch.Tensor:
        runs = _byte_runs(piece.box, sub, ITEMSIZE[st.dtype])
        needed = coalesce(runs.starts, runs.run_bytes, piece.start)
        blocks = self.verify and piece.blocks is not None
        ranges = widen(needed, piece.start, piece.nbytes, piece.block_bytes) if blocks else needed
        total = sum(n for _, n in ranges)
        whole = sub == piece.box
        step = self.man.step
        errors: list[str] = []
        for tier in self.tiers:
            where = f"{tier.where(step, piece.file)} (step {step}, tier '{tier.name}')"
            if tier.name in self._dead:
                errors.append(f"{where}: skipped: {self._dead[tier.name]}")
                continue
            try:
                reader = self._reader(tier, piece.file)
            except OSError as e:
                why = e.strerror or str(e)
                self._fallback(errors, f"{where}: {why}", f"{tier.name}:{piece.file}: {why}")
                if isinstance(e, TierError):
                    self._dead[tier.name] = why
                continue
            buf = torch.empty(total, dtype=torch.uint8)
            mv = buf.numpy().data
            try:
                reader.read_ranges(ranges, mv)
            except TruncatedRead as t:
                self._fallback(errors, f"{where}: file is truncated (tensor '{st.name}' needs bytes "
                                       f"{t.offset}..{t.offset + t.length})")
                continue
            except FileNotFoundError as e:
                why = e.strerror or str(e)
                self._fallback(errors, f"{where}: {why}", f"{tier.name}:{piece.file}: {why}")
                continue
            except OSError as e:  # unreachable: give the tier up for this load
                self._dead[tier.name] = str(e)
                self._fallback(errors, f"{where}: {e}")
                continue
            with self._lock:
                self.stats.bytes_read += total
                self.stats.bytes_by_tier[tier.name] = self.stats.bytes_by_tier.get(tier.name, 0) + total
            if blocks:
                if bad := mf.bad_blocks(mv, ranges, piece):
                    span = piece.block_span(bad[0])
                    self._fallback(errors, f"{where}: checksum mismatch in tensor '{st.name}' piece at "
                                           f"offsets {list(piece.box.offsets)}, block {bad[0]} (bytes "
                                           f"{span[0]}..{sum(span)})")
                    continue
            elif self.verify and whole and piece.crc32 is not None and zlib.crc32(mv) != piece.crc32:
                self._fallback(errors, f"{where}: checksum mismatch in tensor '{st.name}' "
                                       f"piece at offsets {list(piece.box.offsets)}")
                continue
            with self._lock:
                self.stats.pieces_read += 1
            return buf if ranges == needed else _cut(buf, ranges, needed, runs.total_bytes)
        raise CorruptionError("; ".join(errors) or f"tensor '{st.name}': no tier holds {piece.file}")


def _cut(buf: torch.Tensor, ranges: list[tuple[int, int]], needed: list[tuple[int, int]],
         size: int) -> torch.Tensor:
    """The ``needed`` ranges (each inside one of ``ranges``, both sorted), cut out of ``buf``."""
    out = torch.empty(size, dtype=torch.uint8)
    k, base, pos = 0, 0, 0
    for off, n in needed:
        while off >= ranges[k][0] + ranges[k][1]:
            base += ranges[k][1]
            k += 1
        at = base + off - ranges[k][0]
        out[pos : pos + n] = buf[at : at + n]
        pos += n
    return out


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))

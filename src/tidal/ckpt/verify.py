"""Re-reading a step copy in one tier for ``tidal ckpt verify``: the manifest's checksum, sizes,
safetensors headers (parsed through two ranged reads, and their CRC-32) and every block's CRC-32
(version 1: every piece's), through the tier's own reader in chunks of at most 16 MiB."""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from tidal.ckpt.errors import ManifestError, UnsafeFileError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.plan import ITEMSIZE
from tidal.ckpt.tiers.protocol import RangeReader, TruncatedRead

_CHUNK = 16 << 20  # bytes read at a time when checksumming


def _read(tier: Any, step: int) -> mf.Manifest:
    """``tier``'s manifest of ``step`` (which says it is ``step``), signed with ``$TIDAL_CKPT_KEY`` if set."""
    m = tier.read_manifest(step)
    mf.check_mac(m.raw, mf.checkpoint_key(), tier.where(step, mf.MANIFEST))
    return m


@dataclass
class Problem:
    tier: str
    step: int
    file: str | None
    tensor: str | None
    problem: str

    def line(self) -> str:
        parts = [f"tier '{self.tier}' step {self.step}"]
        if self.file:
            parts.append(self.file)
        if self.tensor is not None:
            parts.append(f"tensor '{self.tensor}'")
        return ": ".join(parts) + ": " + self.problem


@dataclass
class Checked:
    tier: str
    step: int
    files: int = 0
    pieces: int = 0
    bytes: int = 0
    ok: bool = True
    note: str = ""


def _check_range(reader: RangeReader, start: int, nbytes: int, buf: memoryview,
                 piece: mf.StoredPiece | None = None) -> tuple[int, list[int], int]:
    """Read ``nbytes`` at ``start`` in chunks: (their CRC-32, or the blocks of version-2 ``piece`` whose
    CRC-32 differs; how many bytes the object had there)."""
    crc, done = 0, 0
    bad: list[int] = []
    if piece is not None:  # chunks of whole blocks
        chunk = max(piece.block_bytes, len(buf) // piece.block_bytes * piece.block_bytes)
        buf = buf[:chunk] if chunk <= len(buf) else memoryview(bytearray(chunk))
    while done < nbytes:
        n = min(len(buf), nbytes - done)
        try:
            reader.read_ranges([(start + done, n)], buf[:n])
        except TruncatedRead as e:  # the bytes read of this chunk are not trusted
            return crc, bad, done + max(0, min(e.got, n))
        if piece is not None:
            bad += mf.bad_blocks(buf[:n], [(start + done, n)], piece)
        else:
            crc = zlib.crc32(buf[:n], crc)
        done += n
    return crc, bad, done


def _parse_header(reader: RangeReader, size: int) -> tuple[dict[str, Any], int]:
    """(the safetensors header, where the data starts) through ``reader``; ValueError saying what breaks
    the format as the safetensors library checks it: known dtypes, each entry's bytes matching its dtype
    and shape, the entries' bytes back to back from the data's start, within the object."""
    if size < 8:
        raise ValueError(f"the object is {size} bytes, shorter than a safetensors header length")
    head = bytearray(8)
    reader.read_ranges([(0, 8)], memoryview(head))
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        raise ValueError(f"header length {n} does not fit in the object ({size} bytes)")
    raw = bytearray(n)
    reader.read_ranges([(8, n)], memoryview(raw))
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    spans = []
    for k, h in header.items():
        if k == "__metadata__":
            continue
        offs = h.get("data_offsets") if isinstance(h, dict) else None
        if (not isinstance(h, dict) or h.get("dtype") not in ITEMSIZE or not isinstance(h.get("shape"), list)
                or not all(type(x) is int and x >= 0 for x in h["shape"]) or not isinstance(offs, list)
                or len(offs) != 2 or not all(type(x) is int for x in offs)):
            raise ValueError(f"entry '{k}' lacks a known dtype, a shape or data_offsets")
        if offs[1] - offs[0] != math.prod(h["shape"]) * ITEMSIZE[h["dtype"]]:
            raise ValueError(f"entry '{k}': data_offsets {offs} do not fit its dtype and shape")
        spans.append(offs)
    end = 0
    for lo, hi in sorted(spans):
        if lo != end:
            raise ValueError(f"tensor data leave a gap or overlap at byte {8 + n + min(lo, end)}")
        end = hi
    if 8 + n + end > size:
        raise ValueError(f"tensor data ends at byte {8 + n + end}, past the end of the object ({size} bytes)")
    return header, 8 + n


Expect = dict[str, tuple[str, str, list[int], int, int]]  # piece key -> (tensor, dtype, shape, start, end)


def _compare_header(header: dict[str, Any], base: int, expect: Expect, problem: Any) -> None:
    """Compare a parsed header's keys, dtypes, shapes and data offsets with the manifest's pieces."""
    found = {k: (h["dtype"], [int(x) for x in h["shape"]]) for k, h in header.items() if k != "__metadata__"}
    for key, (name, dtype, shape, _, _) in expect.items():
        if key not in found:
            problem(name, f"piece key '{key}' is missing from the file")
        elif found[key] != (dtype, shape):
            problem(name, f"piece key '{key}' is stored as {found[key][0]} {found[key][1]}, "
                          f"the manifest says {dtype} {shape}")
    for key in sorted(set(found) - set(expect)):
        problem(None, f"holds tensor key '{key}' that the manifest does not list")
    for key, (name, _, _, start, end) in expect.items():
        h = header.get(key)
        if not isinstance(h, dict) or key not in found:
            continue
        offs = h.get("data_offsets")
        if offs != [start - base, end - base]:
            have = offs
            if isinstance(offs, list) and len(offs) == 2:
                have = f"{base + offs[0]}..{base + offs[1]}"
            problem(name, f"piece key '{key}' sits at bytes {have} in the file, the manifest says "
                          f"{start}..{end}")


def _verify_tier(tier: Any, step: int) -> tuple[Checked, list[Problem]]:
    """Check one tier's copy of ``step``: every data file's size and header, every piece's CRC-32."""
    checked = Checked(tier.name, step)
    problems: list[Problem] = []
    try:
        man = _read(tier, step)
    except ManifestError as e:
        problems.append(Problem(tier.name, step, tier.where(step, mf.MANIFEST), None, str(e)))
        checked.ok = False
        return checked, problems
    sizes = tier.file_sizes(step)
    by_file: dict[str, list[tuple[mf.StoredTensor, mf.StoredPiece]]] = {}
    for t in sorted(man.tensors.values(), key=lambda t: t.name):
        for p in t.pieces:
            by_file.setdefault(p.file, []).append((t, p))
    buf = memoryview(bytearray(_CHUNK))
    for f in man.files:
        name = f["name"]
        where = tier.where(step, name)
        entries = by_file.get(name, [])

        def problem(tensor: str | None, what: str, _where: str = where) -> None:
            problems.append(Problem(tier.name, step, _where, tensor, what))

        size = sizes.get(name)
        if size is None:
            problem(None, f"data file is missing (it holds {len(entries)} piece(s))")
            continue
        checked.files += 1
        want = f["size_bytes"]  # (parse checked it, and header_crc32 when there)
        if size != want:
            problem(None, f"file is {size} bytes, the manifest says {want}"
                          + (" (truncated)" if size < want else " (extra bytes)"))
        expect = {p.key: (t.name, t.dtype, list(p.box.lengths), p.start, p.start + p.nbytes)
                  for t, p in entries}
        try:
            reader = tier.open_file(step, name)
        except FileNotFoundError:
            problem(None, f"data file is missing (it holds {len(entries)} piece(s))")
            continue
        except UnsafeFileError as e:
            problem(None, f"refused: {e}")
            continue
        try:
            try:
                header, base = _parse_header(reader, size)
            except (ValueError, TruncatedRead) as e:
                problem(None, f"does not parse as safetensors: {e}")
            else:
                _compare_header(header, base, expect, problem)
            if "header_crc32" in f:
                head = min((p.start for _, p in entries), default=want)
                crc, _, got = _check_range(reader, 0, head, buf)
                checked.bytes += got
                if got == head and crc != f["header_crc32"]:
                    problem(None, f"header checksum mismatch (manifest crc32 0x{f['header_crc32']:08x}, "
                                  f"bytes 0..{head} give 0x{crc:08x})")
            for t, p in entries:
                at = f"piece at offsets {list(p.box.offsets)}"
                checked.pieces += 1
                crc, bad, got = _check_range(reader, p.start, p.nbytes, buf, None if p.blocks is None else p)
                checked.bytes += got
                if got < p.nbytes:
                    problem(t.name, f"{at}: bytes {p.start}..{p.start + p.nbytes} lie past the end of the "
                                    f"file ({size} bytes): truncated")
                elif p.blocks is not None:
                    if bad:
                        spans = ", ".join(f"{p.block_span(b)[0]}..{sum(p.block_span(b))}" for b in bad[:3])
                        problem(t.name, f"{at}: checksum mismatch in {len(bad)} of {len(p.blocks)} block(s) "
                                        f"(bytes {spans}{' …' if len(bad) > 3 else ''})")
                elif crc != p.crc32:
                    problem(t.name, f"{at}: checksum mismatch (manifest crc32 0x{p.crc32 or 0:08x}, "
                                    f"bytes {p.start}..{p.start + p.nbytes} give 0x{crc:08x})")
        finally:
            reader.close()
    if problems and tier.kind == "shm" and mf.MANIFEST not in tier.list_files(step):
        # A running job reused this step's shared-memory slot while we read it: not damage.
        checked.note = "step was removed from this tier while being verified; skipped"
        return checked, []
    checked.ok = not problems
    return checked, problems

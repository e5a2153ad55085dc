"""Re-reading a step copy in a directory tier: sizes, safetensors headers and every piece's CRC-32.

Used by ``tidal ckpt verify``. Reads every byte of every data file of the step in that tier.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.ckpt import manifest as mf
from tidal.ckpt.errors import ManifestError
from tidal.ckpt.tiers import DirTier

_CHUNK = 16 << 20  # bytes read at a time when checksumming


def _read(tier: Any, step: int) -> mf.Manifest:
    """``tier``'s manifest of ``step``, which must also say that it is ``step``."""
    m = tier.read_manifest(step)
    _check_step(tier, m, step)
    return m


def _check_step(tier: Any, m: mf.Manifest, step: int) -> None:
    if m.step != step:
        raise ManifestError(f"{tier.where(step, mf.MANIFEST)}: field 'step' is {m.step}, but the manifest "
                            f"lies in the directory of step {step} (moved or edited?)")


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


def _crc_range(fd: int, start: int, nbytes: int) -> tuple[int, int]:
    """CRC-32 of up to ``nbytes`` bytes at ``start``; also how many bytes the file had there."""
    crc, done = 0, 0
    while done < nbytes:
        chunk = os.pread(fd, min(_CHUNK, nbytes - done), start + done)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
    return crc, done


def _check_safetensors(path: Path, expect: dict[str, tuple[str, str, list[int], int, int]],
                       problem: Any) -> None:
    """Parse ``path`` with the safetensors library; compare its keys, dtypes, shapes and offsets.

    ``expect`` maps a piece key to (tensor name, dtype, shape, start, end) from the manifest.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            found = {}
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = f.get_slice(k)
                found[k] = (sl.get_dtype(), [int(x) for x in sl.get_shape()])
    except Exception as e:  # the library raises its own error types; any of them means "unreadable"
        problem(None, f"does not parse as safetensors: {' '.join(str(e).split())}")
        return
    for key, (name, dtype, shape, _, _) in expect.items():
        if key not in found:
            problem(name, f"piece key '{key}' is missing from the file")
        elif found[key] != (dtype, shape):
            problem(name, f"piece key '{key}' is stored as {found[key][0]} {found[key][1]}, "
                          f"the manifest says {dtype} {shape}")
    for key in sorted(set(found) - set(expect)):
        problem(None, f"holds tensor key '{key}' that the manifest does not list")
    # Where each piece sits: the header's data offsets are relative to the end of the header.
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    base = 8 + n
    for key, (name, _, _, start, end) in expect.items():
        h = header.get(key)
        if not isinstance(h, dict) or key not in found:
            continue
        offs = h.get("data_offsets")
        if offs != [start - base, end - base]:
            have = f"{base + offs[0]}..{base + offs[1]}" if isinstance(offs, list) and len(offs) == 2 else offs
            problem(name, f"piece key '{key}' sits at bytes {have} in the file, the manifest says {start}..{end}")


def _verify_tier(tier: DirTier, step: int) -> tuple[Checked, list[Problem]]:
    d = tier.step_dir(step)
    checked = Checked(tier.name, step)
    problems: list[Problem] = []
    try:
        man = _read(tier, step)
    except ManifestError as e:
        problems.append(Problem(tier.name, step, str(d / mf.MANIFEST), None, str(e)))
        checked.ok = False
        return checked, problems
    by_file: dict[str, list[tuple[mf.StoredTensor, mf.StoredPiece]]] = {}
    for t in sorted(man.tensors.values(), key=lambda t: t.name):
        for p in t.pieces:
            by_file.setdefault(p.file, []).append((t, p))
    for f in man.files:
        name = f["name"]
        path = d / name
        entries = by_file.get(name, [])

        def problem(tensor: str | None, what: str, _path: Path = path) -> None:
            problems.append(Problem(tier.name, step, str(_path), tensor, what))

        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problem(None, f"data file is missing (it holds {len(entries)} piece(s))")
            continue
        checked.files += 1
        want = f.get("size_bytes")
        if isinstance(want, int) and size != want:
            problem(None, f"file is {size} bytes, the manifest says {want}"
                          + (" (truncated)" if size < want else " (extra bytes)"))
        expect = {p.key: (t.name, t.dtype, list(p.box.lengths), p.start, p.start + p.nbytes) for t, p in entries}
        _check_safetensors(path, expect, problem)
        fd = os.open(path, os.O_RDONLY)
        try:
            for t, p in entries:
                crc, got = _crc_range(fd, p.start, p.nbytes)
                checked.pieces += 1
                checked.bytes += got
                where = f"piece at offsets {list(p.box.offsets)}"
                if got < p.nbytes:
                    problem(t.name, f"{where}: bytes {p.start}..{p.start + p.nbytes} lie past the end of the "
                                    f"file ({size} bytes): truncated")
                elif crc != p.crc32:
                    problem(t.name, f"{where}: checksum mismatch (manifest crc32 0x{p.crc32:08x}, "
                                    f"bytes {p.start}..{p.start + p.nbytes} give 0x{crc:08x})")
        finally:
            os.close(fd)
    if problems and not (d / mf.MANIFEST).exists():
        # A running job reused this step's shared-memory slot while we read it: not damage.
        checked.note = "step was removed from this tier while being verified; skipped"
        return checked, []
    checked.ok = not problems
    return checked, problems

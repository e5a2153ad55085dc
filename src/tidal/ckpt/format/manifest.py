"""The manifest: one JSON document per committed step that describes everything in it.

    <root>/step_000000000120/manifest.json          # written last, by rename: its presence = committed
    <root>/step_000000000120/r00000-<save_id>.safetensors
    <root>/step_000000000120/r00000-<save_id>.json  # per-rank sidecar (checksums), merged by rank 0

``manifest.json`` (version 2) lists the tensors with their pieces (box, file, absolute ``start`` byte,
``nbytes``, one CRC-32 per ``block_bytes`` block as base64 ``blocks``), the objects, the files (size,
``header_crc32``), ``checksum`` (the SHA-256 of its canonical JSON without that field) and, written with
a checkpoint key, ``mac`` (its HMAC-SHA256 without ``checksum`` and ``mac``). Version 1 (one ``crc32``
per piece, no ``checksum``) still loads. Every field is validated, with bounded JSON depth and integer
sizes; every problem is a one-line ``ManifestError`` naming the manifest and the field."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import sys
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.ckpt.errors import ManifestError, UnsafeFileError
from tidal.ckpt.format.layout import Box, check_tiling
from tidal.ckpt.format.plan import ITEMSIZE, EntryInfo, SavePlan
from tidal.contract import ENV_CKPT_KEY

FORMAT = "tidal-ckpt"
VERSION = 2
VERSIONS = (1, 2)  # what this code reads
MANIFEST = "manifest.json"
BLOCK_BYTES = 64 << 10  # checksum block of version-2 pieces (see docs/checkpoint.md for why 64 KiB)
MAX_DEPTH = 64  # JSON nesting a manifest may have (objects included)
MAX_INT = (1 << 63) - 1  # every integer in a manifest fits an int64
MAX_DIMS = 64


def path_name(path: Sequence[str | int]) -> str:
    """An entry's display name: its path joined by ``/``."""
    return "/".join([p if isinstance(p, str) else str(p) for p in path])


def step_dirname(step: int) -> str:
    return f"step_{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    if not name.startswith("step_") or len(name) != 17:
        return None
    digits = name[5:]
    return int(digits) if digits.isascii() and digits.isdigit() else None


@dataclass(frozen=True)
class StoredPiece:
    box: Box
    file: str
    key: str
    start: int
    nbytes: int
    crc32: int | None  # version 1: the CRC-32 of the whole piece
    blocks: array | None = None  # version 2: CRC-32 of each block of ``block_bytes``
    block_bytes: int = BLOCK_BYTES

    def block_span(self, index: int) -> tuple[int, int]:
        """Absolute ``(offset, length)`` of block ``index`` in the file."""
        lo = index * self.block_bytes
        return self.start + lo, min(self.block_bytes, self.nbytes - lo)


@dataclass(frozen=True)
class StoredTensor(EntryInfo):
    pieces: tuple[StoredPiece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Manifest:
    step: int
    save_id: str
    created_unix_s: float
    world_size: int
    tensors: dict[str, StoredTensor]
    objects: list[tuple[tuple, Any]]
    files: list[dict]
    raw: dict
    version: int = VERSION
    block_bytes: int = BLOCK_BYTES

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def layout_summary(self) -> str:
        kinds = Counter(t.layout for t in self.tensors.values())
        parts = [f"{n}× {k}" for k, n in kinds.most_common()]
        return f"world {self.world_size}: " + "; ".join(parts)


def block_crcs(data: memoryview | bytes, block_bytes: int = BLOCK_BYTES) -> str:
    """The ``blocks`` field of a piece: base64 of the little-endian CRC-32 of each block of ``data``."""
    mv = memoryview(data)
    crcs = array("I", (zlib.crc32(mv[i : i + block_bytes]) for i in range(0, len(mv), block_bytes)))
    if sys.byteorder != "little":
        crcs.byteswap()
    return base64.b64encode(crcs.tobytes()).decode()


def _canonical(doc: dict, without: tuple[str, ...]) -> bytes:
    body = {k: v for k, v in doc.items() if k not in without}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def canonical_checksum(doc: dict) -> str:
    """``sha256:<hex>`` of ``doc``'s canonical JSON without its ``checksum`` field."""
    return "sha256:" + hashlib.sha256(_canonical(doc, ("checksum",))).hexdigest()


MAC_PREFIX = "hmac-sha256:"
MIN_KEY_BYTES = 16


def checkpoint_key(key: bytes | str | bool | None = None) -> bytes | None:
    """The key manifests are signed and checked with: ``key`` (bytes, or hex digits), else
    ``$TIDAL_CKPT_KEY`` (hex digits), else None (checksums only; also ``key=False``: a checkpoint
    trusted as it is, e.g. another job's). ValueError naming the source when it is not hex or shorter
    than 16 bytes."""
    where = "key"
    if key is False:
        return None
    if key is None or key is True:
        key, where = os.environ.get(ENV_CKPT_KEY) or None, f"${ENV_CKPT_KEY}"
    if isinstance(key, str):
        try:
            key = bytes.fromhex(key.strip())
        except ValueError:
            raise ValueError(f"{where}: expected hex digits (a checkpoint key)") from None
    if key is not None and len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{where}: a checkpoint key has at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def mac_of(doc: dict, key: bytes) -> str:
    """``hmac-sha256:<hex>`` of ``doc``'s canonical JSON without its ``checksum`` and ``mac`` fields."""
    return MAC_PREFIX + hmac.new(key, _canonical(doc, ("checksum", "mac")), hashlib.sha256).hexdigest()


def check_mac(doc: dict, key: bytes | None, where: str) -> None:
    """ManifestError unless ``doc`` carries the MAC of ``key`` (nothing to check without a key)."""
    if key is None:
        return
    got = doc.get("mac")
    if not isinstance(got, str):
        raise ManifestError(f"{where}: no field 'mac', but a checkpoint key is set: not written with this "
                            "key (by another user, or without a key); refused")
    if not hmac.compare_digest(got.encode(), mac_of(doc, key).encode()):
        raise ManifestError(f"{where}: field 'mac' does not match the checkpoint key (written with another "
                            "key, or edited); refused")


def build(plan: SavePlan, step: int, save_id: str, created_unix_s: float,
          crcs: dict[str, str], objects: list[tuple[tuple, Any]], file_names: list[str],
          header_crcs: dict[int, int] | None = None, key: bytes | None = None) -> dict:
    """The manifest document. ``crcs``: ``"<rank>/<key>"`` -> that piece's ``blocks`` (``block_crcs``);
    ``header_crcs``: rank -> the CRC-32 of its file's header; ``key``: sign it (:func:`mac_of`)."""
    tensors = []
    for name, info in plan.entries.items():
        pieces = []
        for p in sorted(plan.pieces_of(name), key=lambda p: p.box.offsets):
            pieces.append({
                "offsets": list(p.box.offsets), "lengths": list(p.box.lengths),
                "file": file_names[p.rank], "key": p.key, "start": p.start, "nbytes": p.nbytes,
                "blocks": crcs[f"{p.rank}/{p.key}"],
            })
        tensors.append({"name": name, "path": list(info.path), "dtype": info.dtype, "shape": list(info.shape),
                        "layout": info.layout, "pieces": pieces})
    files = []
    for f in plan.files:
        entry = {"name": file_names[f.rank], "rank": f.rank, "size_bytes": f.size_bytes}
        if header_crcs is not None and f.rank in header_crcs:
            entry["header_crc32"] = int(header_crcs[f.rank])
        files.append(entry)
    doc = {
        "format": FORMAT, "version": VERSION, "step": step, "save_id": save_id,
        "created_unix_s": created_unix_s, "world_size": plan.world_size, "block_bytes": BLOCK_BYTES,
        "tensors": tensors, "objects": [{"path": list(p), "value": v} for p, v in objects], "files": files,
    }
    doc = json.loads(json.dumps(doc))  # exactly what a reader will see (tuples -> lists, int keys -> str)
    if key is not None:
        doc["mac"] = mac_of(doc, key)
    doc["checksum"] = canonical_checksum(doc)
    return doc


def verified_doc(data: bytes, where: str) -> dict:
    """The manifest's JSON object once its form (depth, integer sizes), format, version and (version
    2) checksum are checked; nothing in it may be used before. Raises ``ManifestError``."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ManifestError(f"{where}: JSON nested too deeply (more than {MAX_DEPTH} levels)") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{where}: not valid JSON (not UTF-8; truncated or damaged?)") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: not valid JSON (truncated or edited?): {e}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ManifestError(f"{where}: not valid JSON: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object at top level")
    _check_form(doc, where)
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{where}: field 'format' is {_short(doc.get('format'))}, expected {FORMAT!r}")
    version = doc.get("version")
    if version not in VERSIONS or isinstance(version, bool):
        raise ManifestError(f"{where}: field 'version' is {_short(version)}, expected one of "
                            f"{list(VERSIONS)} (written by a newer Tidal?)")
    if version >= 2:
        got = doc.get("checksum")
        if not isinstance(got, str):
            raise ManifestError(f"{where}: field 'checksum' is missing or not a string (version {version} "
                                "manifests carry one)")
        want = canonical_checksum(doc)
        if got != want:
            raise ManifestError(f"{where}: field 'checksum' does not match the manifest's content "
                                f"(damaged or edited): it says {_short(got, 80)}, the content gives {want}")
    return doc


def clip(s: str, limit: int = 60) -> str:
    """``s``, cut to ``limit`` characters (the last one "…") when longer."""
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _short(v: Any, limit: int = 60) -> str:
    return clip(repr(v), limit)


def _key(k: Any) -> str:
    """A JSON key for an error message: printable, short (a crafted key must not break the one line)."""
    s = str(k)
    return clip(s if s.isprintable() else s.encode("unicode_escape").decode("ascii"))


def _check_form(doc: Any, where: str) -> None:
    """Bounded nesting and integer sizes, checked without recursion."""
    stack: list[tuple[Any, int, str]] = [(doc, 1, "")]
    while stack:
        v, depth, at = stack.pop()
        if isinstance(v, (dict, list)) and depth > MAX_DEPTH:
            raise ManifestError(f"{where}: JSON nested too deeply at {at or 'top'} "
                                f"(limit {MAX_DEPTH} levels)")
        if isinstance(v, dict):
            stack.extend((x, depth + 1, f"{at}.{_key(k)}" if at else _key(k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, depth + 1, f"{at}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, int) and not isinstance(v, bool) and not -MAX_INT - 1 <= v <= MAX_INT:
            raise ManifestError(f"{where}: field '{at}' is an integer of {len(str(abs(v)))} digits, "
                                "more than an int64 holds")


def parse(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names it in errors (e.g. the file path)."""
    doc = verified_doc(data, where)
    version = doc["version"]
    step = _int(doc, "step", where)
    world = _int(doc, "world_size", where)
    block = BLOCK_BYTES
    if version >= 2:
        block = _int(doc, "block_bytes", where)
        if not 1 <= block <= 1 << 30:
            raise ManifestError(f"{where}: field 'block_bytes' is {block}, expected 1..{1 << 30}")
    files = doc.get("files")
    if not isinstance(files, list):
        raise ManifestError(f"{where}: field 'files' must be a list")
    file_sizes: dict[str, int] = {}
    for i, f in enumerate(files):
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ManifestError(f"{where}: files[{i}] must be an object with a string 'name'")
        _check_file_name(f["name"], f"{where}: files[{i}].name")
        if f["name"] in file_sizes:
            raise ManifestError(f"{where}: files[{i}].name {_short(f['name'])} is listed twice")
        file_sizes[f["name"]] = _int(f, "size_bytes", f"{where}: files[{i}]")
        if "header_crc32" in f:
            _int(f, "header_crc32", f"{where}: files[{i}]")
    tensors: dict[str, StoredTensor] = {}
    raw_tensors = doc.get("tensors")
    if not isinstance(raw_tensors, list):
        raise ManifestError(f"{where}: field 'tensors' must be a list")
    for i, t in enumerate(raw_tensors):
        tw = f"{where}: tensors[{i}]"
        if not isinstance(t, dict):
            raise ManifestError(f"{tw} must be an object")
        name = t.get("name")
        if not isinstance(name, str):
            raise ManifestError(f"{tw}.name must be a string")
        if name in tensors:
            raise ManifestError(f"{tw}.name {_short(name)} appears twice")
        tw = f"{where}: tensor {_short(name)}"
        dtype = t.get("dtype")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise ManifestError(f"{tw}: dtype {_short(dtype)} is not a known safetensors dtype")
        shape = _int_list(t, "shape", tw)
        if len(shape) > MAX_DIMS:
            raise ManifestError(f"{tw}: field 'shape' has {len(shape)} dimensions (at most {MAX_DIMS})")
        numel = math.prod(shape)
        if numel * ITEMSIZE[dtype] > MAX_INT:
            raise ManifestError(f"{tw}: field 'shape' {_short(shape)} is {numel} elements, more bytes than "
                                "any file holds")
        path = t.get("path")
        if not isinstance(path, list) or not all(isinstance(p, (str, int)) for p in path):
            raise ManifestError(f"{tw}: 'path' must be a list of strings/ints")
        pieces = []
        raw_pieces = t.get("pieces")
        if not isinstance(raw_pieces, list):
            raise ManifestError(f"{tw}: 'pieces' must be a list")
        for j, p in enumerate(raw_pieces):
            pw = f"{tw} piece {j}"
            if not isinstance(p, dict):
                raise ManifestError(f"{pw} must be an object")
            offs, lens = _int_list(p, "offsets", pw), _int_list(p, "lengths", pw)
            if len(offs) != len(shape) or len(lens) != len(shape):
                raise ManifestError(f"{pw}: offsets/lengths must have {len(shape)} dims like shape {shape}")
            box = Box(tuple(offs), tuple(lens))
            if not box.within(shape):
                raise ManifestError(f"{pw}: box {offs}+{lens} lies outside shape {shape}")
            nbytes, start = _int(p, "nbytes", pw), _int(p, "start", pw)
            if nbytes != box.numel * ITEMSIZE[dtype]:
                raise ManifestError(f"{pw}: nbytes {nbytes} != {box.numel} elements × {ITEMSIZE[dtype]} "
                                    "bytes")
            file = p.get("file")
            if not isinstance(file, str) or file not in file_sizes:
                raise ManifestError(f"{pw}: file {_short(file)} is not listed in 'files'")
            if start < 8 or start + nbytes > file_sizes[file]:
                raise ManifestError(f"{pw}: bytes {start}..{start + nbytes} do not lie in the data of {file} "
                                    f"({file_sizes[file]} bytes per 'files')")
            key = p.get("key")
            if not isinstance(key, str):
                raise ManifestError(f"{pw}: 'key' must be a string")
            if version >= 2:
                blocks = _blocks(p, nbytes, block, pw)
                pieces.append(StoredPiece(box, file, key, start, nbytes, None, blocks, block))
            else:
                pieces.append(StoredPiece(box, file, key, start, nbytes, _int(p, "crc32", pw)))
        problem = check_tiling(shape, [p.box for p in pieces if p.box.numel > 0 or numel == 0])
        if problem and numel > 0:
            raise ManifestError(f"{tw}: stored pieces do not tile the tensor: {problem}")
        tensors[name] = StoredTensor(name, tuple(path), dtype, tuple(shape), str(t.get("layout", "")),
                                     tuple(pieces))
    objects = []
    raw_objects = doc.get("objects", [])
    if not isinstance(raw_objects, list):
        raise ManifestError(f"{where}: field 'objects' must be a list")
    for i, o in enumerate(raw_objects):
        if not isinstance(o, dict) or not isinstance(o.get("path"), list) or "value" not in o:
            raise ManifestError(f"{where}: objects[{i}] must be an object with 'path' and 'value'")
        if not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in o["path"]):
            raise ManifestError(f"{where}: objects[{i}].path must be a list of strings/ints")
        objects.append((tuple(o["path"]), o["value"]))
    created = doc.get("created_unix_s", 0.0)
    created = float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else 0.0
    return Manifest(step, str(doc.get("save_id", "")), created, world, tensors, objects, files, doc,
                    version=version, block_bytes=block)


def _blocks(p: dict, nbytes: int, block: int, where: str) -> array:
    v = p.get("blocks")
    if not isinstance(v, str):
        raise ManifestError(f"{where}: field 'blocks' must be a base64 string")
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ManifestError(f"{where}: field 'blocks' is not valid base64") from None
    want = -(-nbytes // block)
    if len(raw) != 4 * want:
        raise ManifestError(f"{where}: field 'blocks' holds {len(raw) / 4:g} checksums, "
                            f"{nbytes} bytes in blocks of {block} need {want}")
    out = array("I")
    out.frombytes(raw)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def read(step_dir: Path) -> Manifest:
    """The checked manifest of a step directory (of step ``step_<12 digits>`` when it is so named)."""
    path = step_dir / MANIFEST
    return read_object(path.read_bytes, str(path), parse_step_dirname(step_dir.name))


def read_object(read_bytes: Callable[[], bytes], where: str, step: int | None) -> Manifest:
    """The checked manifest of ``step`` from ``read_bytes()`` (its bytes; FileNotFoundError when missing,
    UnsafeFileError when refused)."""
    try:
        data = read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{where}: missing (step not committed)") from None
    except UnsafeFileError as e:
        raise ManifestError(str(e)) from None
    man = parse(data, where)
    if step is not None and man.step != step:
        raise ManifestError(f"{where}: field 'step' is {man.step} but it lies under step {step} "
                            "(edited or copied by hand?)")
    return man


def _int(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > MAX_INT:
        raise ManifestError(f"{where}: field '{key}' must be a non-negative integer, got {_short(v)}")
    return v


def _int_list(d: dict, key: str, where: str) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_INT
                                          for x in v):
        raise ManifestError(f"{where}: field '{key}' must be a list of non-negative integers, got "
                            f"{_short(v)}")
    return v


def _check_file_name(name: str, where: str) -> None:
    if "/" in name or "\\" in name or name in ("", ".", "..") or name.startswith("."):
        raise ManifestError(f"{where}: {name!r} is not a plain file name inside the step directory")


def bad_blocks(mv: memoryview, ranges: Sequence[tuple[int, int]], piece: StoredPiece) -> list[int]:
    """The blocks of ``piece`` in ``mv`` (its block-aligned ``ranges``, back to back) whose CRC-32 differs."""
    assert piece.blocks is not None
    block, pos, bad = piece.block_bytes, 0, []
    for off, n in ranges:
        first = (off - piece.start) // block
        for k in range(-(-n // block)):
            m = min(block, n - k * block)
            if zlib.crc32(mv[pos + k * block : pos + k * block + m]) != piece.blocks[first + k]:
                bad.append(first + k)
        pos += n
    return bad

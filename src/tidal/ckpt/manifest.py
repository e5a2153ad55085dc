"""The manifest: one JSON document per committed step that describes everything in it.

Layout of a checkpoint location (any tier)::

    <root>/step_000000000120/manifest.json          # written last, by rename: its presence = committed
    <root>/step_000000000120/r00000-<save_id>.safetensors
    <root>/step_000000000120/r00000-<save_id>.json  # per-rank sidecar (checksums), merged by rank 0

``manifest.json`` (version 1)::

    {"format": "tidal-ckpt", "version": 1, "step": 120, "save_id": "…", "created_unix_s": …,
     "world_size": 4,
     "tensors": [{"name": "model/w", "path": ["model", "w"], "dtype": "F32", "shape": [8, 4],
                  "layout": "[Shard(dim=0)] on mesh (4,)",
                  "pieces": [{"offsets": [0, 0], "lengths": [2, 4], "file": "r00000-….safetensors",
                              "key": "model/w@0:2,0:4", "start": 128, "nbytes": 32, "crc32": 123}]}],
     "objects": [{"path": ["step"], "value": 120}],
     "files": [{"name": "r00000-….safetensors", "rank": 0, "size_bytes": 4096}]}

``start`` is the absolute byte offset of the piece in its file, so a reader seeks straight to it.
Parsing validates every field and names the manifest and the field when something is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.ckpt.errors import ManifestError
from tidal.ckpt.layout import Box, check_tiling
from tidal.ckpt.plan import ITEMSIZE, SavePlan

FORMAT = "tidal-ckpt"
VERSION = 1
MANIFEST = "manifest.json"


def step_dirname(step: int) -> str:
    return f"step_{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    if not name.startswith("step_") or len(name) != 17:
        return None
    digits = name[5:]
    return int(digits) if digits.isdigit() else None


@dataclass(frozen=True)
class StoredPiece:
    box: Box
    file: str
    key: str
    start: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class StoredTensor:
    name: str
    path: tuple
    dtype: str
    shape: tuple[int, ...]
    layout: str
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

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def layout_summary(self) -> str:
        kinds: dict[str, int] = {}
        for t in self.tensors.values():
            kinds[t.layout] = kinds.get(t.layout, 0) + 1
        parts = [f"{n}× {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])]
        return f"world {self.world_size}: " + "; ".join(parts)


def build(plan: SavePlan, step: int, save_id: str, created_unix_s: float,
          crcs: dict[str, int], objects: list[tuple[tuple, Any]], file_names: list[str]) -> dict:
    """Assemble the manifest document from the plan, the ranks' checksums and rank 0's objects.

    ``crcs`` maps ``"<rank>/<key>"`` to the CRC-32 of that piece's bytes.
    """
    tensors = []
    for name, info in plan.entries.items():
        pieces = []
        for p in sorted(plan.pieces_of(name), key=lambda p: p.box.offsets):
            pieces.append({
                "offsets": list(p.box.offsets), "lengths": list(p.box.lengths),
                "file": file_names[p.rank], "key": p.key, "start": p.start, "nbytes": p.nbytes,
                "crc32": crcs[f"{p.rank}/{p.key}"],
            })
        tensors.append({"name": name, "path": list(info.path), "dtype": info.dtype, "shape": list(info.shape),
                        "layout": info.layout, "pieces": pieces})
    return {
        "format": FORMAT, "version": VERSION, "step": step, "save_id": save_id,
        "created_unix_s": created_unix_s, "world_size": plan.world_size, "tensors": tensors,
        "objects": [{"path": list(p), "value": v} for p, v in objects],
        "files": [{"name": file_names[f.rank], "rank": f.rank, "size_bytes": f.size_bytes} for f in plan.files],
    }


def parse(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names it in errors (e.g. the file path)."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where}: not valid JSON (truncated or edited?): {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object at top level")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{where}: field 'format' is {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise ManifestError(f"{where}: field 'version' is {doc.get('version')!r}, expected {VERSION}")
    step = _int(doc, "step", where)
    world = _int(doc, "world_size", where)
    files = doc.get("files")
    if not isinstance(files, list):
        raise ManifestError(f"{where}: field 'files' must be a list")
    file_names = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ManifestError(f"{where}: files[{i}] must be an object with a string 'name'")
        _check_file_name(f["name"], f"{where}: files[{i}].name")
        file_names.add(f["name"])
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
        tw = f"{where}: tensor '{name}'"
        dtype = t.get("dtype")
        if dtype not in ITEMSIZE:
            raise ManifestError(f"{tw}: dtype {dtype!r} is not a known safetensors dtype")
        shape = _int_list(t, "shape", tw)
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
            nbytes, start, crc = _int(p, "nbytes", pw), _int(p, "start", pw), _int(p, "crc32", pw)
            if nbytes != box.numel * ITEMSIZE[dtype]:
                raise ManifestError(f"{pw}: nbytes {nbytes} != {box.numel} elements × {ITEMSIZE[dtype]} bytes")
            file = p.get("file")
            if file not in file_names:
                raise ManifestError(f"{pw}: file {file!r} is not listed in 'files'")
            key = p.get("key")
            if not isinstance(key, str):
                raise ManifestError(f"{pw}: 'key' must be a string")
            pieces.append(StoredPiece(box, file, key, start, nbytes, crc))
        problem = check_tiling(shape, [p.box for p in pieces if p.box.numel > 0 or math.prod(shape) == 0])
        if problem and math.prod(shape) > 0:
            raise ManifestError(f"{tw}: stored pieces do not tile the tensor: {problem}")
        tensors[name] = StoredTensor(name, tuple(path), dtype, tuple(shape), str(t.get("layout", "")), tuple(pieces))
    objects = []
    raw_objects = doc.get("objects", [])
    if not isinstance(raw_objects, list):
        raise ManifestError(f"{where}: field 'objects' must be a list")
    for i, o in enumerate(raw_objects):
        if not isinstance(o, dict) or not isinstance(o.get("path"), list) or "value" not in o:
            raise ManifestError(f"{where}: objects[{i}] must be an object with 'path' and 'value'")
        objects.append((tuple(o["path"]), o["value"]))
    created = doc.get("created_unix_s", 0.0)
    return Manifest(step, str(doc.get("save_id", "")), float(created) if isinstance(created, (int, float)) else 0.0,
                    world, tensors, objects, files, doc)


def read(step_dir: Path) -> Manifest:
    path = step_dir / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (step not committed)") from None
    man = parse(data, str(path))
    expected = parse_step_dirname(step_dir.name)
    if expected is not None and man.step != expected:
        raise ManifestError(f"{path}: field 'step' is {man.step} but the directory is step {expected} "
                            "(edited or copied by hand?)")
    return man


def read_object(read_bytes: Callable[[], bytes], where: str, step: int) -> Manifest:
    """Read and check the manifest of ``step`` from an object-store-like tier (S3, peer agents):
    ``read_bytes()`` returns its bytes or raises FileNotFoundError; ``where`` names it in errors."""
    try:
        data = read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{where}: missing (step not committed)") from None
    man = parse(data, where)
    if man.step != step:
        raise ManifestError(f"{where}: field 'step' is {man.step} but the object lies under step {step} "
                            "(edited or copied by hand?)")
    return man


def _int(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ManifestError(f"{where}: field '{key}' must be a non-negative integer, got {v!r}")
    return v


def _int_list(d: dict, key: str, where: str) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ManifestError(f"{where}: field '{key}' must be a list of non-negative integers, got {v!r}")
    return v


def _check_file_name(name: str, where: str) -> None:
    if "/" in name or "\\" in name or name in ("", ".", "..") or name.startswith("."):
        raise ManifestError(f"{where}: {name!r} is not a plain file name inside the step directory")

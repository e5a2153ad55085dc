"""A nested training state (dicts, lists; leaves ``torch.Tensor``, ``DTensor``, :class:`LocalShard` or
JSON-able values) as flat entries addressed by *path*, each tensor described as a box."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tidal.ckpt.errors import StateError
from tidal.ckpt.format.layout import Box
from tidal.ckpt.format.manifest import path_name

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

PathKey = str | int
Path = tuple[PathKey, ...]

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}  # fmt: skip
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}


@dataclass
class LocalShard:
    """A piece of a larger tensor that this rank holds, for sharding not expressed as a ``DTensor``:
    ``tensor`` sits at ``offsets`` inside a global tensor of ``global_shape``; load fills it in place."""

    tensor: torch.Tensor
    offsets: Sequence[int]
    global_shape: Sequence[int]


@dataclass
class TensorEntry:
    path: Path
    local: torch.Tensor  # the tensor this rank holds (filled in place on load)
    global_shape: tuple[int, ...]
    box: Box
    dtype: str  # safetensors dtype name
    placement: str  # human description of the saved layout, e.g. "Shard(0) on mesh (4,)"
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            self.name = path_name(self.path)


@dataclass
class ObjectEntry:
    path: Path
    value: Any

    @property
    def name(self) -> str:
        return path_name(self.path)


# (global shape, mesh id, placements) -> (mesh, local shape, offsets): the box depends only on these
# and on this process's rank, and computing it is a noticeable share of a save's fixed cost.
_BOX_CACHE: dict[tuple, tuple] = {}


@functools.cache  # resolved once: an import statement per tensor costs ~2 us
def _dtensor_type() -> type[DTensor] | None:
    try:
        import torch.distributed.tensor as dt
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return dt.DTensor


def describe_tensor(path: Path, value: Any) -> TensorEntry:
    """Describe one tensor leaf (plain, DTensor or LocalShard) as an entry with its box."""
    name = path_name(path)
    DTensor = _dtensor_type()
    if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):  # the common case, first
        gshape = tuple(value.shape)
        return TensorEntry(path, value, gshape, Box.whole(gshape), _st_dtype(name, value), "replicated", name)
    if DTensor is not None and isinstance(value, DTensor):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _check_placements(name, value.placements, Shard, Replicate)
        gshape = tuple(int(s) for s in value.shape)
        key = (gshape, id(value.device_mesh), tuple(value.placements))
        cached = _BOX_CACHE.get(key)
        if cached is None or cached[0] is not value.device_mesh:
            lshape, offs = compute_local_shape_and_global_offset(gshape, value.device_mesh, value.placements)
            cached = _BOX_CACHE[key] = (value.device_mesh, tuple(lshape), tuple(offs))
        _, lshape, offs = cached
        local = value.to_local()
        if tuple(local.shape) != tuple(lshape):
            raise StateError(f"tensor '{name}': local shape {tuple(local.shape)} != expected {tuple(lshape)}")
        mesh = tuple(int(s) for s in value.device_mesh.shape)
        desc = f"{list(value.placements)} on mesh {mesh}"
        return TensorEntry(path, local, gshape, Box(tuple(offs), tuple(lshape)), _st_dtype(name, local), desc,
                           name)
    if isinstance(value, LocalShard):
        local = value.tensor
        gshape = tuple(int(s) for s in value.global_shape)
        box = Box(tuple(int(o) for o in value.offsets), tuple(int(s) for s in local.shape))
        if not box.within(gshape):
            raise StateError(f"tensor '{name}': local shard at offsets {box.offsets} with shape "
                             f"{box.lengths} does not fit global shape {gshape}")
        return TensorEntry(path, local, gshape, box, _st_dtype(name, local), "LocalShard", name)
    if isinstance(value, torch.Tensor):
        gshape = tuple(int(s) for s in value.shape)
        return TensorEntry(path, value, gshape, Box.whole(gshape), _st_dtype(name, value), "replicated", name)
    raise TypeError(value)


def _check_placements(name: str, placements: Sequence[Any], shard: type[Shard],
                      replicate: type[Replicate]) -> None:
    """Accept placements whose local piece is one box of the global tensor.

    ``_StridedShard(d)`` (what FSDP2 puts on top of tensor parallelism on the same dim) is a box only
    when a later mesh dimension also shards tensor dim ``d``; then torch's own offset computation
    yields one contiguous block per rank.
    """
    strided: type[_StridedShard] | None = None
    try:
        from torch.distributed.tensor.placement_types import _StridedShard as found
    except ImportError:  # pragma: no cover - older torch
        pass
    else:
        strided = found
    for i, p in enumerate(placements):
        if strided is not None and isinstance(p, strided):
            later = [q for q in placements[i + 1 :] if isinstance(q, shard) and q.dim == p.dim]
            if not later:
                raise StateError(f"tensor '{name}': placement {p!r} without a later Shard({p.dim}) does not "
                                 "give each rank one contiguous block; expected FSDP2-over-TP style sharding")
            continue
        if not isinstance(p, (shard, replicate)):
            raise StateError(f"tensor '{name}': placement {p!r} is not supported; expected Shard(d) or "
                             "Replicate() (reduce Partial placements before saving)")


def _st_dtype(name: str, t: torch.Tensor) -> str:
    try:
        return DTYPE_TO_ST[t.dtype]
    except KeyError:
        raise StateError(f"tensor '{name}': dtype {t.dtype} cannot be stored (supported: "
                         f"{', '.join(str(d) for d in DTYPE_TO_ST)})") from None


def flatten(state: Any) -> tuple[list[TensorEntry], list[ObjectEntry]]:
    """Walk ``state``; return its tensor entries and its JSON-able leaves, in a stable order.

    Containers that hold no tensor are kept whole as one object entry (e.g. ``param_groups``).
    One pass, linear in the size of the state: this runs inside every ``save``.
    """
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    _walk((), state, tensors, objects)
    for o in objects:
        _check_json(o)
    return tensors, objects


def _walk(path: Path, v: Any, tensors: list[TensorEntry], objects: list[ObjectEntry]) -> None:
    if isinstance(v, (torch.Tensor, LocalShard)):
        tensors.append(describe_tensor(path, v))
        return
    if isinstance(v, (dict, list, tuple)):
        # Walk the children into the caller's lists; a container (not the root) that holds no tensor
        # is rolled back and kept whole as one object entry.
        n_tensors, n_objects = len(tensors), len(objects)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                if path == () or _has_tensor(v):
                    raise StateError(f"key {k!r} under '{path_name(path)}': keys must be str or int")
                break  # a tensor-free container: JSON decides below
            _walk((*path, k), x, tensors, objects)
        if len(tensors) > n_tensors:
            if isinstance(v, tuple):
                del tensors[n_tensors:]
                raise StateError(f"entry '{path_name(path)}' is a tuple holding tensors; use a list or a "
                                 "dict so it can be filled in place on load")
            return
        del objects[n_objects:]
        if path == () and isinstance(v, dict):  # the root (flatten: always a dict)
            objects.extend(ObjectEntry((k,), x) for k, x in v.items())
            return
    objects.append(ObjectEntry(path, v))  # JSON-checked once, by flatten


def _check_json(o: ObjectEntry) -> None:
    try:
        json.dumps(o.value, allow_nan=True)
    except (TypeError, ValueError) as e:
        bad_path, bad = _find_unjsonable(o.path, o.value)
        raise StateError(f"entry '{path_name(bad_path)}': value of type {type(bad).__name__} is neither a "
                         f"tensor nor JSON-able ({e})") from None


def _find_unjsonable(path: Path, v: Any) -> tuple[Path, Any]:
    """The first leaf below ``v`` that JSON cannot encode (so the error can name it)."""
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else ()
    for k, x in items:
        if isinstance(v, dict) and not isinstance(k, (str, int, float, bool)) and k is not None:
            return (*path, str(k)), k
        try:
            json.dumps(x, allow_nan=True)
        except (TypeError, ValueError):
            return _find_unjsonable((*path, k if isinstance(k, (str, int)) else str(k)), x)
    return path, v


def _has_tensor(v: Any) -> bool:
    """Whether a container holds a tensor anywhere below it (stops at the first one)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, (torch.Tensor, LocalShard)):
            return True
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return False


def set_path(state: Any, path: Path, value: Any) -> None:
    """Replace the leaf at ``path`` in ``state`` (used to restore non-tensor values)."""
    cur = state
    for k in path[:-1]:
        cur = cur[k]
    if isinstance(cur, tuple):
        raise StateError(f"entry '{path_name(path)}' sits inside a tuple and cannot be replaced in place")
    cur[path[-1]] = value

"""The few collectives the engine needs, with tensors and JSON (no pickle). Every rank calls them in the
same order, from the thread that drives training (never from the background pipeline)."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def world(group: Any) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised (never imported:
    then neither is torch here, so that reading a checkpoint in one process loads no torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: Any) -> torch.device:
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allgather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), indexed by rank in ``group``."""
    _, n = world(group)
    if n == 1:
        return [json.loads(json.dumps(obj))]
    import torch
    import torch.distributed as dist

    dev = _device(group)
    data = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    cap = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(cap, dtype=torch.uint8, device=dev)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    out = [torch.zeros(cap, dtype=torch.uint8, device=dev) for _ in range(n)]
    dist.all_gather(out, buf, group=group)
    return [json.loads(bytes(o[: int(s.item())].cpu().numpy())) for o, s in zip(out, sizes, strict=True)]


def all_min(value: int, group: Any = None) -> int:
    """The minimum of ``value`` over the ranks."""
    _, n = world(group)
    if n == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())

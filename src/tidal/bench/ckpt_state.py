"""The state every checkpoint benchmark saves, and helpers to walk it; torch and the standard library only
(the adapters that time other engines import it in virtual environments of their own)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from tidal import ckpt

GB = 10**9
RANKS = 3  # simulated ranks of the resharded load
ROW_SPLIT = (1, 2, 3)  # uneven row blocks: 1/6, 2/6 and 3/6 of the rows


def build_state(size_bytes: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict, dict]:
    """A stack of ``nn.Linear`` + Adam whose fp32 params, exp_avg and exp_avg_sq total ~``size_bytes``:
    ``(model, optimizer, state, shape)``, ``state = ckpt.training_state(model, optimizer)``."""
    params = max(1, size_bytes // 12)  # 4 bytes x (param + exp_avg + exp_avg_sq)
    width = 1024 if params >= 8 * (1024 * 1024 + 1024) else max(4, int(math.sqrt(params / 8)))
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = ckpt.training_state(model, opt)
    return model, opt, state, {"layers": layers, "width": width}


def tensors(v: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, in a fixed order."""
    return (x for x in tree_leaves(v) if isinstance(x, torch.Tensor))


def map_tensors(v: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The same nesting with every tensor replaced by ``fn(tensor)``."""
    return tree_map_only(torch.Tensor, fn, v)


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def zero(state: dict) -> None:
    with torch.no_grad():
        for t in tensors(state):
            t.zero_()


def check_equal(target: dict, state: dict, what: str) -> None:
    """Raise unless every tensor of ``target`` equals the one at the same place in ``state``."""
    for a, b in zip(tensors(target), tensors(state), strict=True):
        if not torch.equal(a, b):
            raise RuntimeError(f"{what}: loaded tensors differ from the saved state")


def row_blocks(rows: int) -> list[tuple[int, int]]:
    """(start, length) of the uneven row blocks of each simulated rank."""
    total = sum(ROW_SPLIT)
    bounds = [0]
    for w in ROW_SPLIT[:-1]:
        bounds.append(bounds[-1] + rows * w // total)
    bounds.append(rows)
    return [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cpu": cpu,
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}

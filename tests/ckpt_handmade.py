"""Checkpoints written by hand as two ranks would write them, for the checkpoint tests (one place).

The engine's own planner and manifest builder lay the step out; the bytes are written exactly as
planned, so a test can damage any of them precisely.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import torch

from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.flatten import DTYPE_TO_ST
from tidal.ckpt.format.layout import Box
from tidal.ckpt.format.plan import PieceDesc, make_plan
from tidal.ckpt.tiers.directory import data_name


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_two_rank_checkpoint(url: Path, step: int, full: dict[str, torch.Tensor], cut: dict[str, int],
                              objects: list | None = None) -> None:
    """Step ``step`` of ``full`` under ``url``: tensors in ``cut`` row-split at that row over two ranks,
    the rest replicated; ``objects`` (``[(path, value), ...]``, default the step) as JSON values."""
    per_rank: list[list[PieceDesc]] = [[], []]
    for name, t in full.items():
        shape = tuple(t.shape)
        if name in cut:
            c, rest = cut[name], shape[1:]
            zeros = (0,) * len(rest)
            boxes = [Box((0, *zeros), (c, *rest)), Box((c, *zeros), (shape[0] - c, *rest))]
            layout = "[Shard(dim=0)] on mesh (2,)"
        else:
            boxes = [Box.whole(shape)] * 2
            layout = "[Replicate()] on mesh (2,)"
        for r in range(2):
            per_rank[r].append(PieceDesc(name, (name,), DTYPE_TO_ST[t.dtype], shape, boxes[r], layout))
    plan = make_plan(per_rank)
    save_id = f"handmade{step:04d}"
    names = [data_name(r, save_id) for r in range(2)]
    d = url / mf.step_dirname(step)
    d.mkdir(parents=True)
    crcs, headers = {}, {}
    for rf in plan.files:
        buf = bytearray(rf.size_bytes)
        buf[: len(rf.header)] = rf.header
        for p in rf.pieces:
            sl = tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))
            data = tensor_bytes(full[p.name][sl])
            buf[p.start : p.start + p.nbytes] = data
            crcs[f"{rf.rank}/{p.key}"] = mf.block_crcs(data)
        headers[rf.rank] = zlib.crc32(rf.header)
        (d / names[rf.rank]).write_bytes(bytes(buf))
    doc = mf.build(plan, step, save_id, time.time(), crcs, objects or [(("step",), step)], names, headers)
    (d / mf.MANIFEST).write_text(json.dumps(doc, separators=(",", ":")))

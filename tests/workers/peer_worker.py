"""A gloo job that saves row shards through node memory and the peer tier (tests/test_peer.py).

    python peer_worker.py AGENT JOB   (every rank; torchrun environment from dist_harness)

Rank r holds rows [r * 40 / world, (r + 1) * 40 / world) of ``w`` (40 x 12, value = index + step) and
a replicated ``rep``; steps 1 and 2 are saved and waited for; prints ``committed STEP TIERS``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tidal import ckpt

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
agent, job = sys.argv[1], sys.argv[2]
rows, part = 40, 40 // world
with ckpt.Checkpointer(tiers=["shm", {"kind": "peer", "agent": agent, "job": job}]) as cp:
    for step in (1, 2):
        full = torch.arange(rows * 12, dtype=torch.float32).reshape(rows, 12) + step
        st = {
            "w": ckpt.LocalShard(full[rank * part : (rank + 1) * part].clone(), (rank * part, 0), (rows, 12)),
            "rep": torch.full((5,), float(step)),
            "step": step,
        }
        h = cp.save(step, st)
        h.wait()
        print("committed", step, "+".join(h.committed), flush=True)
dist.destroy_process_group()

"""One rank of a job that saves checkpoints back to back, to be killed with SIGKILL mid-save.

    python tests/workers/kill_worker.py --dir D [--mib 64] [--max-step 200]

The state is ``--mib`` MiB of float32 (split by rows over the ranks as LocalShard pieces) plus
small replicated tensors of other dtypes, every element equal to the step it is saved as, and the
extra value ``{"step": step}``. Step 1 is saved and waited for, then steps 2, 3, ... are saved one
after another, each waited for (so one save is always in flight). stdout, flushed at once:

    saving N       # the state holds N everywhere; cp.save(N, ...) is called next
    committed N S  # step N is committed in every tier; S = seconds from "saving N"

With WORLD_SIZE > 1 the ranks form a gloo group (the torchrun environment contract).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal import ckpt

COLS = 4096


def make_state(mib: int, rank: int, world: int) -> dict:
    rows = mib * 2**20 // (4 * COLS)
    per = -(-rows // world)
    start, stop = min(rank * per, rows), min((rank + 1) * per, rows)
    return {
        "big": ckpt.LocalShard(torch.zeros(stop - start, COLS), (start, 0), (rows, COLS)),
        "small": {"i64": torch.zeros(7, dtype=torch.int64), "bf16": torch.zeros(3, 5, dtype=torch.bfloat16),
                  "scalar": torch.zeros((), dtype=torch.float64)},
        "step": 0,
    }


def fill(state: dict, step: int) -> None:
    state["big"].tensor.fill_(step)
    for t in state["small"].values():
        t.fill_(step)
    state["step"] = step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--max-step", type=int, default=200)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank() if world > 1 else 0
    state = make_state(args.mib, rank, world)
    cp = ckpt.Checkpointer(args.dir, process_group=None, keep=3)
    try:
        for step in range(1, args.max_step + 1):
            fill(state, step)
            t0 = time.monotonic()
            print(f"saving {step}", flush=True)
            cp.save(step, state).wait()
            print(f"committed {step} {time.monotonic() - t0:.4f}", flush=True)
    finally:
        cp.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

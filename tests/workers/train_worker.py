"""One rank of a small job driven by ``tidal.train``, for kill tests (launched by tests/dist_harness.py).

    python tests/workers/train_worker.py --steps N [--pad-mib 96] [--step-s S]
        [--die-at-checkpoint K --die-rank R]

A small MLP (DDP when WORLD_SIZE > 1) learns a fixed function of synthetic samples (sample ``i`` is
computed from ``i``, so any rank can produce any sample). The checkpoint also holds ``pad``,
``--pad-mib`` MiB split over the ranks, so that persisting a save takes every rank a while. Data:
``GlobalBatchSampler(1000, global_batch=12, micro_batch=2, seed=7)``. Checkpoint location, interval
and progress directory come from the environment (TIDAL_*); every step record carries ``data_rank``
and ``indices``.

``--step-s S``: each step takes at least S seconds (the rest is slept), so that a job the test leaves
running while it waits for something else (a reclaim, a node loss) does not take a core from the tests
running beside it.

``--hold-after K --hold-file F`` (a partitioned node, for fencing tests): after step K, wait until that
step is committed, print ``holding K``, then wait until file F exists before training on.

``--die-at-checkpoint K``: rank ``--die-rank`` SIGKILLs itself from a progress writer the moment the
session has captured its save of step K (``cp.save`` returned; checksums and commits are running in
the background): a kill -9 in the middle of a save, at a known step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch import nn

from tidal import ckpt, train

NUM_SAMPLES, GLOBAL_BATCH, MICRO_BATCH, SEED, DIM = 1000, 12, 2, 7, 16


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.sin(torch.arange(DIM, dtype=torch.float32) * 0.37 * (i + 1))
    return x, (x[:4] * x[4:8]).sum(0, keepdim=True)


def pad_shard(mib: int, rank: int, world: int) -> ckpt.LocalShard:
    """``mib`` MiB of float32 split by rows over the ranks: every rank checksums and writes its own part."""
    rows = mib * 2**20 // (4 * 4096)
    per = -(-rows // world)
    start, stop = min(rank * per, rows), min((rank + 1) * per, rows)
    return ckpt.LocalShard(torch.zeros(stop - start, 4096), (start, 0), (rows, 4096))


class DieAtCheckpoint:
    """A progress writer that kills its own process when it sees the checkpoint record of ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def write(self, record: dict) -> None:
        if record.get("event") == "checkpoint" and record.get("step") == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--pad-mib", type=int, default=96)
    ap.add_argument("--die-at-checkpoint", type=int, default=None)
    ap.add_argument("--die-rank", type=int, default=1)
    ap.add_argument("--hold-after", type=int, default=None)
    ap.add_argument("--hold-file", default=None)
    ap.add_argument("--step-s", type=float, default=0.0)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    writers = (
        [DieAtCheckpoint(args.die_at_checkpoint)] if args.die_at_checkpoint and rank == args.die_rank else []
    )
    with train.Session(writers=writers) as s:
        torch.manual_seed(SEED)
        model: nn.Module = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))
        if s.distributed:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sampler = train.GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, MICRO_BATCH, rank=s.rank,
                                           world_size=s.world_size, seed=SEED)
        step = s.restore(model, opt, sampler, extra={"pad": pad_shard(args.pad_mib, s.rank, s.world_size)})
        print(f"restored {step}", flush=True)
        while step < args.steps:
            began = time.monotonic()
            total = torch.zeros(())
            for idx in sampler.micro_batches(step):
                xs, ys = zip(*(sample(i) for i in idx), strict=True)
                loss = nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys))
                (loss / sampler.accum_steps).backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad()
            step += 1
            s.step_done(step, loss=total / sampler.accum_steps, data_rank=s.rank,
                        indices=sampler.local_indices(step - 1))
            print(f"step {step}", flush=True)
            time.sleep(max(0.0, began + args.step_s - time.monotonic()))
            if step == args.hold_after:
                s.checkpoint(wait=True)
                print(f"holding {step}", flush=True)
                while not os.path.exists(args.hold_file):
                    time.sleep(0.02)


if __name__ == "__main__":
    main()

"""``tidal.train`` — the in-job runtime: stoppable at any step, resumable on any number of ranks.

    from tidal import train

    with train.Session() as s:                      # env contract: tidal.train.env
        sampler = train.GlobalBatchSampler(len(data), global_batch=32, micro_batch=4,
                                           rank=s.rank, world_size=s.world_size, seed=1)
        step = s.restore(model, optimizer, sampler) # newest committed step, resharded; 0 if none
        while step < max_steps:
            for idx in sampler.micro_batches(step):
                ...                                 # forward/backward on data[idx]
            optimizer.step(); optimizer.zero_grad()
            step += 1
            s.step_done(step, loss=loss)            # progress, periodic checkpoints, reclaim notices

Exit code 75 (:data:`EXIT_PREEMPTED`) means "preempted, resumable". Uses only ``tidal.ckpt`` and
torch; never imports the control plane. See docs/train.md.
"""

from tidal.train.data import BatchSizeError, GlobalBatchSampler, check_batch, permute, reseed
from tidal.train.env import EXIT_PREEMPTED, Env, EnvError
from tidal.train.notice import Notice
from tidal.train.progress import Heartbeat, JsonlWriter, MemoryWriter, ProgressWriter, read_jsonl
from tidal.train.session import Preempted, Session

__all__ = [
    "Session",
    "Preempted",
    "EXIT_PREEMPTED",
    "Env",
    "EnvError",
    "GlobalBatchSampler",
    "BatchSizeError",
    "check_batch",
    "permute",
    "reseed",
    "Notice",
    "ProgressWriter",
    "JsonlWriter",
    "MemoryWriter",
    "Heartbeat",
    "read_jsonl",
]

"""``tidal.train``: the in-job runtime, stoppable at any step, resumable on any number of ranks
(docs/train.md)."""

from tidal.train.data import BatchSizeError, GlobalBatchSampler, check_batch, permute, reseed
from tidal.train.env import EXIT_PREEMPTED, Env, EnvError
from tidal.train.notice import Notice
from tidal.train.progress import Heartbeat, JsonlWriter, MemoryWriter, ProgressWriter, read_jsonl
from tidal.train.session import Preempted, Session

__all__ = [
    "Session", "Preempted", "EXIT_PREEMPTED", "Env", "EnvError", "GlobalBatchSampler", "BatchSizeError",
    "check_batch", "permute", "reseed", "Notice", "ProgressWriter", "JsonlWriter", "MemoryWriter",
    "Heartbeat", "read_jsonl"
]

"""``tidal.train``: the in-job runtime, stoppable at any step, resumable on any number of ranks
(docs/train.md). ``Session`` and ``Preempted`` (torch) load on first use, so that the progress readers
load no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.train.data import BatchSizeError, GlobalBatchSampler, check_batch, permute, reseed
from tidal.train.env import EXIT_PREEMPTED, Env, EnvError
from tidal.train.notice import Notice
from tidal.train.progress import Heartbeat, JsonlWriter, MemoryWriter, ProgressWriter, read_jsonl

__all__ = [
    "Session", "Preempted", "EXIT_PREEMPTED", "Env", "EnvError", "GlobalBatchSampler", "BatchSizeError",
    "check_batch", "permute", "reseed", "Notice", "ProgressWriter", "JsonlWriter", "MemoryWriter",
    "Heartbeat", "read_jsonl"
]

if TYPE_CHECKING:
    from tidal.train.session import Preempted, Session


def __getattr__(name: str) -> Any:
    if name not in ("Session", "Preempted"):
        raise AttributeError(f"module 'tidal.train' has no attribute {name!r}")
    from tidal.train import session

    value = getattr(session, name)
    globals()[name] = value
    return value

"""Progress reporting: one JSON record per event, per rank, and a heartbeat file written by the training
thread only (docs/train.md, Progress and heartbeat)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from tidal.contract import heartbeat_file, progress_file
from tidal.files import AS_OPEN, write_atomic


class ProgressWriter(Protocol):
    """Where progress records go. Called from the training thread only."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """Appends one JSON object per line to ``path``; flushed per record so readers see it at once."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()


class MemoryWriter:
    """Keeps records in a list (for tests and for in-process callers)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


class Heartbeat:
    """``heartbeat-rNNNNN.json``: the training thread's last sign of progress, at most every
    ``min_interval_s``."""

    def __init__(self, path: str | os.PathLike, *, rank: int, min_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.min_interval_s = min_interval_s
        self._last = 0.0

    def beat(self, step: int, phase: str, step_time_s: float | None = None, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        doc = {"time": time.time(), "step": step, "phase": phase, "step_time_s": step_time_s,
               "rank": self.rank, "pid": os.getpid()}
        with contextlib.suppress(OSError):  # a full or vanished directory must not stop training
            write_atomic(self.path, json.dumps(doc), mode=AS_OPEN, durable=False)


class Meter:
    """Step time and throughput from the time between consecutive ``step`` calls (none for the first after
    ``reset``); ``avg_step_time_s``: an exponential moving average (weight ``alpha``)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._prev: float | None = None
        self.avg_step_time_s: float | None = None

    def reset(self) -> None:
        """Forget the previous step's time (after a pause that is not training: restore, checkpoint)."""
        self._prev = None

    def step(self, now: float, samples: int | None, tokens: int | None) -> dict[str, float | None]:
        dt = None if self._prev is None else now - self._prev
        self._prev = now
        if dt is not None and dt > 0:
            a, avg = self.alpha, self.avg_step_time_s
            self.avg_step_time_s = dt if avg is None else (1 - a) * avg + a * dt
        return {"step_time_s": dt, "samples_per_s": samples / dt if dt and samples else None,
                "tokens_per_s": tokens / dt if dt and tokens else None}


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one progress file (a torn last line, from a kill, is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def progress_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / progress_file(rank)


def heartbeat_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / heartbeat_file(rank)

"""Durability status as data: which tiers hold which committed steps, and how far behind each is.

``Durability`` is updated by the checkpointer's threads; ``snapshot()`` gives a ``CheckpointStatus``
(JSON via ``to_dict``, format ``tidal-ckpt-status``), which rank 0 also writes atomically to a file
after every change. *Durable*: held by a non-shm tier (docs/checkpoint.md, "Durability status")."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tidal.files import private_dirs, read_plain, write_atomic

FORMAT = "tidal-ckpt-status"
VERSION = 1


@dataclass(frozen=True)
class TierStatus:
    name: str
    kind: str
    location: str
    durable: bool
    every: int
    keep: int
    steps: tuple[int, ...]  # committed in this tier, ascending
    backlog: tuple[int, ...] = ()  # queued for this tier, oldest first (slow tiers)
    uploading: int | None = None  # the step being written now (slow tiers)
    last_error: str | None = None  # the newest failure to reach this tier, cleared by a success
    last_error_unix_s: float | None = None


@dataclass(frozen=True)
class StepStatus:
    step: int
    tiers: tuple[str, ...]  # tier names holding it committed, fastest first
    saved_unix_s: float | None  # when save() captured it (or, for steps found on storage, committed)


@dataclass(frozen=True)
class CheckpointStatus:
    job: str
    updated_unix_s: float
    tiers: tuple[TierStatus, ...]
    steps: tuple[StepStatus, ...]
    newest_step: int | None
    newest_durable_step: int | None
    newest_durable_unix_s: float | None
    durable_age_s: float | None
    durable_lag_steps: int

    def tier(self, name: str) -> TierStatus:
        return next(t for t in self.tiers if t.name == name)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> CheckpointStatus:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a checkpoint status document (format {d.get('format')!r})")
        tiers = tuple(TierStatus(**{**t, "steps": tuple(t["steps"]), "backlog": tuple(t.get("backlog", ()))})
                      for t in d["tiers"])
        steps = tuple(StepStatus(s["step"], tuple(s["tiers"]), s.get("saved_unix_s")) for s in d["steps"])
        keys = ("job", "updated_unix_s", "newest_step", "newest_durable_step", "newest_durable_unix_s",
                "durable_age_s", "durable_lag_steps")
        rest: dict[str, Any] = {k: d.get(k) for k in keys}
        return cls(tiers=tiers, steps=steps, **rest)


MAX_STATUS_BYTES = 16 << 20


def read_status(path: str | os.PathLike) -> CheckpointStatus:
    """Read a status file written by a Checkpointer (see ``Checkpointer.status_path``): the job's own file,
    so never through a link, never a FIFO, at most ``MAX_STATUS_BYTES`` (:func:`tidal.files.read_plain`)."""
    return CheckpointStatus.from_dict(json.loads(read_plain(path, MAX_STATUS_BYTES)))


class Durability:
    """Thread-safe record behind ``Checkpointer.status()``; writes ``path`` (if given) on change."""

    def __init__(self, job: str, tiers: list[dict[str, Any]], path: Path | None) -> None:
        self.job = job
        self.path = path
        self._lock = threading.Lock()
        self._wlock = threading.Lock()  # one writer at a time, so the newest snapshot lands last
        self._order = [t["name"] for t in tiers]
        self._info = {t["name"]: t for t in tiers}
        self._steps: dict[str, dict[int, float | None]] = {n: {} for n in self._order}
        self._saved: dict[int, float] = {}
        self._backlog: dict[str, tuple[tuple[int, ...], int | None]] = {}
        self._error: dict[str, tuple[str, float] | None] = {}

    # -- updates (any thread) ----------------------------------------------------------------------
    def seed(self, tier: str, committed: dict[int, float]) -> None:
        with self._lock:
            self._steps[tier].update(committed)
        self._write()

    def saved(self, step: int, saved_unix_s: float) -> None:
        with self._lock:
            self._saved[step] = saved_unix_s

    def committed(self, tier: str, step: int) -> None:
        with self._lock:
            self._steps[tier][step] = None
            self._error[tier] = None
        self._write()

    def removed(self, tier: str, steps: list[int]) -> None:
        if not steps:
            return
        with self._lock:
            for s in steps:
                self._steps[tier].pop(s, None)
        self._write()

    def backlog(self, tier: str, steps: list[int], uploading: int | None) -> None:
        with self._lock:
            self._backlog[tier] = (tuple(steps), uploading)
        self._write()

    def error(self, tier: str, why: str) -> None:
        with self._lock:
            self._error[tier] = (why, time.time())
        self._write()

    # -- reading -----------------------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> CheckpointStatus:
        now = time.time() if now is None else now
        with self._lock:
            held: dict[int, list[str]] = {}
            when: dict[int, float | None] = {}
            tiers = []
            for n in self._order:
                info = self._info[n]
                for s, t in self._steps[n].items():
                    held.setdefault(s, []).append(n)
                    when[s] = self._saved.get(s, when.get(s) or t)
                backlog, uploading = self._backlog.get(n, ((), None))
                err = self._error.get(n)
                tiers.append(TierStatus(n, info["kind"], info["location"], info["durable"], info["every"],
                                        info["keep"], tuple(sorted(self._steps[n])), backlog, uploading,
                                        err[0] if err else None, err[1] if err else None))
        steps = tuple(StepStatus(s, tuple(held[s]), when.get(s)) for s in sorted(held))
        durable_names = {t.name for t in tiers if t.durable}
        durable = [s for s in steps if durable_names & set(s.tiers)]
        newest = steps[-1].step if steps else None
        nd = durable[-1] if durable else None
        nd_time = nd.saved_unix_s if nd else None
        return CheckpointStatus(job=self.job, updated_unix_s=now, tiers=tuple(tiers), steps=steps,
                                newest_step=newest, newest_durable_step=nd.step if nd else None,
                                newest_durable_unix_s=nd_time,
                                durable_age_s=(now - nd_time) if nd_time is not None else None,
                                durable_lag_steps=sum(1 for s in steps if nd is None or s.step > nd.step))

    def _write(self) -> None:
        if self.path is None:
            return
        with self._wlock, contextlib.suppress(OSError):  # advisory: never fail a save over it
            doc = self.snapshot().to_dict()
            private_dirs(self.path.parent)
            write_atomic(self.path, json.dumps(doc, indent=1), durable=False)

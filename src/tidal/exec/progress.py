"""A job's training progress, folded incrementally from rank 0's progress records and every rank's
heartbeat; reading an attempt's directory again from the start gives the same value."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tidal.contract import heartbeat_file, progress_file
from tidal.files import open_plain

SHM_TIERS = frozenset({"shm"})  # node memory: survives the process, not the node
STALL_WINDOW = 5  # saves whose median stall is reported
MAX_READ_BYTES = 1 << 20  # progress records read per observation (a job may write a sparse terabyte)


@dataclass
class Progress:
    """Training progress of one attempt (docs/control.md has the fields); Unix seconds, ``None``: not yet.
    Not changed once made (an observation's value). Not a frozen dataclass for its cost: one is made for
    every running job at every step, and a frozen one's 20 fields took 4.5 us to set against 1.2."""

    start_step: int | None = None
    restore_tier: str | None = None
    step: int | None = None
    step_s: float | None = None
    first_step: int | None = None
    first_step_s: float | None = None
    step_time_s: float | None = None
    loss: float | None = None
    heartbeat_s: float | None = None
    heartbeats: int = 0
    phase: str | None = None
    ckpt_step: int | None = None
    ckpt_s: float | None = None
    durable_ckpt_step: int | None = None
    durable_ckpt_s: float | None = None
    ckpt_stall_s: float | None = None
    ckpt_every_steps: int | None = None
    tiers: dict[str, list] = field(default_factory=dict)
    preempted: bool = False
    ended: bool = False

    @property
    def mean_step_s(self) -> float | None:
        """Mean seconds per step over this attempt (first to newest step record)."""
        if (self.step is not None and self.first_step is not None and self.step > self.first_step
                and self.step_s is not None and self.first_step_s is not None):
            return (self.step_s - self.first_step_s) / (self.step - self.first_step)
        return self.step_time_s

    @property
    def steps_per_s(self) -> float | None:
        m = self.mean_step_s
        return 1.0 / m if m else None

    def to_dict(self) -> dict[str, Any]:
        """The fields in their order, then ``steps_per_s`` (``__dict__`` holds exactly the fields)."""
        return {**self.__dict__, "steps_per_s": self.steps_per_s}


_FOLDED = frozenset(f.name for f in fields(Progress)) - {"tiers", "heartbeat_s", "heartbeats", "phase"}
"""The fields of :class:`Progress` folded from the progress records as they are (absent: the default)."""


class ProgressReader:
    """Incremental reader of one attempt's progress directory (rank 0's records, all heartbeats)."""

    def __init__(self, directory: str | os.PathLike, world_size: int, owner: int | None = None) -> None:
        self.dir = Path(directory)
        self.world_size = world_size
        self.owner = owner  # the uid the job runs as: a file owned by another is not read
        self._offset = 0
        self._partial = b""
        self._f: dict[str, Any] = {}
        self._captured: dict[int, float | None] = {}
        self._stalls: collections.deque[float] = collections.deque(maxlen=STALL_WINDOW)

    def read(self) -> Progress:
        self._tail()
        beats = [b for b in (self._heartbeat(r) for r in range(self.world_size)) if b is not None]
        f = self._f
        return Progress(
            **{k: f[k] for k in _FOLDED if k in f}, tiers=dict(f.get("tiers", {})),
            heartbeat_s=min((b["time"] for b in beats), default=None), heartbeats=len(beats),
            phase=beats[0].get("phase") if beats else None
        )

    def _tail(self) -> None:
        path = self.dir / progress_file(0)
        try:
            with open_plain(path, owner=self.owner) as fh:
                fh.seek(self._offset)
                chunk = fh.read(MAX_READ_BYTES)  # the rest at the next observation
        except OSError:
            return
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the rest
        if len(self._partial) > MAX_READ_BYTES:  # no record is that long: a job filling memory
            self._partial = b""
        for line in lines:
            with contextlib.suppress(ValueError):
                self._fold(json.loads(line))

    def _fold(self, r: dict[str, Any]) -> None:
        f, ev, t = self._f, r.get("event"), r.get("time")
        if ev == "start" and isinstance(r.get("ckpt_every_steps"), int):
            f["ckpt_every_steps"] = r["ckpt_every_steps"]
        elif ev == "restore":
            f["start_step"] = int(r.get("step") or 0)
            f["restore_tier"] = r.get("tier") if isinstance(r.get("tier"), str) else None
        elif ev == "step":
            f["step"], f["step_s"] = r.get("step"), t
            if f.get("first_step") is None:
                f["first_step"], f["first_step_s"] = r.get("step"), t
            if r.get("step_time_s") is not None:
                f["step_time_s"] = r["step_time_s"]
            f["loss"] = r.get("loss")
        elif ev == "checkpoint":
            self._captured[int(r["step"])] = t
            if isinstance(r.get("stall_s"), (int, float)):
                self._stalls.append(float(r["stall_s"]))
                f["ckpt_stall_s"] = statistics.median(self._stalls)
        elif ev == "committed":
            step = int(r["step"])
            when = self._captured.get(step, t)
            tiers = f.setdefault("tiers", {})
            for name in r.get("tiers", []):
                if name not in tiers or tiers[name][0] < step:
                    tiers[name] = [step, when]
            if f.get("ckpt_step") is None or step > f["ckpt_step"]:
                f["ckpt_step"], f["ckpt_s"] = step, when
            if set(r.get("tiers", [])) - SHM_TIERS and (f.get("durable_ckpt_step") or -1) < step:
                f["durable_ckpt_step"], f["durable_ckpt_s"] = step, when
        elif ev == "preempted":  # the final checkpoint of a notice, held by ``tiers`` at exit
            f["preempted"] = True
            if r.get("tiers") and r.get("step") is not None:
                self._fold({**r, "event": "committed"})
        elif ev == "end":
            f["ended"] = True

    def phase(self, rank: int) -> str | None:
        """Rank ``rank``'s newest heartbeat phase (``None``: none yet)."""
        b = self._heartbeat(rank)
        return b.get("phase") if b is not None else None

    def _heartbeat(self, rank: int) -> dict[str, Any] | None:
        try:
            with open_plain(self.dir / heartbeat_file(rank), owner=self.owner) as fh:
                doc = json.loads(fh.read(1 << 16))
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("time"), int | float) else None

"""What both executors share: the layout of their state dir (``<root>/<job>/attempt-<n>/``, the job's
private area and logs), the small files kept per attempt (``launch.json``, ``control.json``, written
atomically), and settings and signals sent to a tracked attempt."""

from __future__ import annotations

import json
import signal
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal import contract as c
from tidal.exec.progress import ProgressReader
from tidal.exec.protocol import LaunchRequest, Observation, RankState, check_ranks
from tidal.files import write_atomic


def write_json(path: Path, doc: dict, owner: tuple[int, int] | None = None) -> None:
    """Atomically, mode 0600 (:func:`tidal.files.write_atomic`); with ``owner`` (a job's uid and gid: a
    file the job reads) 0640 in that gid, still this process's: the job reads it and cannot change it (a
    job that could would hand the plane, which reads it back, whatever it wrote: a file of any size)."""
    write_atomic(path, json.dumps(doc), group=None if owner is None else owner[1])


def read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class Attempt:
    """One tracked attempt: its ranks (each with ``rank``, ``pid`` and, across nodes, ``node``) and what
    was seen of them (``lost``: as the executor means it)."""

    job_id: str
    attempt: int
    launched_s: float
    dir: Path
    ranks: list[Any]
    owner: tuple[int, int] | None = None  # the ranks' uid and gid when they run as their own user
    codes: dict[int, int] = field(default_factory=dict)
    vanished: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)
    reader: ProgressReader = field(init=False)

    def __post_init__(self) -> None:
        self.reader = ProgressReader(self.dir / c.PROGRESS_DIRNAME, len(self.ranks))

    def observation(self, across_nodes: bool = False) -> Observation:
        """What the executor reports; ``across_nodes``: each rank's node, and ``lost`` with it."""
        states = []
        for k in self.ranks:
            code = self.codes.get(k.rank)
            ended = code is not None and code != 0 and self.reader.phase(k.rank) == c.PHASE_ENDED
            lost, node = (k.rank in self.lost, k.node) if across_nodes else (False, None)
            states.append(RankState(k.rank, k.pid, code, k.rank in self.vanished, ended, lost, node))
        return Observation(self.job_id, self.attempt, self.launched_s, tuple(states), self.reader.read())


class AttemptDirs:
    """The base of an executor: ``root`` and the tracked attempts; subclasses signal ranks (:meth:`_send`)."""

    root: Path
    _jobs: Mapping[str, Attempt]

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        return self.job_dir(job_id) / c.attempt_dirname(attempt)

    def home_dir(self, job_id: str) -> Path:
        """The job's private area (``HOME``, ``TMPDIR``; its working directory without ``workdir``)."""
        return self.job_dir(job_id) / "home"

    def log_path(self, job_id: str, rank: int) -> str:
        return str(self.job_dir(job_id) / "logs" / f"rank-{rank}.log")

    def attempt_env(self, req: LaunchRequest, adir: Path) -> dict[str, str]:
        """Tidal's variables of every rank of the attempt in ``adir``."""
        return {c.ENV_JOB_ID: req.job_id, c.ENV_ATTEMPT: str(req.attempt),
                c.ENV_PROGRESS_DIR: str(adir / c.PROGRESS_DIRNAME),
                c.ENV_CONTROL_FILE: str(adir / c.CONTROL_FILE)}

    def signal_stop(self, job_id: str, ranks: Collection[int] | None = None) -> None:
        self._signal(job_id, signal.SIGTERM, ranks)

    def kill(self, job_id: str) -> None:
        self._signal(job_id, signal.SIGKILL)

    def _signal(self, job_id: str, sig: int, ranks: Collection[int] | None = None) -> None:
        t = self._jobs.get(job_id)
        if t is None:
            return
        wanted = check_ranks(f"job {job_id}", ranks, len(t.ranks))
        self._send(t, [k for k in t.ranks if k.rank in wanted and k.rank not in t.codes
                       and k.rank not in t.vanished], sig)

    def _send(self, t: Any, ranks: list[Any], sig: int) -> None:  # Any: each executor's own Attempt
        raise NotImplementedError

    def configure(self, job_id: str, settings: Mapping[str, Any]) -> None:
        t = self._jobs.get(job_id)
        if t is not None:
            path = t.dir / c.CONTROL_FILE
            write_json(path, {**(read_json(path) or {}), **settings}, t.owner)  # ranks never read half a file

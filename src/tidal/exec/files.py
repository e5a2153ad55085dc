"""What both executors share: the layout of their state dir (``<root>/<job>/attempt-<n>/``, the job's
private area and logs), the small files kept per attempt (``launch.json``, ``control.json``, written
atomically), and settings and signals sent to a tracked attempt."""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tidal import contract as c
from tidal.ckpt.agent.auth import job_ckpt_key, load_or_create_key
from tidal.exec import sandbox
from tidal.exec.progress import ProgressReader
from tidal.exec.protocol import LaunchRequest, Observation, RankState, check_ranks
from tidal.files import read_plain, write_atomic


class _ReadOnly(Protocol):
    """What :meth:`AttemptDirs.binds` reads of the executor's ``IsolationConfig`` (which imports this)."""

    @property
    def read_only(self) -> tuple[str, ...]: ...


def write_json(path: Path, doc: dict, owner: tuple[int, int] | None = None) -> None:
    """Atomically, mode 0600 (:func:`tidal.files.write_atomic`); with ``owner`` (a job's uid and gid: a
    file the job reads) 0640 in that gid, still this process's: the job reads it and cannot change it (a
    job that could would hand the plane, which reads it back, whatever it wrote: a file of any size)."""
    write_atomic(path, json.dumps(doc), group=None if owner is None else owner[1])


MAX_JSON_BYTES = 16 << 20  # launch.json of the largest job is well under this


def read_json(path: Path, owner: int | None = None) -> dict | None:
    """The JSON object in ``path``, read as :func:`tidal.files.read_plain` reads a file a job may control
    (``owner``: the job's uid); ``None`` when it is missing, refused or not a JSON object."""
    try:
        doc = json.loads(read_plain(path, MAX_JSON_BYTES, owner=owner))
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
        self.reader = ProgressReader(self.dir / c.PROGRESS_DIRNAME, len(self.ranks),
                                     self.owner[0] if self.owner else None)

    def observation(self, across_nodes: bool = False) -> Observation:
        """What the executor reports; ``across_nodes``: each rank's node, and ``lost`` with it."""
        states = []
        for k in self.ranks:
            code = self.codes.get(k.rank)
            ended = code is not None and code != 0 and self.reader.phase(k.rank) == c.PHASE_ENDED
            lost, node = (k.rank in self.lost, k.node) if across_nodes else (False, None)
            states.append(RankState(k.rank, k.pid, code, k.rank in self.vanished, ended, lost, node))
        return Observation(self.job_id, self.attempt, self.launched_s, tuple(states), self.reader.read())


def cap_log(path: str, max_bytes: int) -> int:
    """Keep a rank's log under ``max_bytes`` (``isolation.max_log_bytes``): once it is larger, its newest
    half (from a line start) moves to the front after one line saying how many bytes were cut there, in
    place (the rank appends to the same file). Bytes the rank writes in the instant of the cut may be
    lost. Returns the bytes cut (0: under the cap, or no log)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    with open(fd, "r+b") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
            return 0
        f.seek(st.st_size - max_bytes // 2)
        tail = f.read(max_bytes // 2)
        tail = tail[tail.find(b"\n") + 1:] if b"\n" in tail[:-1] else tail
        tail += f.read()  # what the rank wrote meanwhile
        cut = f.tell() - len(tail)
        f.seek(0)
        f.write(f"=== tidal: {cut} bytes of this log were cut here (the log is kept under "
                f"{max_bytes} bytes: isolation.max_log_bytes) ===\n".encode() + tail)
        f.truncate()
    return cut


class AttemptDirs:
    """The base of an executor: ``root`` and the tracked attempts; subclasses signal ranks (:meth:`_send`)."""

    root: Path
    _jobs: Mapping[str, Attempt]
    isolation: _ReadOnly
    hidden: list[str]  # what no rank sees (the jobs dir, the state dir), resolved
    shm_root: Path | None  # the jobs' shared-memory directories (on Ray: per node below it)

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        return self.job_dir(job_id) / c.attempt_dirname(attempt)

    def home_dir(self, job_id: str) -> Path:
        """The job's private area (``HOME``, ``TMPDIR``; its working directory without ``workdir``)."""
        return self.job_dir(job_id) / "home"

    def log_path(self, job_id: str, rank: int) -> str:
        return str(self.job_dir(job_id) / "logs" / f"rank-{rank}.log")

    def binds(self, req: LaunchRequest, adir: Path, env: Mapping[str, str], cwd: str, shm: str | None,
              gpu: bool) -> sandbox.Binds:
        """What the sandbox of a rank of the attempt in ``adir`` binds (:mod:`tidal.exec.sandbox`): ``env``
        its environment, ``cwd`` its working directory, ``shm`` its shared-memory directory."""
        return sandbox.Binds(
            named=sandbox.named(env, cwd, self.hidden),
            hidden=(*self.hidden, *([str(self.shm_root)] if self.shm_root else [])), attempt=str(adir),
            own=(str(self.home_dir(req.job_id)), *req.own_dirs, *req.take_over), shm=shm,
            read_only=self.isolation.read_only, gpu=gpu)

    def cap_logs(self, t: Attempt, max_bytes: int | None) -> None:
        """Each rank's log of ``t`` under ``max_bytes`` (``isolation.max_log_bytes``; None: no cap)."""
        if max_bytes is not None:
            for k in t.ranks:
                cap_log(self.log_path(t.job_id, k.rank), max_bytes)

    def attempt_env(self, req: LaunchRequest, adir: Path) -> dict[str, str]:
        """Tidal's variables of every rank of the attempt in ``adir`` (the job's checkpoint key too: the
        same for each of its attempts, derived from the plane's key in ``root``)."""
        return {c.ENV_JOB_ID: req.job_id, c.ENV_ATTEMPT: str(req.attempt),
                c.ENV_CKPT_KEY: job_ckpt_key(load_or_create_key(self.root), req.job_id),
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

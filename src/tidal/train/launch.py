"""Start N ranks of a training script on this machine with the torchrun environment contract.

The smallest launcher that keeps what Tidal needs from one: each rank's own exit code (75 means
preempted, resumable; ``torchrun`` folds it into a generic failure) and the ability to signal any
subset of ranks (a reclaim notice reaches some ranks first). Used by ``tidal verify-resume`` and
the resume benchmark; the control plane's local executor will grow from it.

    with LocalLaunch([sys.executable, "train.py", "--steps", "100"], world_size=4, env=extra) as job:
        job.signal(signal.SIGTERM, ranks=[1])
        codes = job.wait(timeout_s=120)          # [75, 75, 75, 75]

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
MASTER_PORT; stdout/stderr go to ``log_dir/rank<N>.out|.err``. Each rank runs in its own session
(process group), so signals sent here reach only that rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tidal.contract import EXIT_PREEMPTED, torchrun_env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank: this process's environment plus the torchrun contract."""
    env = os.environ.copy()
    env.update(torchrun_env(rank, world_size, port))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # never depend on how the hostname resolves
    if extra:
        env.update(extra)
    return env


class LocalLaunch:
    """``world_size`` processes running ``cmd``; a context manager that kills leftovers on exit."""

    def __init__(self, cmd: Sequence[str], world_size: int, *, env: dict[str, str] | None = None,
                 log_dir: str | os.PathLike | None = None, cwd: str | os.PathLike | None = None) -> None:
        self.cmd = list(cmd)
        self.world_size = world_size
        self.port = free_port()
        self._tmp: tempfile.TemporaryDirectory | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tidal-launch-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started_unix = time.time()
        self.exited_unix: list[float | None] = [None] * world_size
        self.procs: list[subprocess.Popen] = []
        try:
            for r in range(world_size):
                with (
                    open(self.log_dir / f"rank{r}.out", "wb") as out,
                    open(self.log_dir / f"rank{r}.err", "wb") as err,
                ):
                    self.procs.append(subprocess.Popen(self.cmd, stdout=out, stderr=err, cwd=cwd,
                                                       env=rank_env(r, world_size, self.port, env),
                                                       start_new_session=True))
        except BaseException:
            self.kill()
            raise

    def signal(self, sig: int, ranks: Iterable[int] | None = None) -> float:
        """Send ``sig`` to the given ranks (all by default); return the Unix time it was sent."""
        t = time.time()
        for r in range(self.world_size) if ranks is None else ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[r].pid, sig)
        return t

    def poll(self) -> list[int | None]:
        codes = []
        for r, p in enumerate(self.procs):
            c = p.poll()
            if c is not None and self.exited_unix[r] is None:
                self.exited_unix[r] = time.time()
            codes.append(c)
        return codes

    def wait(
        self, timeout_s: float = 300.0, *, poll_s: float = 0.01, after_failure_s: float = 10.0
    ) -> list[int]:
        """Exit codes of every rank, once all exited; kills all and raises TimeoutError after ``timeout_s``.

        A rank that fails (not 0, not 75) makes the others wait on it in a collective until their
        own timeout; ``after_failure_s`` later the rest are killed (their code is then -9).
        """
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while True:
            codes = self.poll()
            ended = [c for c in codes if c is not None]
            if len(ended) == len(codes):
                return ended
            if failed_at is None and any(c not in (None, 0, EXIT_PREEMPTED) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > after_failure_s:
                self.kill()
                continue
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"{self.cmd[1:2]} x{self.world_size}: still running after {timeout_s:.0f} s; "
                    f"logs in {self.log_dir}\n{self.tails()}"
                )
            time.sleep(poll_s)

    def kill(self) -> None:
        """SIGKILL every rank still running (each rank's own process group, by id)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self.poll()

    def output(self, rank: int, stream: str = "out") -> str:
        try:
            return (self.log_dir / f"rank{rank}.{stream}").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tails(self, lines: int = 15) -> str:
        parts = []
        for r, p in enumerate(self.procs):
            err = self.output(r, "err").strip().splitlines()[-lines:]
            parts.append(f"--- rank {r} (exit code {p.returncode}) stderr tail:\n" + "\n".join(err))
        return "\n".join(parts)

    def close(self) -> None:
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalLaunch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

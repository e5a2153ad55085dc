"""Launch N worker processes the way ``torchrun`` would, for real multi-process tests on CPU (gloo).

    from dist_harness import run_workers
    outs = run_workers("reshard_worker", 4, ["--phase", "save", ...], shm_dir=tmp_path / "shm")

Each rank runs ``python tests/workers/<script>.py args...`` with the torchrun environment contract
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>),
OMP_NUM_THREADS=1 and TIDAL_SHM_DIR pointing at a per-test directory (so nothing leaks into
/dev/shm). When any rank exits non-zero, or the timeout passes, every rank still running is killed
and :class:`WorkerError` is raised with the tail of each rank's stderr.

:class:`Launch` is the lower-level handle: it streams each rank's stdout line by line (for tests
that act on what a worker prints, e.g. kill -9 in the middle of a save).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tidal.contract import ENV_SHM_DIR, one_node_env, torchrun_env
from tidal.net import free_port

TESTS_DIR = Path(__file__).resolve().parent
WORKERS_DIR = TESTS_DIR / "workers"
REPO_SRC = TESTS_DIR.parent / "src"


class WorkerError(RuntimeError):
    """A worker exited non-zero, was killed, or the launch timed out."""


def worker_env(rank: int, world: int, port: int, shm_dir: str | os.PathLike | None,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """Rank ``rank``'s environment: this process's, the torchrun contract, gloo over loopback, one thread,
    unbuffered output, this checkout's ``src`` first on the path, ``shm_dir`` as the node-memory tier,
    then ``extra``."""
    env = {**os.environ, **torchrun_env(rank, world, port), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for k, v in one_node_env().items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_SRC), os.environ.get("PYTHONPATH", "")) if p)
    if shm_dir is not None:
        env[ENV_SHM_DIR] = str(shm_dir)
    return {**env, **(extra or {})}


class Launch:
    """N running ranks of ``tests/workers/<script>.py``. Use as a context manager: exit kills leftovers."""

    def __init__(self, script: str, nprocs: int, args: list[str], *, shm_dir: str | os.PathLike | None,
                 env: dict[str, str] | None = None, log_dir: str | os.PathLike | None = None) -> None:
        self.script = script
        self.nprocs = nprocs
        self.port = free_port()
        self._tmp = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"tidal-{script}-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.lines: list[list[tuple[float, str]]] = [[] for _ in range(nprocs)]  # (monotonic time, line)
        self._cond = threading.Condition()
        self.procs: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []
        path = WORKERS_DIR / f"{script}.py"
        try:
            for rank in range(nprocs):
                err = open(self.log_dir / f"rank{rank}.stderr", "wb")  # noqa: SIM115 - closed in wait()
                p = subprocess.Popen(
                    [sys.executable, str(path), *args],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=worker_env(rank, nprocs, self.port, shm_dir, env),
                    cwd=TESTS_DIR.parent,
                    start_new_session=True,
                )
                err.close()
                self.procs.append(p)
                t = threading.Thread(target=self._read, args=(rank, p), daemon=True)
                t.start()
                self._readers.append(t)
        except BaseException:
            self.kill()
            raise

    def _read(self, rank: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                self.lines[rank].append((time.monotonic(), line))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # -- observing ------------------------------------------------------------------------------
    def stdout(self, rank: int) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines[rank])

    def stderr(self, rank: int) -> str:
        try:
            return (self.log_dir / f"rank{rank}.stderr").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_line(self, rank: int, predicate, timeout: float) -> tuple[float, str]:
        """Block until rank prints a line for which ``predicate(line)`` holds; return (time, line)."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for t, line in self.lines[rank][seen:]:
                    if predicate(line):
                        return t, line
                seen = len(self.lines[rank])
                if self.procs[rank].poll() is not None and not self._readers[rank].is_alive():
                    raise self._error(
                        f"rank {rank} exited (code {self.procs[rank].returncode}) before printing "
                        "the awaited line"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._error(f"rank {rank} did not print the awaited line within {timeout:.0f} s")
                self._cond.wait(min(left, 0.05))

    # -- ending ---------------------------------------------------------------------------------
    def kill_rank(self, rank: int) -> None:
        """SIGKILL one rank (the process itself, not its session)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait()

    def kill(self) -> None:
        """SIGKILL every rank still running (each rank's own process group, by id)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def wait(self, timeout: float = 120.0) -> list[str]:
        """Wait for every rank to exit 0; return their stdouts. Kill all and raise on failure."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    time.sleep(0.2)  # let the others print their own errors, if any
                    raise self._error(f"rank(s) {bad} exited non-zero")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise self._error(f"timed out after {timeout:.0f} s; still running: "
                                      f"{[r for r, c in enumerate(codes) if c is None]}")
                time.sleep(0.02)
        finally:
            self.kill()
            self.join_readers()
        return [self.stdout(r) for r in range(self.nprocs)]

    def exit_codes(self, timeout: float = 120.0) -> list[int]:
        """Wait until every rank exited, whatever its code (e.g. 75 = preempted); return the codes.

        Kills all and raises :class:`WorkerError` when the timeout passes first.
        """
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > deadline:
                raise self._error(f"timed out after {timeout:.0f} s waiting for every rank to exit")
            time.sleep(0.02)
        self.join_readers()
        return [int(p.returncode) for p in self.procs]

    def join_readers(self, timeout: float = 10.0) -> None:
        """After the ranks exited: wait until their last stdout lines are in ``lines``."""
        for t in self._readers:
            t.join(timeout=timeout)

    def _error(self, why: str) -> WorkerError:
        self.kill()
        parts = [f"{self.script} x{self.nprocs}: {why}"]
        for r, p in enumerate(self.procs):
            tail = self.stderr(r).strip().splitlines()[-40:]
            out = self.stdout(r).strip().splitlines()[-10:]
            parts.append(f"--- rank {r} (exit code {p.returncode}) stderr tail:\n" + "\n".join(tail))
            if out:
                parts.append(f"--- rank {r} stdout tail:\n" + "\n".join(out))
        return WorkerError("\n".join(parts))

    def close(self) -> None:
        self.kill()
        self.join_readers()
        for p in self.procs:
            if p.stdout is not None:
                p.stdout.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_workers(script: str, nprocs: int, args: list[str], *, shm_dir: str | os.PathLike | None,
                timeout: float = 120.0, env: dict[str, str] | None = None,
                log_dir: str | os.PathLike | None = None) -> list[str]:
    """Run ``nprocs`` ranks of ``tests/workers/<script>.py`` to completion; return each rank's stdout."""
    with Launch(script, nprocs, args, shm_dir=shm_dir, env=env, log_dir=log_dir) as launch:
        return launch.wait(timeout)

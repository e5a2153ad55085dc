"""The machinery behind the demos: an embedded control plane in this process, SIGKILLing one rank of a
running job, reading the attempts' progress files, and stopping every worker any attempt started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.contract import LAUNCH_FILE, PROGRESS_DIRNAME, attempt_dirname
from tidal.contract import pid_file as contract_pid_file
from tidal.control.client import API_URL_FILE
from tidal.control.config import ControlConfig
from tidal.exec import procs
from tidal.train.progress import progress_path, read_jsonl


class DemoError(RuntimeError):
    """The demo could not run or did not show what it should (the message says which)."""


# Fast reactions for a demo: a restart 1 s after a failure, the loop stepping 4 times a second.
PLANE_CONFIG = ControlConfig(restart_backoff_s=1.0, hang_timeout_s=60.0, startup_timeout_s=180.0,
                             kill_slack_s=5.0, loop_interval_s=0.25)


class EmbeddedPlane:
    """The pieces of ``tidal up`` in this process: the API (uvicorn in a thread, on a free loopback
    port), the reconcile loop (a thread) and the local executor on ``gpus`` CPU slots."""

    def __init__(
        self, state_dir: Path, gpus: int | str, config: ControlConfig = PLANE_CONFIG, **build_kw: Any
    ) -> None:
        from tidal.control.server import build

        self.plane = build(state_dir, str(gpus), None, config, **build_kw)  # build_kw: executor="ray", ...
        self.state_dir = self.plane.state_dir
        self.url = ""
        self._loop: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def admin_token(self) -> str:
        return self.plane.admin_token

    def start(self, timeout_s: float = 30.0) -> str:
        import uvicorn

        from tidal.control.server import ReconcileLoop

        p = self.plane
        p.controller.recover(time.time())  # a fresh state dir has nothing; a reused --state-dir may
        self._server = uvicorn.Server(uvicorn.Config(p.app(), host="127.0.0.1", port=0, log_level="warning",
                                                     access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="tidal-demo-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise DemoError(f"the embedded API server did not start on 127.0.0.1 within {timeout_s:g} s")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        (self.state_dir / API_URL_FILE).write_text(self.url + "\n")
        self._loop = ReconcileLoop(p.controller, p.controller.config.loop_interval_s)
        self._loop.start()
        return self.url

    def stop(self) -> list[int]:
        """Stop the loop, SIGKILL every worker that any attempt started and that still runs, stop the
        server, close the store. Returns the pids of the process groups it killed."""
        if self._loop is not None:
            self._loop.stop()
            self._loop.join(timeout=15)
        killed = kill_workers(self.state_dir)
        for job in self.plane.store.jobs():
            self.plane.executor.release(job.id)  # reaps the shims this process started
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.plane.store.close()
        close = getattr(self.plane.executor, "close", None)
        if callable(close):
            close()
        return killed


def kill_workers(state_dir: Path, wait_s: float = 10.0) -> list[int]:
    """SIGKILL the process group of every rank any attempt under ``state_dir`` recorded (``launch.json``:
    the shim's pid and start time, so a reused pid is never hit) that still runs; wait until gone."""
    killed = []
    for launch in sorted(Path(state_dir).glob(f"jobs/*/{attempt_dirname('*')}/{LAUNCH_FILE}")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            for r in json.loads(launch.read_text())["ranks"]:
                if procs.alive(r["pid"], r.get("started")):
                    procs.kill_group(r["pid"])
                    killed.append(r["pid"])
    deadline = time.monotonic() + wait_s
    while any(procs.alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


@contextlib.contextmanager
def uninterrupted():
    """Ignore SIGINT and SIGTERM inside (a second Ctrl-C must not cut a demo's clean-up short); only in
    the main thread, where Python handles signals."""
    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@dataclass
class Kill:
    rank: int
    pid: int
    shim_pid: int
    attempt: int
    at_step: int
    ckpt_step: int
    time_s: float


def kill_rank(job: dict, rank: int) -> Kill | None:
    """SIGKILL rank ``rank`` of the job's current attempt: its own process (not the shim), from
    ``pid-<rank>.json`` in the attempt dir the API names; None if it has exited already."""
    h = job.get("handle") or {}
    shims = {r["rank"]: r["pid"] for r in h.get("ranks", [])}
    if "dir" not in h or rank not in shims:
        raise DemoError(f"job {job['id']}: the API shows no attempt dir or no rank {rank} in its handle: {h}")
    pid_file = Path(h["dir"]) / contract_pid_file(rank)
    try:
        pid = int(json.loads(pid_file.read_text())["pid"])
    except (OSError, ValueError, KeyError) as e:
        raise DemoError(f"cannot read rank {rank}'s pid from {pid_file}: {e}") from None
    proc = procs.table().get(pid)
    if proc is not None and proc.ppid != shims[rank]:
        raise DemoError(
            f"pid {pid} from {pid_file} is not a child of rank {rank}'s shim (pid {shims[rank]}); "
            "not killing it"
        )
    p = job.get("progress") or {}
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return Kill(
        rank, pid, shims[rank], job["attempt"], p.get("step") or 0, job.get("ckpt_step") or 0, time.time())


def attempt_records(state_dir: Path, job_id: str) -> dict[int, list[dict]]:
    """Rank 0's progress records of every attempt (``jobs/<job>/attempt-<n>/progress/``), by attempt."""
    out: dict[int, list[dict]] = {}
    for d in Path(state_dir, "jobs", job_id).glob(attempt_dirname("*")):
        p = progress_path(d / PROGRESS_DIRNAME, 0)
        out[int(d.name.split("-", 1)[1])] = read_jsonl(p) if p.exists() else []
    return dict(sorted(out.items()))


def reached_step(records: list[dict]) -> int | None:
    """The newest step rank 0 completed in one attempt."""
    return max((int(r["step"]) for r in records if r.get("event") == "step"), default=None)

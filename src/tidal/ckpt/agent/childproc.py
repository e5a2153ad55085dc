"""Starting and stopping a helper process this code started (a checkpoint agent, a SeaweedFS server)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, what: str, log: Path,
               stop: Callable[[], None], poll_s: float = 0.05, log_from: int = 0) -> None:
    """Poll ``ready()`` until it is true. If ``proc`` exits first: stop and RuntimeError with the end of
    its ``log`` (what it wrote past byte ``log_from``, where earlier runs appended theirs); past
    ``timeout_s``: stop and TimeoutError. ``what`` names the process in both."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            tail = log.read_bytes()[log_from:].decode(errors="replace")[-2000:] if log.exists() else ""
            code = proc.returncode
            stop()
            raise RuntimeError(f"{what} exited with code {code}:\n{tail}")
        if time.monotonic() > deadline:
            stop()
            raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s (log: {log})")
        time.sleep(poll_s)


def stop_process(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL by pid; a no-op when ``proc`` already ended."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)

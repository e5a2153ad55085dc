"""Starting and stopping a helper process this code started (a checkpoint agent, a SeaweedFS server)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, what: str, log: Path,
               stop: Callable[[], None], poll_s: float = 0.05) -> None:
    """Poll ``ready()`` until it is true. If ``proc`` exits first: stop and RuntimeError with the end of
    its ``log``; past ``timeout_s``: stop and TimeoutError. ``what`` names the process in both."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
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


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (the OS picks them)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports

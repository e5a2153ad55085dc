"""Stopping a helper process this code started (a checkpoint agent, a SeaweedFS server)."""

from __future__ import annotations

import contextlib
import signal
import subprocess


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

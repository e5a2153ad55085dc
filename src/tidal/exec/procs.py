"""Processes by pid *and* start time: a pid alone can be reused by an unrelated process."""

from __future__ import annotations

import contextlib
import os
import signal


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # fields from 3 (state) on; comm may hold spaces


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone
    or not on Linux."""
    st = _stat(pid)
    return int(st[19]) if st else None


def alive(pid: int, started: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when ``started`` is given, is the same process."""
    st = _stat(pid)
    if st is None:
        if os.path.exists("/proc/self/stat"):
            return False
        try:  # no /proc (not Linux): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if st[0] in ("Z", "X"):
        return False
    return started is None or int(st[19]) == started


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a rank's shim and the rank)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_group(pid: int) -> None:
    signal_group(pid, signal.SIGKILL)

"""Reclaim notices: SIGTERM or a notice file means "GPUs are being taken back" (docs/train.md, Reclaim
notices). The signal handler only sets fields and starts the watchdog (no lock; stderr by ``os.write``)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from tidal.train.env import EXIT_PREEMPTED


class Notice:
    """Watches for a notice (``signals``, or ``notice_file`` with an mtime from ``not_before_unix``, default
    this process's start, on) and ends the process by ``exit_fn`` ``grace_s`` later or at a second signal."""

    def __init__(self, grace_s: float, notice_file: str | os.PathLike | None = None, *,
                 not_before_unix: float | None = None, signals: tuple[int, ...] = (signal.SIGTERM,),
                 exit_fn: Callable[[int], object] = os._exit) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s!r}")
        self.grace_s = float(grace_s)
        self.notice_file = Path(notice_file) if notice_file else None
        self.not_before_unix = process_start_unix() if not_before_unix is None else not_before_unix
        self.signals = signals
        self._exit_fn = exit_fn
        self.source: str | None = None  # "SIGTERM", "file", "peer" (another rank), "api" (trigger())
        self.received_unix: float | None = None
        self.deadline_unix: float | None = None
        self._signals_seen = 0
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._cancel = threading.Event()
        self._watchdog: threading.Thread | None = None

    def install(self) -> bool:
        """Install the signal handlers (main thread only; returns False elsewhere, files still work)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return True

    def uninstall(self) -> None:
        """Restore the previous handlers and cancel the watchdog."""
        for sig, prev in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, prev)
        self._previous.clear()
        self._cancel.set()

    def requested(self) -> bool:
        """Has this process been told to stop? Checks the notice file (one ``stat``) when none yet."""
        if self.source is not None:
            return True
        if self.notice_file is not None:
            try:
                mtime = self.notice_file.stat().st_mtime
            except OSError:
                return False
            if mtime >= self.not_before_unix:
                self.trigger("file", at_unix=min(mtime, time.time()))
                return True
        return False

    def trigger(self, source: str, at_unix: float | None = None) -> None:
        """Record a notice from ``source`` (first one wins) and start the grace watchdog."""
        if self.source is not None:
            return
        at = time.time() if at_unix is None else at_unix
        self.received_unix = at
        self.deadline_unix = at + self.grace_s
        self.source = source
        self._start_watchdog()

    def remaining_s(self) -> float:
        """Seconds left of the grace, less a margin for exiting; ``inf`` before any notice."""
        if self.deadline_unix is None:
            return float("inf")
        return self.deadline_unix - self.margin_s - time.time()

    @property
    def margin_s(self) -> float:
        """Time kept back from the grace for flushing and exiting."""
        return min(0.5, 0.05 * self.grace_s)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals_seen += 1
        name = signal.Signals(signum).name
        if self._signals_seen == 1:
            self.trigger(name)
            return
        _stderr(f"tidal: second {name}: exiting now with code {EXIT_PREEMPTED} (resumable from the newest "
                "committed step)\n")
        self._exit_fn(EXIT_PREEMPTED)

    def _start_watchdog(self) -> None:
        if self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, name="tidal-grace", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        assert self.deadline_unix is not None
        left = self.deadline_unix - self.margin_s / 2 - time.time()
        if self._cancel.wait(max(0.0, left)):
            return
        _stderr(f"tidal: the {self.grace_s:g} s grace after {self.source} ran out: exiting with code "
                f"{EXIT_PREEMPTED} (resumable from the newest committed step)\n")
        self._exit_fn(EXIT_PREEMPTED)


def _stderr(msg: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, msg.encode())


@functools.cache
def process_start_unix() -> float:
    """When this process started (Linux: from /proc; elsewhere: now, at first call)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started_after_boot_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Preempted(SystemExit):
    """Raised by ``step_done`` after a notice: the job stopped at ``step``; exit code 75 (resumable)."""

    def __init__(self, step: int, tiers: list[str]) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step = step
        self.tiers = tiers  # where the final checkpoint committed before the exit ([] if nowhere)

    def __str__(self) -> str:
        return f"preempted after step {self.step} (checkpoint committed in: {self.tiers or 'none'})"

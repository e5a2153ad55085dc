"""``SaveHandle``: one save in progress, done when every tier it was due in has committed or failed."""

from __future__ import annotations

import threading
import time

from tidal.ckpt.errors import FencedError, SaveError


class SaveHandle:
    """A save in progress. ``stall_s`` is how long ``save`` blocked the caller.

    Its parts are the fast tiers (the persist thread) and one per slow tier it is due in (that tier's
    upload queue); it is done when every part is. Thread-safe: parts finish on different threads.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.stall_s = 0.0
        self.persist_s = 0.0  # from save() return to commit in the last tier
        self.committed: list[str] = []  # tier names, in commit order
        self.pending: list[str] = []  # slow tiers this step is still queued for
        self.error: BaseException | None = None
        self._staged = threading.Event()
        self._done = threading.Event()
        self._fast = threading.Event()
        self._fast_error: BaseException | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._parts = 1
        self._errors: list[str] = []
        self._t_return = 0.0

    def done(self) -> bool:
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        if not self._staged.wait(timeout):
            raise TimeoutError(f"step {self.step}: staging not finished within {timeout} s")

    def wait(self, timeout: float | None = None, *, fast_only: bool = False) -> None:
        """Block until the step is committed in every tier it was due in; raise SaveError if any
        tier failed. ``fast_only``: only until the fast tiers (shm, directories) are done and the
        slow ones (S3) have it queued - e.g. before exiting on a reclaim notice."""
        if fast_only:
            if not self._fast.wait(timeout):
                raise TimeoutError(f"step {self.step}: not committed in the fast tiers within {timeout} s")
            if self._fast_error is not None:
                raise _kind(self._fast_error)(
                    f"step {self.step} was not committed in every fast tier (committed in: "
                    f"{self.committed or 'none'}): {self._fast_error}") from self._fast_error
            return
        if not self._done.wait(timeout):
            raise TimeoutError(f"step {self.step}: not committed within {timeout} s "
                               f"(committed in: {self.committed or 'none'}; pending: {self.pending})")
        if self.error is not None:
            raise _kind(self.error)(f"step {self.step} was not committed in every tier "
                            f"(committed in: {self.committed or 'none'}): {self.error}") from self.error

    def wait_tier(self, tier: str, timeout: float | None = None) -> bool:
        """Block until ``tier`` (a tier name, e.g. ``"shm"``) has committed this step; return whether
        it did (False when the save finished without it, or on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while tier not in self.committed and not self._done.is_set() and not (
                    self._fast.is_set() and tier not in self.pending):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            return tier in self.committed

    def __repr__(self) -> str:
        state = "failed" if self.error else ("committed" if self.done() else "pending")
        return f"SaveHandle(step={self.step}, {state}, tiers={self.committed})"

    # -- the checkpointer's side -------------------------------------------------------------------
    def _add_part(self, tier: str) -> None:
        with self._lock:
            self._parts += 1
            self.pending.append(tier)

    def _tier_committed(self, tier: str) -> None:
        with self._lock:
            self.committed.append(tier)
            self._changed.notify_all()

    def _part_done(self, tier: str | None, error: BaseException | None) -> None:
        """One part finished (``tier`` None: the fast tiers); the last one completes the handle."""
        with self._lock:
            if tier is not None:
                if tier in self.pending:
                    self.pending.remove(tier)
                if error is None:
                    self.committed.append(tier)
            if error is not None:
                self._errors.append(f"{tier}: {error}" if tier else str(error))
                cause = error if self.error is None else self.error
                fenced = isinstance(error, FencedError) or isinstance(self.error, FencedError)
                joined = (FencedError if fenced else SaveError)("; ".join(self._errors))
                self.error = error if len(self._errors) == 1 else joined
                if self.error is not error:
                    self.error.__cause__ = cause
            self._parts -= 1
            last = self._parts == 0
        if tier is None:
            self._fast_error = error
            self._fast.set()
        if last:
            self.persist_s = time.perf_counter() - self._t_return
            self._done.set()
        with self._lock:
            self._changed.notify_all()


def _kind(error: BaseException) -> type[SaveError]:
    """What ``wait`` raises for ``error``: ``FencedError`` stays one (the runtime stops on it)."""
    return FencedError if isinstance(error, FencedError) else SaveError

"""Persisting to slow tiers (object storage, peer memory) from a queue of their own.

Each slow tier gets a ``RemoteQueue`` per rank, fed after the fast tiers committed a step, uploading
from the step's copy in a local directory tier (``mmap``), else from a private snapshot of the slot
(``SnapshotPool``: reused buffers). Oldest first, retried with backoff, bounded by ``keep``; what it
drops fails its handle and is told to the other ranks (docs/checkpoint.md, "Where each copy comes
from"). Threads: ``submit`` from the persist thread; one worker thread per queue does all I/O."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tidal.ckpt.engine import commit
from tidal.ckpt.engine.status import Durability
from tidal.ckpt.errors import SaveError
from tidal.ckpt.tiers.config import TierConfig
from tidal.ckpt.tiers.directory import DirTier, failure_name, sidecar_name
from tidal.ckpt.tiers.protocol import DiscardTier, Tier

log = logging.getLogger(__name__)


class Snapshot:
    """A private copy of one rank file in a pooled buffer, shared by the queues that upload it."""

    def __init__(self, pool: SnapshotPool, buf: bytearray, size: int, refs: int) -> None:
        self._pool, self.size, self._refs = pool, size, refs
        self._buf: bytearray | None = buf  # None once released

    def view(self) -> memoryview:
        if self._buf is None:
            raise RuntimeError("snapshot used after it was released")
        return memoryview(self._buf)[: self.size]

    def release(self) -> None:
        with self._pool._lock:
            self._refs -= 1
            if self._refs > 0 or self._buf is None:
                return
            buf, self._buf = self._buf, None
        self._pool._give(buf)


class SnapshotPool:
    """Reusable snapshot buffers: at most ``keep`` idle ones (one too small for a save is dropped).
    Thread-safe: the persist thread takes, the upload queues release."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: list[bytearray] = []

    def copy(self, data: memoryview, refs: int) -> Snapshot:
        """A snapshot of ``data`` (bytes) for ``refs`` queues, each of which releases it once."""
        n = data.nbytes
        with self._lock:
            fits = [b for b in self._idle if len(b) >= n]
            buf = min(fits, key=len) if fits else None
            self._idle = [b for b in self._idle if b is not buf and len(b) >= n]
        if buf is None:
            buf = bytearray(n)
        src = data if data.format == "B" and data.ndim == 1 else data.cast("B")
        memoryview(buf)[:n] = src
        return Snapshot(self, buf, n, refs)

    def _give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._idle = []


@dataclass(eq=False)
class Upload:
    """One rank's share of one step bound for a slow tier."""

    step: int
    save_id: str
    name: str  # this rank's data file
    size_bytes: int
    sidecar: dict
    world: int
    done: Callable[[BaseException | None], None]  # called once: None when committed, else why not
    source: DirTier | None = None  # a tier holding the committed step, read from there
    snapshot: Snapshot | None = None  # else a private copy of the rank file
    build_manifest: Callable[[list[dict]], dict] | None = None  # rank 0: sidecars -> manifest
    written: set[str] = field(default_factory=set)  # "data", "sidecar": skipped on retry
    superseded: str | None = None  # set when dropped while an attempt was running

    def release_snapshot(self) -> None:
        """Let go of the snapshot (uploaded, or the step dropped); idempotent."""
        snap, self.snapshot = self.snapshot, None
        if snap is not None:
            snap.release()


class _SourceGone(Exception):  # noqa: N818
    pass


class RemoteQueue:
    """Uploads steps to one slow tier in order, retrying, without holding staging slots."""

    def __init__(self, tier: Tier, cfg: TierConfig, *, rank: int, commit_timeout_s: float,
                 fast_busy: Callable[[int], bool], lock: threading.Lock, durability: Durability,
                 retry_s: float = 0.5, retry_max_s: float = 30.0,
                 fence: Callable[[int], None] | None = None) -> None:
        self.tier, self.cfg, self.rank = tier, cfg, rank
        self.fence = fence  # checked before every commit (tidal.ckpt.fence)
        self.commit_timeout_s = commit_timeout_s
        self.retry_s, self.retry_max_s = retry_s, retry_max_s
        self._fast_busy = fast_busy
        self._lock = lock  # the checkpointer's registration lock (see commit.cleanup)
        self._status = durability
        self._cond = threading.Condition()
        self._pending: list[Upload] = []
        self._active: Upload | None = None
        self._owed: list[tuple[int, str, str]] = []  # (step, save_id, why): drop notices not yet written
        self._closing = False
        self._cancel = threading.Event()  # abandon everything (close timed out)
        self._thread = threading.Thread(target=self._run, name=f"tidal-{tier.name}-r{rank}", daemon=True)
        self._thread.start()

    # -- called by the checkpointer ----------------------------------------------------------------
    def submit(self, up: Upload) -> None:
        with self._cond:
            self._pending.append(up)
            dropped = self._trim()
            self._cond.notify_all()
        for u, why in dropped:
            self._finish(u, why)
        self._report_backlog()

    def busy(self, step: int) -> bool:
        """Whether this queue still has ``step`` to upload (cleanup of this tier must leave it)."""
        with self._cond:
            return any(u.step == step for u in self._pending)

    def backlog(self) -> list[int]:
        with self._cond:
            return [u.step for u in self._pending if u.superseded is None]

    def close(self, timeout_s: float | None = None) -> None:
        """Drain the backlog; after ``timeout_s`` (None: no limit) abandon what is left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left if left is None else min(left, 1.0))
        self._cancel.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()

    # -- the worker --------------------------------------------------------------------------------
    def _trim(self) -> list[tuple[Upload, str]]:
        """Under the condition: drop what retention or the snapshot bound says will never be needed."""
        drop: list[Upload] = []
        keep = self.cfg.keep
        if keep > 0 and len(self._pending) > keep:
            drop += self._pending[: len(self._pending) - keep]
        snaps = [u for u in self._pending if u.snapshot is not None and u is not self._active
                 and u not in drop]
        drop += snaps[:-1]
        out = []
        for u in drop:
            why = (f"step {u.step} was not persisted to tier '{self.tier.name}': superseded by newer steps "
                   f"while the tier was behind (keep={keep}, backlog {[p.step for p in self._pending]})")
            if u is self._active:
                u.superseded = why
            else:
                self._pending.remove(u)
                out.append((u, why))
        return out

    def _run(self) -> None:
        delay = self.retry_s
        while True:
            self._pay_debts()
            with self._cond:
                while not self._pending and not (self._closing or self._cancel.is_set()):
                    self._cond.wait()
                if self._cancel.is_set() or not self._pending:
                    left, self._pending = self._pending, []
                    break
                up = self._active = self._pending[0]
            self._report_backlog()
            try:
                self._attempt(up)
                error: BaseException | None = None
            except _SourceGone as e:
                error = SaveError(str(e))
            except SaveError as e:  # another rank failed, or a commit timed out: final for this step
                error = e
                if self.rank == 0 and not self._cancel.is_set():
                    commit.mark_failed(self.tier, up.step, up.save_id, e)
            except Exception as e:  # unreachable, throttled, refused: try again later
                msg = f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
                log.warning("tier '%s' step %d: %s; retrying in %.1f s", self.tier.name, up.step, msg, delay)
                self._status.error(self.tier.name, msg)
                with self._cond:
                    self._active = None
                    if up.superseded is not None:
                        self._pending.remove(up)
                    self._cond.notify_all()
                if up.superseded is not None:
                    self._finish(up, up.superseded)
                self._cancel.wait(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            delay = self.retry_s
            with self._cond:
                self._active = None
                self._pending.remove(up)
                self._cond.notify_all()
            self._report_backlog()
            self._done(up, error)
        for u in left:
            self._finish(u, f"step {u.step} was not persisted to tier '{self.tier.name}': abandoned when the "
                            "checkpointer closed (the tier was unreachable)")
        self._report_backlog()

    def _attempt(self, up: Upload) -> None:
        tier, step, sid = self.tier, up.step, up.save_id
        if "data" not in up.written:
            with self._source(up) as data:
                tier.write_file(step, up.name, data)
            up.written.add("data")
            up.release_snapshot()  # uploaded: back to the pool before the commit wait
        if "sidecar" not in up.written:
            commit.write_json(tier, step, sidecar_name(self.rank, sid), up.sidecar)
            up.written.add("sidecar")
        if self.rank != 0:
            commit.wait_committed(tier, step, sid, self.commit_timeout_s, cancel=self._cancel)
            return
        assert up.build_manifest is not None
        docs = commit.wait_sidecars(tier, step, sid, up.world, self.commit_timeout_s, cancel=self._cancel)
        commit.commit(tier, step, up.build_manifest(docs), self.fence)

    @contextlib.contextmanager
    def _source(self, up: Upload) -> Iterator[memoryview]:
        if up.snapshot is not None:
            yield up.snapshot.view()
            return
        assert up.source is not None
        try:
            fd = os.open(up.source.step_dir(up.step) / up.name, os.O_RDONLY)
        except FileNotFoundError:
            raise _SourceGone(f"step {up.step} was not persisted to tier '{self.tier.name}': its copy in "
                              f"tier '{up.source.name}' was removed by retention before its turn (the tier "
                              "was behind)") from None
        try:
            with mmap.mmap(fd, up.size_bytes, prot=mmap.PROT_READ) as m:
                mv = memoryview(m)
                try:
                    yield mv
                finally:
                    mv.release()
        finally:
            os.close(fd)

    def _done(self, up: Upload, error: BaseException | None) -> None:
        up.release_snapshot()
        if error is None:
            self._status.committed(self.tier.name, up.step)
        up.done(error)
        if error is not None or self.rank != 0:
            return
        try:
            removed = commit.cleanup(self.tier, self.cfg.keep, up.step,
                                     lambda s: self._fast_busy(s) or self.busy(s), self._lock)
        except Exception as e:  # best effort; the next commit cleans up again
            log.warning("tier '%s': cleanup after step %d failed: %s", self.tier.name, up.step, e)
            return
        self._status.removed(self.tier.name, removed)

    def _finish(self, up: Upload, why: str) -> None:
        """A step dropped from the backlog: tell the handle and (eventually) the other ranks."""
        log.warning("%s", why)
        up.release_snapshot()
        if isinstance(self.tier, DiscardTier) and "data" in up.written:  # handed off already (peer)
            self.tier.discard(up.step, up.name)
        if up.world > 1:
            with self._cond:
                self._owed.append((up.step, up.save_id, why))
        up.done(SaveError(why))

    def _pay_debts(self) -> None:
        """Write owed drop notices (error sidecar, or rank 0's failure marker) once the tier answers."""
        with self._cond:
            owed, self._owed = self._owed, []
        still = []
        for step, sid, why in owed:
            try:
                if self.rank == 0:
                    self.tier.write_bytes(step, failure_name(sid), why.encode())
                else:
                    commit.write_json(self.tier, step, sidecar_name(self.rank, sid), {"rank": self.rank,
                                                                                     "error": why})
            except Exception:
                still.append((step, sid, why))
        with self._cond:
            self._owed[:0] = still

    def _report_backlog(self) -> None:
        with self._cond:  # (an RLock: backlog() takes it again)
            a = self._active
            steps, active = self.backlog(), (a.step if a is not None and a.superseded is None else None)
        self._status.backlog(self.tier.name, steps, active)

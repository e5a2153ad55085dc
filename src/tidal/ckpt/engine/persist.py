"""The persist thread: a staged slot → the fast tiers (committed), then the slow tiers' queues.

Call order: :meth:`Persister.begin` registers a step before it is staged, :meth:`Persister.submit`
hands the staged :class:`PersistJob` over, :meth:`Persister.close` finishes every queued job. One
thread runs the jobs in order (checksums overlapping the first directory write); housekeeping after a
commit waits for the next save's copy, or ``CLEANUP_IDLE_S``. Errors go to the job's ``SaveHandle``."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.ckpt.engine import commit
from tidal.ckpt.engine.handle import SaveHandle
from tidal.ckpt.engine.staging import Slot, drop_stale_slots
from tidal.ckpt.engine.status import Durability
from tidal.ckpt.errors import FencedError, SaveError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.plan import SavePlan
from tidal.ckpt.tiers.config import TierConfig
from tidal.ckpt.tiers.directory import DirTier, data_name, sidecar_name
from tidal.ckpt.tiers.protocol import HandoffTier, Tier
from tidal.ckpt.tiers.remote import RemoteQueue, SnapshotPool, Upload

log = logging.getLogger(__name__)

CLEANUP_IDLE_S = 1.0  # a finished save's housekeeping waits this long for the next save's copy to end


@dataclass
class PersistJob:
    """One staged save on its way to the tiers."""

    step: int
    save_id: str
    plan: SavePlan
    slot: Slot
    deferred: list[tuple[torch.Tensor, torch.Tensor]]  # overlapped mode: (slot view, source) copied later
    objects: list[tuple[tuple, Any]]
    tiers: list[DirTier]  # fast tiers due, fastest first
    remote: list[RemoteQueue]  # slow tiers due
    handle: SaveHandle
    shm_tier: DirTier | None  # the checkpointer's shm tier (its commit hard-links the slot)
    urgent: bool = False  # commit the shm tier before any directory write (a reclaim's final save)
    shm_uncommitted: list[int] = field(default_factory=list)  # shm steps this slot's re-use removed
    ready: Any = None  # CUDA: the event after which the deferred device-to-host copy may start
    copy_error: BaseException | None = None  # the deferred copy failed
    queued: bool = False  # the slow tiers have it (each finishes its own part of the handle)
    t_return: float = 0.0
    key: bytes | None = None  # the checkpoint key its manifest is signed with (manifest.checkpoint_key)


class Persister:
    """Owns the persist thread, its I/O helpers and the record of steps in flight (see module doc)."""

    def __init__(self, *, rank: int, commit_timeout_s: float, durability: Durability,
                 config: Mapping[str, TierConfig], fence: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self.fence = fence  # checked before every commit (tidal.ckpt.fence)
        self.commit_timeout_s = commit_timeout_s
        self._durability = durability
        self._config = config
        self.lock = threading.Lock()
        self._in_flight: Counter[int] = Counter()
        self._snapshots = SnapshotPool()  # buffers of the slow tiers' private copies of a slot, reused
        self._queue: queue.Queue[PersistJob | None] = queue.Queue()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidal-io-r{rank}")
        self._handoff_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidal-handoff-r{rank}")
        self._thread = threading.Thread(target=self._worker, name=f"tidal-ckpt-r{rank}", daemon=True)
        self._thread.start()

    # -- steps in flight (the save path, the persist thread and the slow tiers' queues) -----------
    def begin(self, step: int) -> None:
        """A save of ``step`` starts: retention keeps it until :meth:`done`."""
        with self.lock:
            self._in_flight[step] += 1

    def done(self, step: int) -> None:
        with self.lock:
            self._in_flight[step] -= 1
            if self._in_flight[step] <= 0:
                del self._in_flight[step]

    def busy(self, step: int) -> bool:
        """Whether a save of ``step`` is still being written to the fast tiers (call under ``lock``)."""
        return self._in_flight.get(step, 0) > 0

    def submit(self, job: PersistJob) -> None:
        self._queue.put(job)

    def close(self) -> None:
        """Finish every queued job's fast tiers, then stop the thread and its helpers."""
        self._queue.put(None)
        self._thread.join()
        self._io.shutdown(wait=True)
        self._handoff_io.shutdown(wait=True)

    def free(self) -> None:
        """Free the reused snapshot buffer (S3 without a directory tier): after the slow tiers closed."""
        self._snapshots.clear()

    # -- the thread ------------------------------------------------------------------------------
    def _worker(self) -> None:
        # A finished save's housekeeping waits for the next save's copy, not to lengthen its stall.
        later: list[tuple[int, list]] = []
        while True:
            try:
                job = self._queue.get(timeout=CLEANUP_IDLE_S if later else None)
            except queue.Empty:
                _run_cleanups(later)
                continue
            if job is not None:
                job.handle._staged.wait()
            _run_cleanups(later)
            if job is None:
                return
            cleanups: list = []
            error: BaseException | None = None
            if job.shm_uncommitted and job.shm_tier is not None:
                self._durability.removed(job.shm_tier.name, job.shm_uncommitted)
            try:
                self._persist(job, cleanups)
            except BaseException as e:  # recorded on the handle; the thread keeps serving saves
                error = e
                if not job.queued:  # the slow tiers never got it: nothing to read it from
                    for q in job.remote:
                        job.handle._part_done(q.tier.name, SaveError("not queued: persisting failed before"))
            finally:
                job.handle._staged.set()
                job.handle._part_done(None, error)
                for q in job.remote:  # a peer agent may still copy the slot (after its push to the buddy)
                    if isinstance(q.tier, HandoffTier):
                        q.tier.wait_handoff(job.step, data_name(self.rank, job.save_id))
                job.slot.free.set()
            self.done(job.step)  # a re-save of it registers anew; cleanup skips it then
            later.append((job.step, cleanups))

    def _persist(self, job: PersistJob, cleanups: list) -> None:
        job.handle._staged.wait()
        if job.copy_error is not None:
            raise SaveError(f"copying the state failed: {job.copy_error}")
        rf = job.plan.files[self.rank]
        mv = job.slot.memoryview()
        data = mv[: rf.size_bytes]
        name = data_name(self.rank, job.save_id)
        # The first directory write (the slow part) starts now; checksums and the shm commit overlap it.
        first_dir = next((t for t in job.tiers if t.kind == "dir"), None)
        overlap = first_dir is not None and not (job.urgent and any(t.kind == "shm" for t in job.tiers))
        dir_write = (self._io.submit(first_dir.write_file, job.step, name, data)
                     if first_dir is not None and overlap else None)
        # So does handing the slot to the peer tier's agent (it copies the slot file itself).
        handoffs = {q.tier.name: self._handoff_io.submit(self._handoff, q.tier, job, name, data)
                    for q in job.remote if isinstance(q.tier, HandoffTier) and not job.urgent}
        readers = [f for f in [dir_write, *handoffs.values()] if f is not None]
        try:
            blocks = {p.key: mf.block_crcs(mv[p.start : p.start + p.nbytes]) for p in rf.pieces}
            header_crc = zlib.crc32(mv[: len(rf.header)])
        except BaseException:
            _drain(readers)
            raise
        sidecar = {"rank": self.rank, "step": job.step, "save_id": job.save_id, "blocks": blocks,
                   "header_crc32": header_crc, "size_bytes": rf.size_bytes}
        errors = []
        for tier in job.tiers:
            write: Callable[[], Any]
            if tier is first_dir and dir_write is not None:
                write = dir_write.result
            elif tier.kind == "dir":
                write = functools.partial(tier.write_file, job.step, name, data)
            else:
                assert job.slot.path is not None
                write = functools.partial(tier.link_file, job.step, name, job.slot.path)

            try:
                self._persist_tier(job, tier, write, sidecar, cleanups)
                job.handle._tier_committed(tier.name)
            except FencedError:  # no tier may commit this step (nor any later one): stop here
                _drain(readers)
                raise
            except Exception as e:
                errors.append(f"{tier.name}: {e}")
        self._queue_remote(job, name, data, sidecar, handoffs)
        if errors:
            raise SaveError("; ".join(errors))

    def _queue_remote(self, job: PersistJob, name: str, data: memoryview, sidecar: dict,
                      handoffs: dict) -> None:
        """Hand the step to each slow tier's queue. A tier that can take the data file from node memory
        now does (the peer tier: its agent copies the slot); the others read it from a directory tier
        that committed it, else from a private snapshot of the slot (taken here, before the slot is
        released)."""
        if not job.remote:
            return
        handed = {q.tier.name for q in job.remote
                  if (handoffs[q.tier.name].result() if q.tier.name in handoffs
                      else self._handoff(q.tier, job, name, data))}
        source = next((t for t in job.tiers if t.kind == "dir" and t.name in job.handle.committed), None)
        takers = 0 if source is not None else sum(q.tier.name not in handed for q in job.remote)
        # Into a reused buffer: a copy into fresh memory costs 10x more (page faults) than the copy itself.
        snapshot = self._snapshots.copy(data, takers) if takers else None
        build_manifest = functools.partial(manifest, job) if self.rank == 0 else None
        job.queued = True  # from here on each queue finishes its part of the handle
        for q in job.remote:
            done = functools.partial(job.handle._part_done, q.tier.name)
            given = q.tier.name in handed
            q.submit(Upload(job.step, job.save_id, name, len(data), sidecar, job.plan.world_size, done,
                            source=None if given else source, snapshot=None if given else snapshot,
                            build_manifest=build_manifest, written={"data"} if given else set()))

    def _handoff(self, tier: Tier, job: PersistJob, name: str, data: memoryview) -> bool:
        """Give this rank's data file to ``tier`` now if it can take it; False: its queue uploads it later."""
        if not isinstance(tier, HandoffTier):
            return False
        try:
            tier.handoff(job.step, name, data, job.slot.path)
            return True
        except Exception as e:
            log.warning("tier '%s' step %d: handoff failed (%s); the upload queue will retry", tier.name,
                        job.step, e)
            self._durability.error(tier.name, str(e))
            return False

    def _persist_tier(self, job: PersistJob, tier: DirTier, write: Callable[[], Any], sidecar: dict,
                      cleanups: list) -> None:
        step, sid = job.step, job.save_id
        try:
            write()
            commit.write_json(tier, step, sidecar_name(self.rank, sid), sidecar)
        except Exception as e:
            commit.report_error(tier, step, self.rank, sid, str(e))
            raise
        if self.rank != 0:
            commit.wait_committed(tier, step, sid, self.commit_timeout_s)
            self._durability.committed(tier.name, step)
            return
        try:
            docs = commit.wait_sidecars(tier, step, sid, job.plan.world_size, self.commit_timeout_s)
            commit.commit(tier, step, manifest(job, docs), self.fence)
        except Exception as e:
            commit.mark_failed(tier, step, sid, e)
            raise
        self._durability.committed(tier.name, step)
        keep = self._config[tier.name].keep

        def clean(tier: DirTier = tier) -> None:  # busy: a save of that step is in flight
            self._durability.removed(tier.name, commit.cleanup(tier, keep, step, self.busy, self.lock))

        cleanups.append(clean)
        if tier is job.shm_tier:
            cleanups.append(lambda: drop_stale_slots(tier.root / "slots", job.plan.world_size))


def manifest(job: PersistJob, docs: list[dict]) -> dict:
    """The step's manifest from every rank's sidecar (``docs``): block CRCs and header CRCs."""
    crcs = {f"{d['rank']}/{k}": str(v) for d in docs for k, v in d["blocks"].items()}
    headers = {int(d["rank"]): int(d["header_crc32"]) for d in docs}
    names = [data_name(r, job.save_id) for r in range(job.plan.world_size)]
    return mf.build(job.plan, job.step, job.save_id, time.time(), crcs, job.objects, names, headers, job.key)


def _drain(readers: list) -> None:
    """Wait for the futures still reading the slot: nobody may read it once it is released."""
    for f in readers:
        with contextlib.suppress(Exception):
            f.result()


def _run_cleanups(later: list[tuple[int, list]]) -> None:
    """Run the deferred housekeeping of finished saves (best effort; the next save tries again)."""
    while later:
        step, cleanups = later.pop(0)
        for fn in cleanups:
            try:
                fn()
            except Exception as e:
                log.warning("checkpoint cleanup after step %d failed: %s", step, e)

"""``Checkpointer``: save = stage (a memory copy, in the caller) + persist (background, per tier).

Call order and threads (every rank calls the same methods in the same order)::

    cp = Checkpointer(url, process_group=pg, keep=3)   # collective-free
    h = cp.save(step, state)   # collective: exchanges piece descriptions, copies into a slot
    ...                        # training continues while the background thread persists
    h.wait()                   # the step is committed in every tier (or SaveError)
    cp.close()                 # waits for everything pending, frees the slots

``save`` is called from the training thread; one background thread per Checkpointer checksums the
staged slot, writes it to each tier and commits (rank 0 writes manifests). The background thread
never runs a collective, so it cannot deadlock with training's collectives.

Overlapped mode (``guard=optimizer``): ``save`` copies module buffers and other unguarded tensors at
once but leaves the parameters and optimizer state to the background thread and returns; an
optimizer step pre-hook blocks the next ``optimizer.step()`` until that copy is done, so the
committed step is exactly the state at ``save``. The caller promises that guarded tensors change
only through ``optimizer.step()`` until then.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal.ckpt import comm
from tidal.ckpt import manifest as mf
from tidal.ckpt.errors import SaveError, StateError
from tidal.ckpt.flatten import TensorEntry, flatten
from tidal.ckpt.plan import PieceDesc, SavePlan, make_plan
from tidal.ckpt.staging import Slot, StagingArea, shm_has_room
from tidal.ckpt.tiers import DirTier, data_name, local_path, shm_root_for, sidecar_name

log = logging.getLogger(__name__)


class SaveHandle:
    """A save in progress. ``stall_s`` is how long ``save`` blocked the caller."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.stall_s = 0.0
        self.persist_s = 0.0  # from save() return to commit in the last tier
        self.committed: list[str] = []  # tier names, in commit order
        self.error: BaseException | None = None
        self._staged = threading.Event()
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        if not self._staged.wait(timeout):
            raise TimeoutError(f"step {self.step}: staging not finished within {timeout} s")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the step is committed in every tier; raise SaveError if any tier failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"step {self.step}: not committed within {timeout} s")
        if self.error is not None:
            raise SaveError(f"step {self.step} was not committed in every tier "
                            f"(committed in: {self.committed or 'none'}): {self.error}") from self.error

    def __repr__(self) -> str:
        state = "failed" if self.error else ("committed" if self.done() else "pending")
        return f"SaveHandle(step={self.step}, {state}, tiers={self.committed})"


@dataclass
class _Job:
    step: int
    save_id: str
    plan: SavePlan
    slot: Slot
    deferred: list[tuple[torch.Tensor, torch.Tensor]]
    objects: list[tuple[tuple, Any]]
    tiers: list[DirTier]
    handle: SaveHandle
    t_return: float = 0.0
    extra: dict = field(default_factory=dict)


class Checkpointer:
    """Concurrent, layout-independent checkpoints of a nested training state.

    Args:
        url: checkpoint directory (local or shared filesystem; ``file://`` accepted).
        process_group: the group whose ranks save together (``None``: the default group if
            initialised, else single-process).
        keep: committed steps retained on disk (newest first); 0 keeps all.
        shm: stage into node shared memory and use it as the first tier (falls back to private
            memory with a warning when ``/dev/shm`` lacks room).
        guard: an optimizer (or several) enabling overlapped mode; see the module docstring.
        slots: staging buffers; 2 lets one save stage while the previous one persists.
        commit_timeout_s: how long rank 0 waits for the other ranks' files before failing a step.
        fsync: fsync data and manifests on the disk tier.
    """

    def __init__(self, url: str | os.PathLike, process_group: Any = None, keep: int = 3, *, shm: bool = True,
                 guard: Any = None, slots: int = 2, commit_timeout_s: float = 600.0, fsync: bool = True) -> None:
        if not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        self.url = os.fspath(url)
        self.root = local_path(url)
        self.group = process_group
        self.keep = keep
        self.commit_timeout_s = commit_timeout_s
        self.rank, self.world_size = comm.world(process_group)
        self.disk = DirTier("disk", self.root, fsync=fsync)
        self.root.mkdir(parents=True, exist_ok=True)
        self.shm_tier: DirTier | None = DirTier("shm", shm_root_for(url), fsync=False) if shm else None
        self._want_shm = shm
        self._staging = StagingArea(slots, self.shm_tier.root / "slots" if self.shm_tier else None)
        self._slot_steps: dict[int, int] = {}
        self._in_flight: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._last: SaveHandle | None = None
        self._pending: list[SaveHandle] = []
        self._closed = False
        self._plan_cache: tuple[str, SavePlan] | None = None
        self._host = socket.gethostname()
        self._guards = _as_list(guard)
        self._hooks = [opt.register_step_pre_hook(self._pre_step_hook) for opt in self._guards]
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidal-stage-r{self.rank}")
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidal-io-r{self.rank}")
        self._thread = threading.Thread(target=self._worker, name=f"tidal-ckpt-r{self.rank}", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------------
    @property
    def overlapped(self) -> bool:
        return bool(self._guards)

    def save(self, step: int, state: dict) -> SaveHandle:
        """Capture ``state`` as step ``step``; returns once captured (see module docstring)."""
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.wait_staged()
        with self._lock:
            self._in_flight[step] += 1
        try:
            tensors, objects = flatten(state)
            plan, slot_idx, save_id, use_shm_tier = self._agree(tensors)
        except BaseException:
            self._done_in_flight(step)
            raise
        handle = SaveHandle(step)
        slot = self._staging.slots[slot_idx]
        slot.free.wait()  # back-pressure: the save that used this slot is still persisting
        slot.free.clear()
        try:
            if self.shm_tier is not None and slot.path is not None:
                for s in _steps_linking(self.shm_tier, slot.path):
                    self.shm_tier.uncommit(s)  # this slot's bytes are about to change
            rf = plan.files[self.rank]
            shm_dir = self._staging.shm_dir if self.shm_tier is not None else None
            slot.allocate(rf, plan.fingerprint, shm_dir, {n: e.dtype for n, e in plan.entries.items()})
            self._slot_steps[slot_idx] = step
            immediate, deferred = self._copies(rf, slot, tensors)
            with torch.no_grad():
                for dst, src in immediate:
                    dst.copy_(src, non_blocking=True)
                if any(src.is_cuda for _, src in immediate):
                    torch.cuda.synchronize()
            objs = [(o.path, json.loads(json.dumps(o.value))) for o in objects] if self.rank == 0 else []
        except BaseException:
            slot.free.set()
            self._done_in_flight(step)
            raise
        tiers = ([self.shm_tier] if use_shm_tier and self.shm_tier is not None else []) + [self.disk]
        job = _Job(step, save_id, plan, slot, deferred, objs, tiers, handle)
        if deferred:
            self._copier.submit(self._copy_deferred, job)
        else:
            handle._staged.set()
        self._last = handle
        self._pending = [h for h in self._pending if not h.done()] + [handle]
        job.t_return = time.perf_counter()
        handle.stall_s = job.t_return - t0
        self._queue.put(job)
        return handle

    def wait_staged(self) -> None:
        """Block until the last save's state is fully copied (overlapped mode)."""
        if self._last is not None:
            self._last._staged.wait()

    def wait(self) -> None:
        """Block until every pending save is committed or failed (errors are raised by handles)."""
        for h in list(self._pending):
            h._done.wait()

    def close(self) -> None:
        """Wait for pending saves, stop the background thread and free the staging buffers."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        self._queue.put(None)
        self._thread.join()
        self._copier.shutdown(wait=True)
        self._io.shutdown(wait=True)
        for h in self._hooks:
            h.remove()
        self._staging.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self) -> list[int]:
        from tidal.ckpt.api import steps

        return steps(self.url)

    # -- planning --------------------------------------------------------------------------------
    def _agree(self, tensors: list[TensorEntry]) -> tuple[SavePlan, int, str, bool]:
        descs = [PieceDesc(e.name, e.path, e.dtype, e.global_shape, e.box, e.placement) for e in tensors]
        names = [d.name for d in descs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:5]
            raise StateError(f"state has entries whose paths collide when joined with '/': {dup}")
        proposal: dict[str, Any] = {
            "pieces": [d.to_json() for d in descs] if self.world_size > 1 else [],
            "host": self._host,
            "shm": self.shm_tier is not None,
        }
        if self.rank == 0:
            proposal["slot"] = self._choose_slot()
            proposal["save_id"] = uuid.uuid4().hex[:12]
        if self.world_size == 1:
            gathered = [proposal]
            key: Any = tuple(descs)
        else:
            gathered = comm.allgather_json(proposal, self.group)
            key = json.dumps([g["pieces"] for g in gathered])
        if self._plan_cache is not None and self._plan_cache[0] == key:
            plan = self._plan_cache[1]
        elif self.world_size == 1:
            plan = make_plan([descs])
        else:
            plan = make_plan([[PieceDesc.from_json(v) for v in g["pieces"]] for g in gathered])
            self._plan_cache = (key, plan)
            self._check_shm_room(plan)
        same_node = all(g["host"] == gathered[0]["host"] and g["shm"] for g in gathered)
        return plan, int(gathered[0]["slot"]), str(gathered[0]["save_id"]), same_node and self.shm_tier is not None

    def _check_shm_room(self, plan: SavePlan) -> None:
        if self.shm_tier is None:
            return
        need = plan.files[self.rank].size_bytes * len(self._staging.slots)
        if not shm_has_room(self.shm_tier.root, need):
            log.warning("node shared memory at %s lacks %.2f GiB for staging; using private memory and "
                        "skipping the shm tier", self.shm_tier.root, need / 2**30)
            self._staging.close()
            self._staging = StagingArea(len(self._staging.slots), None)
            self.shm_tier = None

    def _choose_slot(self) -> int:
        """Rank 0: the slot whose data is oldest (never the one holding the newest step)."""
        best, best_key = 0, None
        for slot in self._staging.slots:
            held = self._slot_steps.get(slot.index, -1)
            if self.shm_tier is not None:
                path = self._staging.shm_dir / f"r{self.rank:05d}-slot{slot.index}.safetensors"
                linked = _steps_linking(self.shm_tier, path)
                held = max([held, *linked])
            key = (held, slot.index)
            if best_key is None or key < best_key:
                best, best_key = slot.index, key
        return best

    def _copies(self, rf, slot: Slot, tensors: list[TensorEntry]):
        by_name = {e.name: e for e in tensors}
        guarded = self._guarded_storages() if self._guards else set()
        immediate, deferred = [], []
        for p in rf.pieces:
            src = by_name[p.name].local
            pair = (slot.views[p.key], src.detach())
            if guarded and _storage_ptr(src) in guarded:
                deferred.append(pair)
            else:
                immediate.append(pair)
        return immediate, deferred

    def _guarded_storages(self) -> set[int]:
        out = set()
        for opt in self._guards:
            for group in opt.param_groups:
                for p in group["params"]:
                    out.add(_storage_ptr(p))
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        out.add(_storage_ptr(v))
        return out

    def _pre_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.wait_staged()

    def _done_in_flight(self, step: int) -> None:
        with self._lock:
            self._in_flight[step] -= 1
            if self._in_flight[step] <= 0:
                del self._in_flight[step]

    # -- background pipeline ---------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            cleanups: list = []
            try:
                self._persist(job, cleanups)
            except BaseException as e:  # recorded on the handle; the thread keeps serving saves
                job.handle.error = e
            finally:
                job.handle._staged.set()
                job.slot.free.set()
                job.handle.persist_s = time.perf_counter() - job.t_return
                job.handle._done.set()
            # Housekeeping after the handle is done, so wait() does not pay for it; the step stays
            # registered in flight until then so cleanup never races a re-save of it.
            for fn in cleanups:
                try:
                    fn()
                except Exception as e:  # cleanup is best effort; the next save tries again
                    log.warning("checkpoint cleanup after step %d failed: %s", job.step, e)
            self._done_in_flight(job.step)

    def _copy_deferred(self, job: _Job) -> None:
        try:
            with torch.no_grad():
                for dst, src in job.deferred:
                    dst.copy_(src, non_blocking=True)
                if any(src.is_cuda for _, src in job.deferred):
                    torch.cuda.synchronize()
        except BaseException as e:
            job.extra["copy_error"] = e
        finally:
            job.handle._staged.set()

    def _persist(self, job: _Job, cleanups: list) -> None:
        job.handle._staged.wait()
        if "copy_error" in job.extra:
            raise SaveError(f"copying the state failed: {job.extra['copy_error']}")
        rf = job.plan.files[self.rank]
        mv = job.slot.memoryview()
        data = mv[: rf.size_bytes]
        name = data_name(self.rank, job.save_id)
        # The disk write (the slow part) starts now; checksums and the shm commit overlap with it.
        disk_write = self._io.submit(self.disk.write_file, job.step, name, data)
        try:
            crcs = {p.key: zlib.crc32(mv[p.start : p.start + p.nbytes]) for p in rf.pieces}
        except BaseException:
            with contextlib.suppress(Exception):
                disk_write.result()
            raise
        sidecar = {"rank": self.rank, "step": job.step, "save_id": job.save_id, "crc32": crcs,
                   "size_bytes": rf.size_bytes}
        errors = []
        for tier in job.tiers:
            if tier is self.disk:
                write = disk_write.result
            else:
                assert job.slot.path is not None
                slot_path = job.slot.path

                def write(tier: DirTier = tier, slot_path: Path = slot_path) -> None:
                    tier.link_file(job.step, name, slot_path)

            try:
                self._persist_tier(job, tier, write, sidecar, cleanups)
                job.handle.committed.append(tier.name)
            except Exception as e:
                errors.append(f"{tier.name}: {e}")
        if errors:
            raise SaveError("; ".join(errors))

    def _persist_tier(self, job: _Job, tier: DirTier, write: Any, sidecar: dict, cleanups: list) -> None:
        step, sid = job.step, job.save_id
        try:
            write()
            tier.write_json(step, sidecar_name(self.rank, sid), sidecar)
        except Exception as e:
            with contextlib.suppress(Exception):
                tier.write_json(step, sidecar_name(self.rank, sid), {"rank": self.rank, "error": str(e)})
            raise
        if self.rank != 0:
            tier.wait_committed(step, sid, self.commit_timeout_s)
            return
        try:
            docs = tier.wait_sidecars(step, sid, job.plan.world_size, self.commit_timeout_s)
            crcs = {f"{d['rank']}/{k}": int(v) for d in docs for k, v in d["crc32"].items()}
            names = [data_name(r, sid) for r in range(job.plan.world_size)]
            doc = mf.build(job.plan, step, sid, time.time(), crcs, job.objects, names)
            tier.commit(step, doc)
        except Exception as e:
            tier.mark_failed(step, sid, str(e))
            raise
        keep = len(self._staging.slots) if tier is self.shm_tier else self.keep
        def busy(s: int) -> bool:  # another save of s is in flight (this job's own entry excluded)
            return self._in_flight.get(s, 0) > (1 if s == step else 0)

        cleanups.append(lambda: tier.cleanup(keep, step, busy, self._lock))
        if tier is self.shm_tier:
            slot_dir = self._staging.shm_dir
            cleanups.append(lambda: _drop_stale_slots(slot_dir, job.plan.world_size))


def _as_list(guard: Any) -> list:
    if guard is None:
        return []
    if isinstance(guard, Iterable) and not hasattr(guard, "param_groups"):
        return list(guard)
    return [guard]


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


def _steps_linking(tier: DirTier, path: Path) -> list[int]:
    """Committed steps of ``tier`` whose data files are hard links to ``path``."""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return []
    out = []
    for s in tier.committed_steps():
        d = tier.step_dir(s)
        try:
            for n in os.listdir(d):
                if n.endswith(".safetensors") and os.stat(d / n).st_ino == ino:
                    out.append(s)
                    break
        except FileNotFoundError:
            continue
    return out


def _drop_stale_slots(slot_dir: Path | None, world: int) -> None:
    """Remove slot files of ranks beyond the current world that no step links to any more."""
    if slot_dir is None:
        return
    with contextlib.suppress(FileNotFoundError):
        for n in os.listdir(slot_dir):
            if n.startswith("r") and n[1:6].isdigit() and int(n[1:6]) >= world:
                p = slot_dir / n
                with contextlib.suppress(OSError):
                    if os.stat(p).st_nlink == 1:
                        p.unlink()

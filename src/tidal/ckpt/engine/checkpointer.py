"""``Checkpointer``: save = stage (a memory copy, in the caller) + persist (background, per tier).

Call order (every rank calls the same methods in the same order)::

    cp = Checkpointer(tiers=["shm", "/nvme/run1", {"url": "s3://b/run1", "every": 5}])
    h = cp.save(step, state)   # collective: exchanges piece descriptions, copies into a slot
    h.wait()                   # the step is committed in every tier it was due in (or SaveError)
    cp.status()                # which tiers hold which steps; durable lag (also a JSON file)
    cp.close()                 # waits for everything pending, frees the slots

Threads: ``save`` runs in the training thread; the persist thread (``persist``) writes the fast tiers,
each slow tier has an upload queue (``remote``); no background thread runs a collective. Overlapped
mode (``guard=optimizer``): guarded tensors are copied in the background and the optimizer's next
``step()`` waits for that copy (docs/checkpoint.md, "Performance")."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

import tidal.ckpt.fence as fence
from tidal.ckpt.engine import comm
from tidal.ckpt.engine.handle import SaveHandle
from tidal.ckpt.engine.persist import Persister, PersistJob
from tidal.ckpt.engine.staging import Slot, shm_has_room
from tidal.ckpt.engine.status import CheckpointStatus, Durability
from tidal.ckpt.errors import StateError, TierSpecError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.flatten import TensorEntry, flatten
from tidal.ckpt.format.plan import PieceDesc, SavePlan, make_plan
from tidal.ckpt.tiers.config import build, resolve
from tidal.ckpt.tiers.directory import DirTier, is_s3_url, local_path, shm_root_for
from tidal.ckpt.tiers.protocol import Tier
from tidal.ckpt.tiers.remote import RemoteQueue
from tidal.files import drop_torn

log = logging.getLogger(__name__)

class Checkpointer:
    """Concurrent, layout-independent checkpoints of a nested training state.

    Args:
        url: the job's checkpoint location: a directory (``file://`` accepted) or ``s3://bucket/prefix``;
            or a tier list (as ``tiers=``). With ``tiers`` it may be omitted, else it must be the first
            non-shm tier.
        process_group: the ranks that save together (``None``: the default group if initialised).
        keep: committed steps retained per durable tier unless the tier says otherwise; 0 keeps all.
        tiers: where steps go, fastest first (see ``config``). Default: ``["shm", url]`` (``[url]``
            with ``shm=False``). Every tier is checked here: a malformed spec raises
            ``TierSpecError``, an unreachable one ``TierError``.
        shm: stage into node shared memory and use it as the first tier (private memory, with a
            warning, when ``/dev/shm`` lacks room). Ignored when ``tiers`` is given.
        guard: an optimizer (or several) enabling overlapped mode; see the module docstring.
        slots: staging buffers; 2 lets one save stage while the previous one persists.
        commit_timeout_s: how long rank 0 waits for the other ranks' files before failing a step.
        fsync: fsync data and manifests on directory tiers.
        status_path: where rank 0 keeps the status JSON (default ``<shm root>/status.json``);
            ``False`` writes none.
        retry_max_s: the longest wait between attempts to reach an unreachable slow tier.
        claim: the job and attempt checked against the home's fence before every commit
            (``tidal.ckpt.fence``); default: from ``TIDAL_JOB_ID`` and ``TIDAL_ATTEMPT``; ``False``:
            never checked.
        key: the checkpoint key manifests are signed with (bytes, or hex digits; default
            ``$TIDAL_CKPT_KEY``, which the control plane sets for each job; ``format.manifest``).
    """

    def __init__(self, url: str | os.PathLike | Sequence[Any] | None = None, process_group: Any = None,
                 keep: int = 3, *, tiers: Sequence[Any] | None = None, shm: bool = True, guard: Any = None,
                 slots: int = 2, commit_timeout_s: float = 600.0, fsync: bool = True,
                 status_path: str | os.PathLike | bool | None = None, retry_max_s: float = 30.0,
                 claim: fence.Claim | Literal[False] | None = None,
                 key: bytes | str | bool | None = None) -> None:
        if not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        if url is not None and not isinstance(url, (str, os.PathLike)):
            if tiers is not None:
                raise TierSpecError("pass the tier list either as url or as tiers=, not both")
            url, tiers = None, url
        default_tiers = tiers is None
        if tiers is None:
            if url is None:
                raise TypeError("Checkpointer needs a url or tiers=[...]")
            home_spec = str(url) if is_s3_url(url) else str(local_path(url))
            tiers = (["shm"] if shm else []) + [home_spec]
        home = None if url is None else os.fspath(url)
        self.home, self.tier_configs = resolve(tiers, default_keep=keep, home=home)
        self.url = os.fspath(url) if url is not None else self.home
        self._read_spec: Any = self.url if default_tiers else list(tiers)  # what steps() reads
        self.group = process_group
        self.key = mf.checkpoint_key(key)
        self.keep = keep
        self.commit_timeout_s = commit_timeout_s
        self.rank, self.world_size = comm.world(process_group)
        self.tiers: list[Tier] = [build(c, self.home, fsync=fsync) for c in self.tier_configs]
        for t in self.tiers:
            t.check()  # a typo or an unreachable store fails here, not hours later
        # the shm tier keeps one step per staging slot
        self._config = {c.name: replace(c, keep=slots) if c.kind == "shm" else c for c in self.tier_configs}
        local = [t for t in self.tiers if isinstance(t, DirTier)]  # the shm and dir tiers
        self.shm_tier: DirTier | None = next((t for t in local if t.kind == "shm"), None)
        self._slots = [Slot(i) for i in range(slots)]
        self._saves = 0
        self.status_path = self._status_path(status_path)
        self._durability = Durability(self.home, [self._tier_info(t) for t in self.tiers], self.status_path)
        for t in self.tiers:  # what storage already holds (other ranks skip the remote LISTs)
            if self.rank == 0 or t.fast:
                self._durability.seed(t.name, t.committed())
        self.claim = fence.Claim.from_env() if claim is None else (claim if claim else None)
        # the S3 tier that is the home (resolve normalized both locations); None for a directory or peer
        self._home_s3 = next((t for t in self.tiers if t.kind == "s3" and t.location == self.home), None)
        if self._home_s3 is not None and self.claim is not None and self.rank == 0:
            fence.claim_s3(self._home_s3, self.claim)  # an S3 home: this attempt's from now on
        self._persister = Persister(rank=self.rank, commit_timeout_s=commit_timeout_s,
                                    durability=self._durability, config=self._config, fence=self._fence())
        self._remote = [
            RemoteQueue(t, self._config[t.name], rank=self.rank, commit_timeout_s=commit_timeout_s,
                        fast_busy=self._persister.busy, lock=self._persister.lock,
                        durability=self._durability, retry_max_s=retry_max_s, fence=self._fence())
            for t in self.tiers if not t.fast
        ]
        self._last: SaveHandle | None = None
        self._pending: list[SaveHandle] = []
        self._closed = False
        self._plan_cache: tuple[str, SavePlan] | None = None
        self._side_stream: Any = None  # CUDA: the stream of the overlapped mode's background copies
        self._host = socket.gethostname()
        self._guards = _as_list(guard)
        # the next optimizer step waits for the background copy of what it changes
        self._hooks = [opt.register_step_pre_hook(lambda *_: self.wait_staged()) for opt in self._guards]
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidal-stage-r{self.rank}")

    def _fence(self) -> Any:
        """What rank 0 calls before each commit: its fence check (``None``: no claim, or a peer home)."""
        claim, home = self.claim, self.home
        if claim is None or self.rank != 0:
            return None
        if is_s3_url(home):
            tier = self._home_s3
            return None if tier is None else (lambda step: fence.check_s3(tier, claim, step))
        if "://" in home and not home.startswith("file://"):
            return None  # a peer home
        where = local_path(home)
        return lambda step: fence.check(where, claim, step)

    def _status_path(self, status_path: Any) -> Path | None:
        if status_path is False or self.rank != 0:
            return None
        if status_path is None or status_path is True:
            shm = DirTier("shm", shm_root_for(self.home), fsync=False)
            try:
                shm.check_owned(create=True)
            except OSError as e:
                log.warning("no status file: %s", e)
                return None
            path = shm.root / "status.json"
        else:
            path = Path(status_path)
        drop_torn(path)  # (rank 0 is its one writer: a writer killed mid-write left a temporary file)
        return path

    def _tier_info(self, t: Tier) -> dict:
        c = self._config[t.name]
        return {"name": t.name, "kind": t.kind, "location": t.location, "durable": t.durable,
                "every": c.every, "keep": c.keep}

    # -- public API ----------------------------------------------------------------------------
    @property
    def overlapped(self) -> bool:
        return bool(self._guards)

    def save(self, step: int, state: dict, *, urgent: bool = False) -> SaveHandle:
        """Capture ``state`` as step ``step``; returns once captured. ``urgent`` (the final checkpoint
        on a reclaim notice): commit the shm tier before any directory write competes for the CPU."""
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.wait_staged()
        self._persister.begin(step)
        try:
            tensors, objects = flatten(state)
            plan, slot_idx, save_id, use_shm_tier = self._agree(tensors)
        except BaseException:
            self._persister.done(step)
            raise
        index, self._saves = self._saves, self._saves + 1  # the same on every rank: _agree is collective
        handle = SaveHandle(step)
        slot = self._slots[slot_idx]
        slot.free.wait()  # back-pressure: the save that used this slot is still persisting
        slot.free.clear()
        try:
            uncommitted: list[int] = []
            if self.shm_tier is not None and slot.reusable(plan.fingerprint):
                for s in sorted(slot.linked):  # committed shm steps whose data is this slot's bytes
                    self.shm_tier.remove_file(s, mf.MANIFEST)  # ... which are about to change
                    uncommitted.append(s)
            slot.linked.clear()
            rf = plan.files[self.rank]
            shm_dir = self.shm_tier.root / "slots" if self.shm_tier is not None else None
            slot.allocate(rf, plan.fingerprint, shm_dir, {n: e.dtype for n, e in plan.entries.items()})
            for other in self._slots:  # a step saved again lives in this slot now
                if other.step == step:
                    other.step = -1
            slot.step = step
            immediate, deferred = self._copies(rf, slot, tensors)
            _copy_all(immediate)
            objs = [(o.path, json.loads(json.dumps(o.value))) for o in objects] if self.rank == 0 else []
        except BaseException:
            slot.free.set()
            self._persister.done(step)
            raise
        def due(t: Tier) -> bool:
            return self._config[t.name].due(index)

        fast = [t for t in self.tiers  # (the fast tiers are the DirTiers)
                if isinstance(t, DirTier) and t.fast and due(t) and (t is not self.shm_tier or use_shm_tier)]
        if self.shm_tier in fast:  # its commit hard-links this slot: remember which step it holds
            for other in self._slots:
                other.linked.discard(step)
            slot.linked.add(step)
        remote = [q for q in self._remote if due(q.tier)]
        job = PersistJob(step, save_id, plan, slot, deferred, objs, fast, remote, handle,
                         shm_tier=self.shm_tier, urgent=urgent,
                         shm_uncommitted=uncommitted,  # recorded in the status file off the stall path
                         key=self.key)
        for q in remote:
            handle._add_part(q.tier.name)
        self._durability.saved(step, time.time())
        if deferred:
            if any(src.is_cuda for _, src in deferred):  # the copy starts after what is queued now
                job.ready = torch.cuda.Event()
                job.ready.record()
            self._copier.submit(self._copy_deferred, job)
        else:
            handle._staged.set()
        self._last = handle
        self._pending = [h for h in self._pending if not h.done()] + [handle]
        job.t_return = handle._t_return = time.perf_counter()
        handle.stall_s = job.t_return - t0
        self._persister.submit(job)
        return handle

    def wait_staged(self) -> None:
        """Block until the last save's state is fully copied (overlapped mode)."""
        if self._last is not None:
            self._last._staged.wait()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending save is committed or failed (errors are raised by handles)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for h in list(self._pending):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h._done.wait(left):
                raise TimeoutError(f"step {h.step} not committed within {timeout_s} s (pending: {h.pending})")

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for pending saves, stop the background threads and free the staging buffers.
        ``timeout_s`` bounds the wait for slow tiers: what they have not taken by then is abandoned
        (its handles fail; the steps stay in the fast tiers)."""
        if self._closed:
            return
        self._closed = True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._persister.close()  # the persist thread finishes every queued save's fast tiers first
        for q in self._remote:
            q.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for h in list(self._pending):
            h._done.wait()
        self._copier.shutdown(wait=True)
        for h in self._hooks:
            h.remove()
        for s in self._slots:
            s.release()
        self._persister.free()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Committed steps in any of this checkpointer's tiers, ascending (lists every tier)."""
        from tidal.ckpt.api import steps

        return steps(self._read_spec)

    def status(self) -> CheckpointStatus:
        """Which tiers hold each step, per-tier backlog and errors, durable lag. No I/O. Authoritative on
        rank 0, which also writes it to ``status_path`` after every change."""
        return self._durability.snapshot()

    # -- planning --------------------------------------------------------------------------------
    def _agree(self, tensors: list[TensorEntry]) -> tuple[SavePlan, int, str, bool]:
        descs = [PieceDesc(e.name, e.path, e.dtype, e.global_shape, e.box, e.placement) for e in tensors]
        names = [d.name for d in descs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:5]
            raise StateError(f"state has entries whose paths collide when joined with '/': {dup}")
        proposal: dict[str, Any] = {"pieces": [d.to_json() for d in descs] if self.world_size > 1 else [],
                                    "host": self._host, "shm": self.shm_tier is not None}
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
        else:
            if self.world_size == 1:
                plan = make_plan([descs])
            else:
                plan = make_plan([[PieceDesc.from_json(v) for v in g["pieces"]] for g in gathered])
            self._plan_cache = (key, plan)
            self._check_shm_room(plan)
        same_node = all(g["host"] == gathered[0]["host"] and g["shm"] for g in gathered)
        use_shm = same_node and self.shm_tier is not None
        return plan, int(gathered[0]["slot"]), str(gathered[0]["save_id"]), use_shm

    def _check_shm_room(self, plan: SavePlan) -> None:
        if self.shm_tier is None:
            return
        need = plan.files[self.rank].size_bytes * len(self._slots)
        if not shm_has_room(self.shm_tier.root, need):
            log.warning("node shared memory at %s lacks %.2f GiB for staging; using private memory and "
                        "skipping the shm tier", self.shm_tier.root, need / 2**30)
            for s in self._slots:
                s.release()
            self._slots = [Slot(i) for i in range(len(self._slots))]
            self.shm_tier = None

    def _choose_slot(self) -> int:
        """Rank 0: the slot whose data is oldest (never the one holding the newest step)."""
        def newest(slot: Slot) -> tuple[int, int]:
            return max([slot.step, *slot.linked]), slot.index

        return min(self._slots, key=newest).index

    def _copies(self, rf, slot: Slot, tensors: list[TensorEntry]):
        by_name = {e.name: e for e in tensors}
        guarded = self._guarded_storages() if self._guards else set()
        immediate, deferred = [], []
        for p in rf.pieces:
            src = by_name[p.name].local
            pair = (slot.views[p.key], src)  # copied under no_grad: no detach needed
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

    # -- background copy (overlapped mode) ------------------------------------------------------
    def _copy_deferred(self, job: PersistJob) -> None:
        try:
            ready = job.ready
            if ready is None:
                _copy_all(job.deferred)
            else:  # device-to-host on a side stream, so it overlaps the next forward/backward
                if self._side_stream is None:
                    self._side_stream = torch.cuda.Stream()
                with torch.cuda.stream(self._side_stream):
                    self._side_stream.wait_event(ready)
                    _copy_all(job.deferred)
        except BaseException as e:
            job.copy_error = e
        finally:
            job.handle._staged.set()


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every ``src`` into its slot view ``dst``: host tensors in one batched call (a per-tensor
    ``copy_`` costs ~1 us of Python each); device tensors asynchronously, then one synchronize."""
    if not pairs:
        return
    with torch.no_grad():
        host = [p for p in pairs if p[1].is_cpu]
        if host:
            torch._foreach_copy_([d for d, _ in host], [s for _, s in host])
        device = [p for p in pairs if not p[1].is_cpu] if len(host) < len(pairs) else []
        for d, s in device:
            d.copy_(s, non_blocking=True)  # into pinned slot memory: asynchronous DMA
        if any(s.is_cuda for _, s in device):
            torch.cuda.current_stream().synchronize()  # the calling thread's stream, not the device


def _as_list(guard: Any) -> list:
    if guard is None:
        return []
    if isinstance(guard, Iterable) and not hasattr(guard, "param_groups"):
        return list(guard)
    return [guard]


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()

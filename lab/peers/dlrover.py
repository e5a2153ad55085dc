"""DLRover's flash checkpoint (``dlrover.trainer.torch.flash_checkpoint``, PyPI ``dlrover``)
under the protocol.

``DdpCheckpointer(dir).save_checkpoint(step, state, path, StorageType.DISK)`` copies the state into a
shared-memory buffer (the stall) and queues the step to DLRover's saver process, which ``torch.save``s the
buffer to ``path`` and then writes the step into ``dlrover_latest.txt`` (fsynced; the data file is not).
Without ``dlrover-run`` the checkpointer starts that saver process itself (what its docs describe for
plain ``torchrun``/``python``); this adapter starts it the same way (``start_saver_process``), but before
the state is built, where ``dlrover-run``'s agent would have it.

* ``stall_s``: ``save_checkpoint`` returned (the shared-memory copy is done; training may go on).
* ``tracker_s``: ``dlrover_latest.txt`` names the step (polled every millisecond, not with
  ``wait_latest_checkpoint``, which polls every 3 s).
* ``durable_s``: ``tracker_s`` plus an fsync of the files DLRover wrote (as ``torch_save durable_s``).
* loads: ``load_s`` = ``load_checkpoint()`` (from the shared-memory buffer) copied into the target;
  ``load_disk_s`` = what it does when that buffer is gone, ``torch.load`` of the step's file, copied in.
  No resharded load: a DDP flash checkpoint is one whole state per node (its FSDP and Megatron engines
  reshard through DCP/Megatron, which need a process group and their model wrappers).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from lab.peers.protocol import Context, Engine, copy_into, fsync_tree, main

TRACKER = "dlrover_latest.txt"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # DLRover names its shared memory and sockets after it
POLL_S = 0.001
DURABLE_TIMEOUT_S = 600.0


class FlashDisk(Engine):
    notes = (
        "stall_s: save_checkpoint(step, state, path, StorageType.DISK) returned (copy into DLRover's "
        "shared-memory buffer); tracker_s: its saver process wrote the step into dlrover_latest.txt; "
        "durable_s: tracker_s + fsync of the step's files (DLRover fsyncs the tracker only)",
        "load_s: load_checkpoint() from the shared-memory buffer, copied into the target; load_disk_s: "
        "torch.load of the step's file (what load_checkpoint does without the buffer), copied in; "
        "no resharded load (a DDP flash checkpoint holds one whole state)",
    )

    def __init__(self, ctx: Context) -> None:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        self.ctx, self.disk = ctx, StorageType.DISK
        self.dir = ctx.root / "dlrover"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cp = DdpCheckpointer(str(self.dir))
        self.last: Path | None = None

    def _path(self, step: int) -> Path:
        return self.dir / str(step) / "rank_0.pt"

    def _tracker_step(self) -> int | None:
        try:
            return int((self.dir / TRACKER).read_text().strip())
        except (OSError, ValueError):
            return None

    def save(self, step: int) -> dict[str, float]:
        path = self._path(step)
        t0 = time.perf_counter()
        self.cp.save_checkpoint(step, self.ctx.state, str(path), storage_type=self.disk)
        t1 = time.perf_counter()
        while self._tracker_step() != step:
            if time.perf_counter() - t1 > DURABLE_TIMEOUT_S:
                raise TimeoutError(f"step {step} not in {TRACKER} after {DURABLE_TIMEOUT_S:.0f} s "
                                   "(the saver skipped it or died)")
            time.sleep(POLL_S)
        t2 = time.perf_counter()
        fsync_tree(path.parent)
        t3 = time.perf_counter()
        if self.last is not None and self.last != path.parent:  # keep only the newest step, as the others do
            for p in self.last.glob("*"):
                p.unlink()
            self.last.rmdir()
        self.last = path.parent
        return {"stall_s": t1 - t0, "tracker_s": t2 - t0, "durable_s": t3 - t0}

    def loads(self):
        return {"memory": self._load_memory, "disk": self._load_disk}

    def _load_memory(self, target: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        loaded = self.cp.load_checkpoint()
        if not loaded:
            raise RuntimeError("load_checkpoint() returned nothing")
        copy_into(target, loaded)
        return {"load_s": time.perf_counter() - t0}

    def _load_disk(self, target: dict) -> dict[str, float]:
        if self.last is None:
            raise RuntimeError("no step saved")
        t0 = time.perf_counter()
        loaded = torch.load(self.last / "rank_0.pt", map_location="cpu", weights_only=False)
        copy_into(target, loaded)
        return {"load_disk_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.cp._engine.close()
        remove_leftovers()


def remove_leftovers() -> None:
    """Remove what DLRover leaves behind for this run: its shared-memory buffer and its sockets."""
    from dlrover.python.common.multi_process import SOCKET_TMP_DIR

    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        return
    for p in Path("/dev/shm").glob(f"{run_id}_*"):
        p.unlink(missing_ok=True)
    shutil.rmtree(Path(SOCKET_TMP_DIR) / run_id, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path(SOCKET_TMP_DIR).rmdir()  # only if no other run's sockets are there


def start_saver() -> None:
    """Start DLRover's saver process before the state exists, as ``dlrover-run``'s agent would have.

    Left to the checkpointer, it is forked from the process already holding the state and its torch
    threads; there, under load, its sockets once took longer than DLRover's fixed 60 s to come up.
    """
    from dlrover.trainer.torch.flash_checkpoint.engine import CheckpointEngine, start_saver_process

    # Names of DLRover's shared-memory buffers and sockets carry the run id: one of its own per run.
    os.environ[RUN_ID_ENV] = f"tidal-bench-{uuid.uuid4().hex[:8]}"
    atexit.register(remove_leftovers)  # also when an engine fails before it could be closed
    CheckpointEngine.saver_proc = start_saver_process()  # the engine starts none while this is set


def open_engines(ctx: Context) -> dict[str, Engine | BaseException]:
    try:
        return {"dlrover_flash": FlashDisk(ctx)}
    except Exception as e:  # noqa: BLE001 (reported as the reason it cannot run here)
        return {"dlrover_flash": e}


if __name__ == "__main__":
    raise SystemExit(main("dlrover", ["dlrover"], open_engines, prepare=start_saver))

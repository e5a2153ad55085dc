"""ByteCheckpoint (PyPI ``bytecheckpoint``) under the protocol:
``bytecheckpoint.save(..., fast_saving=True)``.

ByteCheckpoint 0.0.2 declares ``torch<=2.5.0``; it is installed with ``--no-deps`` next to torch 2.13 (its
own check, ``torch.__version__ < "2.6.0"``, compares strings and lets "2.13.0" through). It needs a
process group: a one-rank gloo group is made here. Its DDP checkpointer takes the model and optimizer
themselves (not a state dict) and saves ``model.state_dict()`` and ``optimizer.state_dict()``: the same
tensors as the other engines.

* ``stall_s``: ``save(..., fast_saving=True)`` returned: planning (cached after the first save), the
  copy of every tensor (``clone`` on CPU: its pinned-memory pool needs CUDA, so
  ``BYTECHECKPOINT_ENABLE_PINNED_MEM_D2H=0``) and the hand-off to its I/O thread.
  Measured here, that call returns only once the files are written: ``DDPCheckpointer.save`` makes a
  new ``DDPSavePlanner`` per call and looks its plan cache up before the planner holds the state, so
  every save misses the cache ("Plan cache miss. The model/optimizer appears for the first time" in its
  debug log) and takes the first-save path, which writes synchronously.
* ``durable_s``: its ``callback`` ran (files written and fsynced, tracker written), plus an fsync of the
  step's directory.
* ``load_disk_s``: ``load(..., fast_loading=True)`` into a second model + Adam of the same shapes
  (built with another seed, so a load that did nothing is caught), ``load_state_dict`` included.
  No resharded load here: ByteCheckpoint reshards FSDP checkpoints between process groups of different
  sizes, which this one-process benchmark does not run.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from lab.peers.protocol import Context, Engine, copy_into, fsync_tree, main
from tidal import ckpt
from tidal.bench.ckpt_state import build_state

DURABLE_TIMEOUT_S = 600.0


class FastSaving(Engine):
    notes = (
        "stall_s: bytecheckpoint.save(dir, {'model', 'optimizer'}, framework='ddp', fast_saving=True) "
        "returned (tensors cloned; BYTECHECKPOINT_ENABLE_PINNED_MEM_D2H=0 without CUDA); durable_s: its "
        "callback ran (files fsynced, tracker written) + fsync of the step directory",
        "load_disk_s: bytecheckpoint.load(step dir, ..., fast_loading=True) into a second model + Adam, "
        "load_state_dict included; no resharded load (FSDP resharding needs process groups of other sizes)",
        "runs with torch 2.13 although it declares torch<=2.5.0 (installed --no-deps)",
        "every DDP save misses its plan cache (a new planner per call, looked up before it holds the "
        "state), so fast_saving=True writes synchronously, as a first save does: stall_s ~ durable_s",
    )

    def __init__(self, ctx: Context) -> None:
        import bytecheckpoint as bcp
        import torch.distributed as dist

        self.bcp, self.ctx = bcp, ctx
        self.dir = ctx.root / "bytecheckpoint"
        self.dir.mkdir(parents=True, exist_ok=True)
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"file://{ctx.root / 'pg-store'}", rank=0, world_size=1
            )
        self.last: int | None = None
        self._other: tuple | None = None

    def _step_dir(self, step: int) -> str:
        return os.path.join(str(self.dir), f"global_step_{step}")

    def save(self, step: int) -> dict[str, float]:
        done = threading.Event()
        t0 = time.perf_counter()
        self.bcp.save(str(self.dir), {"model": self.ctx.model, "optimizer": self.ctx.optimizer},
                      framework="ddp", fast_saving=True, global_steps=step, callback=done.set)
        t1 = time.perf_counter()
        if not done.wait(DURABLE_TIMEOUT_S):
            raise TimeoutError(f"step {step}: no completion callback after {DURABLE_TIMEOUT_S:.0f} s")
        path = self._step_dir(step)
        if not os.path.isdir(path):
            raise RuntimeError(f"step {step}: no directory {path} after the callback")
        fsync_tree(Path(path))
        t2 = time.perf_counter()
        if self.last is not None:
            shutil.rmtree(self._step_dir(self.last), ignore_errors=True)
        self.last = step
        return {"stall_s": t1 - t0, "durable_s": t2 - t0}

    def loads(self):
        return {"disk": self._load}

    def _load(self, target: dict) -> dict[str, float]:
        if self.last is None:
            raise RuntimeError("no step saved")
        if self._other is None:  # same shapes, other values
            model, opt, _, _ = build_state(self.ctx.size_bytes, seed=self.ctx.seed + 1)
            self._other = (model, opt)
        model, opt = self._other
        t0 = time.perf_counter()
        self.bcp.load(self._step_dir(self.last), {"model": model, "optimizer": opt}, framework="ddp",
                      fast_loading=True)
        dt = time.perf_counter() - t0
        copy_into(target, ckpt.training_state(model, opt))
        return {"load_disk_s": dt}


def open_engines(ctx: Context) -> dict[str, Engine | BaseException]:
    os.environ.setdefault("BYTECHECKPOINT_ENABLE_PINNED_MEM_D2H", "0")
    try:
        return {"bytecheckpoint": FastSaving(ctx)}
    except Exception as e:  # noqa: BLE001 (reported as the reason it cannot run here)
        return {"bytecheckpoint": e}


if __name__ == "__main__":
    raise SystemExit(main("bytecheckpoint", ["bytecheckpoint"], open_engines))

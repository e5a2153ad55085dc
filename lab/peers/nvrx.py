"""NVIDIA's nvidia-resiliency-ext (PyPI ``nvidia-resiliency-ext``) checkpointing under the protocol.

Two engines, both tried as their documentation shows them:

* ``nvrx_async``: ``TorchAsyncCheckpoint().async_save(state, path)`` (an async ``torch.save``: tensors
  preloaded to host memory, written by a persistent background process);
  ``finalize_async_save(blocking=True)`` waits until it is written. ``stall_s``: ``async_save``
  returned; ``durable_s``: finalized + fsync of the file.
* ``nvrx_local``: ``LocalCheckpointManager(dir).save(BasicTensorAwareStateDict(state), step,
  is_async=True)`` (node-local checkpoints, optionally replicated to peers); the returned request's
  ``execute_sync()`` + finalize functions complete it. ``load_s``: ``find_latest()`` + ``load()``, copied
  into the target.

Both are written for CUDA tensors (``async_save`` calls ``torch.cuda.synchronize()``;
``BasicTensorAwareStateDict`` asserts ``tensor.is_cuda``). Where that fails here, the engine's first save
raises and the engine is reported with that error as the reason.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lab.peers.protocol import Context, Engine, copy_into, fsync_tree, main


def _process_group(ctx: Context) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{ctx.root / 'pg-store'}", rank=0, world_size=1)


class AsyncTorchSave(Engine):
    notes = (
        "stall_s: TorchAsyncCheckpoint.async_save(state, path) returned; durable_s: "
        "finalize_async_save(blocking=True) + fsync of the file; no resharded load (one torch.save file)",
    )

    def __init__(self, ctx: Context) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

        _process_group(ctx)
        self.ctx = ctx
        self.dir = ctx.root / "nvrx-async"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ack = TorchAsyncCheckpoint()
        self.last: Path | None = None

    def save(self, step: int) -> dict[str, float]:
        path = self.dir / f"step-{step}.pt"
        t0 = time.perf_counter()
        self.ack.async_save(self.ctx.state, path)
        t1 = time.perf_counter()
        self.ack.finalize_async_save(blocking=True)
        fsync_tree(path)
        t2 = time.perf_counter()
        if self.last is not None:
            self.last.unlink(missing_ok=True)
        self.last = path
        return {"stall_s": t1 - t0, "durable_s": t2 - t0}

    def loads(self):
        return {"disk": self._load}

    def _load(self, target: dict) -> dict[str, float]:
        assert self.last is not None, "a load after a save"
        t0 = time.perf_counter()
        copy_into(target, torch.load(self.last, map_location="cpu", weights_only=False))
        return {"load_disk_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.ack.finalize_async_save(blocking=True, terminate=True)


class Local(Engine):
    notes = ("stall_s: LocalCheckpointManager.save(BasicTensorAwareStateDict(state), step, is_async=True) "
             "returned; durable_s: the request executed and finalized + fsync of the step's files; "
             "load_s: find_latest() + load(), copied into the target",)

    def __init__(self, ctx: Context) -> None:
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        _process_group(ctx)
        self.ctx, self.wrap = ctx, BasicTensorAwareStateDict
        self.dir = ctx.root / "nvrx-local"
        self.manager = LocalCheckpointManager(str(self.dir))

    def save(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        request = self.manager.save(self.wrap(self.ctx.state), step, is_async=True)
        t1 = time.perf_counter()
        request.execute_sync()
        request.execute_finalize_fns(validate_matching_call_idx=False)
        fsync_tree(self.dir)
        t2 = time.perf_counter()
        return {"stall_s": t1 - t0, "durable_s": t2 - t0}

    def loads(self):
        return {"memory": self._load}

    def _load(self, target: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        self.manager.find_latest()
        loaded, _ = self.manager.load()
        copy_into(target, loaded.state_dict if hasattr(loaded, "state_dict") else loaded)
        return {"load_s": time.perf_counter() - t0}


def open_engines(ctx: Context) -> dict[str, Engine | BaseException]:
    out: dict[str, Engine | BaseException] = {}
    for name, cls in (("nvrx_async", AsyncTorchSave), ("nvrx_local", Local)):
        try:
            out[name] = cls(ctx)
        except Exception as e:  # noqa: BLE001 (reported as the reason it cannot run here)
            out[name] = e
    return out


if __name__ == "__main__":
    raise SystemExit(main("nvidia-resiliency-ext", ["nvidia-resiliency-ext"], open_engines))

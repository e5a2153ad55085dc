"""Part 3 of ``tidal bench tiers``: training throughput with no checkpoints, Tidal through every tier,
Tidal with S3 every 6th save, and DCP ``async_save`` to the same bucket, in interleaved rounds."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal import ckpt
from tidal.bench.tiers_env import Env

MIB = 1 << 20


def _model(model_mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    width = max(64, int((model_mb * MIB / 4 / 3) ** 0.5))  # three width x width layers
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), width


def _dcp_s3_kwargs(env: Env) -> dict:
    """Make DCP's ``FsspecWriter`` write to S3 through obstore's fsspec adapter (s3fs would pull an
    aiobotocore that pins an older botocore than boto3's). obstore keeps a reference to the buffer a
    ``write`` gets instead of copying it, and ``torch.save`` reuses its buffers, so writes copy."""
    import fsspec
    from obstore.fsspec import BufferedFile, FsspecStore

    class _CopyingFile(BufferedFile):
        def write(self, data: Any) -> int:
            return super().write(bytes(data))

    class _Store(FsspecStore):
        protocol = "s3"
        asynchronous = False

        def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: Any = True,
                  cache_options: Any = None, **kwargs: Any) -> BufferedFile:
            return _CopyingFile(self, path, "wb" if mode == "wb" else "rb", **kwargs)

    fsspec.register_implementation("s3", _Store, clobber=True)
    sw = env.seaweed
    return {"config": {"endpoint": sw.endpoint, "region": sw.region, "access_key_id": sw.access_key,
                       "secret_access_key": sw.secret_key}, "client_options": {"allow_http": True}}


class _Trainer:
    """One mode's model, optimizer and checkpointing, trained in segments (``segment``) that start with
    a save and save every ``interval_s`` after, so each save's background work falls inside the timed
    segment that made it (when it takes less than ``interval_s``)."""

    def __init__(self, mode: str, env: Env, model_mb: float, batch: int, interval_s: float) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.mode, self.env, self.interval_s, self.dcp = mode, env, interval_s, dcp
        self.model, self.opt, self.width = _model(model_mb)
        self.x, self.y = torch.randn(batch, self.width), torch.randn(batch, self.width)
        self.cp: ckpt.Checkpointer | None = None
        self.stager, self.kw = None, {}
        self.pending: Any = None  # DCP's async save in flight
        if mode.startswith("tidal"):
            every = 6 if mode == "tidal_s3_every_6" else 1
            tiers = ["shm", env.peer(mode, keep=2), {"url": str(env.disk / mode), "keep": 2},
                     {"url": env.s3_url(mode), "keep": 2, "every": every}]
            self.cp = ckpt.Checkpointer(tiers=tiers, guard=self.opt)
        elif mode == "dcp_async":
            self.kw = _dcp_s3_kwargs(env)
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=False))
        self.step, self.saves = 0, 0
        self.calls: list[float] = []
        self.rates: list[float] = []
        self.cpu = {"this process": 0.0, "agents": 0.0, "S3 server": 0.0}  # CPU seconds, summed over segments
        self.wall = 0.0

    def _train_step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        staging = getattr(self.pending, "staging_completion", None)
        if staging is not None and not staging.done():
            staging.result()  # DCP: the state may change only once staged
        self.opt.step()
        self.step += 1

    def _save(self) -> None:
        state = ckpt.training_state(self.model, self.opt, extra={"step": self.step})
        t0 = time.perf_counter()
        if self.cp is not None:
            self.cp.save(self.step, state)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            if self.pending is not None:
                _upload(self.pending).result()  # one async save at a time
            w = FsspecWriter(self.env.s3_url(f"dcp/step{self.step}"), **self.kw)
            self.pending = self.dcp.async_save(state, storage_writer=w, async_stager=self.stager,
                                               no_dist=True)
        self.calls.append(time.perf_counter() - t0)
        self.saves += 1

    def drain(self) -> None:
        if self.cp is not None:
            self.cp.wait()
        elif self.pending is not None:
            _upload(self.pending).result()
            self.pending = None

    def warm_up(self) -> None:
        """Untimed: a few steps, and two saves (one per staging slot; DCP's stager allocates on its first)."""
        for _ in range(3):
            self._train_step()
        if self.mode != "none":
            for _ in range(2):
                self._save()
                self._train_step()
                self.drain()
            self.saves, self.calls = 0, []

    def _cpu(self) -> dict[str, float]:
        e = self.env
        return {"this process": time.process_time(), "agents": _cpu_s(e.a.pid) + _cpu_s(e.b.pid),
                "S3 server": _cpu_s(e.seaweed.proc.pid if e.seaweed.proc else None)}

    def segment(self, seconds: float) -> None:
        c0 = self._cpu()
        t0 = time.perf_counter()
        steps0, saved = self.step, 0
        while (now := time.perf_counter()) - t0 < seconds:
            if self.mode != "none" and now - t0 >= saved * self.interval_s:
                self._save()
                saved += 1
            self._train_step()
        self.rates.append((self.step - steps0) / (time.perf_counter() - t0))
        self.drain()  # normally already done: the last save was interval_s ago
        self.wall += time.perf_counter() - t0
        c1 = self._cpu()
        for k in self.cpu:
            self.cpu[k] += c1[k] - c0[k]

    def close(self) -> None:
        if self.cp is not None:
            self.cp.close()
        if self.stager is not None:
            self.stager.close()

    def result(self) -> dict:
        return {"mode": self.mode, "steps_per_s": statistics.mean(self.rates),
                "segment_steps_per_s": self.rates, "saves": self.saves,
                "save_call_s_median": statistics.median(self.calls) if self.calls else 0.0,
                "state_mib": sum(t.numel() * 4 for t in self.model.parameters()) * 3 / MIB,
                "width": self.width,
                "cpu_per_s": {k: v / self.wall for k, v in self.cpu.items()} if self.wall else {}}


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its threads; 0 where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _upload(resp: Any) -> Any:
    """The upload future of what ``dcp.async_save`` returned (an AsyncSaveResponse or a Future)."""
    return getattr(resp, "upload_completion", resp)


def train(env: Env, seconds: float, interval_s: float, model_mb: float, batch: int,
          log: Callable[[str], None], rounds: int = 3) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    modes = ["none", "tidal", "tidal_s3_every_6", "dcp_async"]
    trainers = {}
    try:
        for m in modes:
            log(f"training: warming up {m}")
            trainers[m] = _Trainer(m, env, model_mb, batch, interval_s)
            trainers[m].warm_up()
        seg = seconds / rounds
        for r in range(rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            log(f"training round {r + 1}/{rounds}: {seg:g} s each of {', '.join(order)}")
            for m in order:
                trainers[m].segment(seg)
        runs = [t.result() for t in trainers.values()]
    finally:
        for t in trainers.values():
            with contextlib.suppress(Exception):
                t.close()
        torch.set_num_threads(threads)
    base = runs[0]["steps_per_s"]
    over = {r["mode"]: 1 - r["steps_per_s"] / base for r in runs[1:]}
    seg_none = runs[0]["segment_steps_per_s"]
    # Paired: each mode against the no-checkpoint segment of the same round (minutes apart, not the
    # whole run), median over rounds - robust to the slow drifts of a shared machine.
    paired = {r["mode"]: statistics.median(1 - a / b for a, b in zip(r["segment_steps_per_s"], seg_none,
                                                                     strict=True)) for r in runs[1:]}
    return {"runs": runs, "baseline_steps_per_s": base, "overhead": over, "overhead_paired": paired,
            "rounds": rounds, "segment_s": seg, "baseline_spread": (max(seg_none) - min(seg_none)) / base,
            "overhead_over_dcp": over["tidal"] / over["dcp_async"] if over["dcp_async"] > 0 else None,
            "overhead_paired_over_dcp": (paired["tidal"] / paired["dcp_async"] if paired["dcp_async"] > 0
                                         else None),
            "threads": 1, "interval_s": interval_s, "batch": batch}

"""``Session``: what a training script holds to be stoppable at any step and resumable on any world size
(docs/train.md: the loop, the call order and collectives, notices, the arguments)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tidal import ckpt
from tidal.ckpt.tiers import config as ckpt_config
from tidal.contract import ENV_CKPT_TIERS, EXIT_FENCED, PHASE_ENDED
from tidal.train.data import GlobalBatchSampler
from tidal.train.env import EXIT_PREEMPTED, NOTICE_WAIT_CHOICES, Env, EnvError
from tidal.train.notice import Notice, Preempted, process_start_unix
from tidal.train.progress import Heartbeat, JsonlWriter, Meter, ProgressWriter, heartbeat_path, progress_path

log = logging.getLogger(__name__)

_RESERVED = ("model", "optim", "train")


class Session:
    """The in-job runtime for one process; arguments left ``None`` come from the environment (:mod:`env`;
    docs/train.md has the table)."""

    def __init__(self, *, ckpt_url: str | os.PathLike | None = None, ckpt_tiers: Sequence[Any] | None = None,
                 ckpt_every_steps: int | None = None,
                 ckpt_every_s: float | None = None, keep: int | None = None, grace_s: float | None = None,
                 notice_file: str | os.PathLike | None = None, notice_wait: str | None = None,
                 progress_dir: str | os.PathLike | None = None, writers: Iterable[ProgressWriter] = (),
                 device: str | torch.device | None = None, backend: str | None = None, overlap: bool = False,
                 timeout_s: float | None = None, env: Env | None = None,
                 exit_fn: Callable[[int], object] = os._exit) -> None:
        self.env = env if env is not None else Env.from_environ()
        e = self.env
        if ckpt_url is not None and ckpt_tiers is not None:
            raise ValueError("give the checkpoint location once: ckpt_url or ckpt_tiers")
        tiers = ckpt_tiers if ckpt_tiers is not None else e.ckpt_tiers if ckpt_url is None else None
        self.ckpt_tiers: list[Any] | None = list(tiers) if tiers is not None else None
        self.ckpt_url = os.fspath(ckpt_url) if ckpt_url is not None else (None if tiers else e.ckpt_url)
        self.ckpt_every_steps = e.ckpt_interval_steps if ckpt_every_steps is None else int(ckpt_every_steps)
        self.ckpt_every_s = e.ckpt_interval_s if ckpt_every_s is None else float(ckpt_every_s)
        self.keep = e.ckpt_keep if keep is None else int(keep)
        if self.ckpt_tiers is not None:  # a typo in a tier spec fails now, not at the first save
            try:
                ckpt_config.resolve(self.ckpt_tiers, default_keep=self.keep)
            except ckpt.TierSpecError as err:
                where = "ckpt_tiers" if ckpt_tiers is not None else ENV_CKPT_TIERS
                raise EnvError(f"{where}: {err}") from None
        self._control_file = e.control_file
        self._control_mtime: float | None = None
        self.notice_wait = notice_wait or e.notice_wait
        if self.notice_wait not in NOTICE_WAIT_CHOICES:
            raise ValueError(f"notice_wait={self.notice_wait!r}: expected one of {list(NOTICE_WAIT_CHOICES)}")
        self.overlap = overlap
        self._exit_fn = exit_fn

        # Notices first: a SIGTERM during the rendezvous below is a notice too, not a kill.
        self.notice = Notice(e.grace_s if grace_s is None else grace_s,
                             notice_file if notice_file is not None else e.notice_file, exit_fn=exit_fn)
        self.notice.install()

        if device is None:
            device = torch.device("cuda", e.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._owns_pg = not dist.is_initialized() and e.launched
        if self._owns_pg:
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            dist.init_process_group(self.backend, timeout=timeout,
                                    device_id=self.device if self.device.type == "cuda" else None)
        self.distributed = dist.is_initialized()
        if self.distributed:
            self.backend = dist.get_backend()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.local_rank = e.local_rank

        pdir = progress_dir if progress_dir is not None else e.progress_dir
        self.progress_dir = os.fspath(pdir) if pdir is not None else None
        self._writers: list[ProgressWriter] = list(writers)
        self._heartbeat: Heartbeat | None = None
        if self.progress_dir is not None:
            self._writers.append(JsonlWriter(progress_path(self.progress_dir, self.rank)))
            self._heartbeat = Heartbeat(heartbeat_path(self.progress_dir, self.rank), rank=self.rank)
        self.step = 0
        self.last_loss: float | None = None  # the mean over ranks of the loss passed to the last step_done
        self.committed: dict[str, int] = {}  # tier -> newest step committed there (as far as we know)
        self._meter = Meter()
        self._first_step_reported = False
        self._cp: ckpt.Checkpointer | None = None
        self._pending: list[ckpt.SaveHandle] = []
        # a watcher records each commit as it happens, not at the next step
        self._io_lock = threading.RLock()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._last: ckpt.SaveHandle | None = None
        self._last_ckpt_mono = time.monotonic()
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._sampler: GlobalBatchSampler | None = None
        self._extra: dict[str, Any] = {}
        self._registered = False
        self._warned_unregistered = False
        self._closed = False
        self._beat("starting", force=True)
        self._write({"event": "start", "world_size": self.world_size, "pid": os.getpid(),
                     "host": socket.gethostname(), "device": str(self.device), "backend": self.backend,
                     "uptime_s": self.uptime_s(), "ckpt_every_steps": self.ckpt_every_steps,
                     "ckpt_every_s": self.ckpt_every_s})

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ckpt_target(self) -> str | list[Any] | None:
        """Where checkpoints go and come from: the tier list, else the directory; ``None``: nowhere."""
        return self.ckpt_tiers if self.ckpt_tiers is not None else self.ckpt_url

    @staticmethod
    def uptime_s() -> float:
        """Seconds since this process started."""
        return time.time() - process_start_unix()

    def restore(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                sampler: GlobalBatchSampler | None = None, *, extra: dict[str, Any] | None = None) -> int:
        """Register what to checkpoint (any layout; ``extra``: your tensors and JSON values) and load the
        newest committed step into it, resharded; return that step (0: none). Collective."""
        if optimizer is not None and model is None:
            raise ValueError("restore(optimizer=...) needs the model too")
        bad = sorted(set(extra or {}) & set(_RESERVED))
        if bad:
            raise ValueError(f"extra keys {bad} are reserved ({list(_RESERVED)})")
        self._model, self._optimizer, self._sampler = model, optimizer, sampler
        self._extra = extra if extra is not None else {}
        self._registered = True
        t0 = time.monotonic()
        self._beat("restoring", force=True)
        record: dict[str, Any] = {"event": "restore", "step": 0, "tier": None}
        target = self.ckpt_target
        if target is not None:
            self._ensure_checkpointer()
            committed = ckpt.steps(target)
            # Ranks may see different tiers (another node's memory): agree on a step all of them see.
            step = self._all_min(committed[-1] if committed else -1)
            if step >= 0:
                state = self._state(0)
                stats = ckpt.LoadStats()
                got = ckpt.load(target, state, step=step, stats=stats, fallback_older=True)
                if model is not None:
                    ckpt.apply_training_state(model, optimizer, state)
                saved = state["train"]
                if sampler is not None and saved.get("data") is not None:
                    sampler.load_state_dict(saved["data"])
                for k in self._extra:
                    self._extra[k] = state[k]
                self.step = int(saved["step"])
                if self.step != got:
                    log.warning("checkpoint step %d holds train.step=%d; continuing from %d", got, self.step,
                                self.step)
                self.committed[stats.manifest_tier] = got
                record.update(step=self.step, tier=stats.manifest_tier, bytes_read=stats.bytes_read,
                              read_amplification=round(stats.read_amplification, 4),
                              fallbacks=stats.fallbacks[:5], saved_world_size=saved.get("world_size"))
                if stats.skipped_steps:
                    record["skipped_steps"] = stats.skipped_steps[:5]
        record.update(duration_s=time.monotonic() - t0, uptime_s=self.uptime_s())
        self._write(record)
        if self.is_main:
            if record["tier"]:
                log.info("restored step %d from tier %s in %.2f s (saved on %s ranks, now %d)",
                         self.step, record["tier"], record["duration_s"], record.get("saved_world_size"),
                         self.world_size)
            else:
                log.info("no committed checkpoint%s: starting at step 0",
                         f" in {ckpt_config.describe(target)}" if target is not None
                         else " location (TIDAL_CKPT_URL and TIDAL_CKPT_TIERS unset)")
        self._last_ckpt_mono = time.monotonic()
        self._meter.reset()
        # a notice while restoring: the step just loaded is committed, stop before training another
        if self._agree(self.notice.requested(), False, None)[0]:
            self._preempt(self.step, save=False)
        self._beat("training", force=True)
        return self.step

    def step_done(self, step: int, *, loss: float | torch.Tensor | None = None, samples: int | None = None,
                  tokens: int | None = None, **fields: Any) -> None:
        """Optimizer step ``step`` is done (collective; every rank passes ``loss`` or none does): record
        it, checkpoint when due, on a notice checkpoint and raise :class:`Preempted`. ``samples``/``tokens``:
        this step's global counts (``samples`` defaults to the sampler's global batch)."""
        now = time.monotonic()
        self.step = step
        self._poll_saves()
        if self._control_file is not None:
            self._poll_control()
        want_stop = self.notice.requested()
        time_due = self.ckpt_every_s > 0 and now - self._last_ckpt_mono >= self.ckpt_every_s
        stop, time_due, loss_mean = self._agree(want_stop, time_due, loss)
        self.last_loss = loss_mean
        if samples is None and self._sampler is not None:
            samples = self._sampler.global_batch
        rec: dict[str, Any] = {"event": "step", "step": step, "loss": loss_mean,
                               **self._meter.step(now, samples, tokens), "committed": dict(self.committed)}
        if not self._first_step_reported:
            rec["uptime_s"] = self.uptime_s()
            self._first_step_reported = True
        rec.update(fields)
        self._write(rec)
        self._beat("training")
        if stop:
            self._preempt(step)
        step_due = self.ckpt_every_steps > 0 and step % self.ckpt_every_steps == 0
        if step_due or time_due:
            self.checkpoint(step, reason="steps" if step_due else "seconds")

    def _poll_control(self) -> None:
        """Apply ``TIDAL_CONTROL_FILE`` when it changed (one ``stat`` per step otherwise)."""
        assert self._control_file is not None
        try:
            mtime = os.stat(self._control_file).st_mtime_ns
        except OSError:
            return
        if mtime == self._control_mtime:
            return
        self._control_mtime = mtime
        try:
            with open(self._control_file, encoding="utf-8") as f:
                settings = json.load(f)
            interval = settings.get("ckpt_interval_s") if isinstance(settings, dict) else None
            if interval is not None and (not isinstance(interval, (int, float)) or interval < 0):
                raise ValueError(f"ckpt_interval_s={interval!r}: expected a number of seconds >= 0")
        except (OSError, ValueError) as err:  # a bad control file must not stop training
            log.warning("ignoring control file %s: %s", self._control_file, err)
            return
        if interval is not None and float(interval) != self.ckpt_every_s:
            self._write({"event": "control", "ckpt_interval_s": float(interval), "was": self.ckpt_every_s})
            if self.is_main:
                log.info("checkpoint interval %g s -> %g s (control file)", self.ckpt_every_s, interval)
            self.ckpt_every_s = float(interval)

    def checkpoint(self, step: int | None = None, *, reason: str = "manual",
                   wait: bool = False) -> ckpt.SaveHandle | None:
        """Save the registered state as ``step`` (default: the last step done; collective), once; return when
        captured, or committed everywhere with ``wait``. ``None``: no location, or no ``restore`` yet."""
        step = self.step if step is None else step
        if self.ckpt_target is None:
            return None
        if not self._registered:
            if not self._warned_unregistered:
                log.warning("checkpoint location set but restore() was never called: nothing to save")
                self._warned_unregistered = True
            return None
        if self._last is not None and self._last.step == step and self._last.error is None:
            h = self._last
        else:
            self._beat("checkpointing", force=True)
            cp = self._ensure_checkpointer()
            h = cp.save(step, self._state(step), urgent=reason == "notice")
            with self._io_lock:
                self._pending.append(h)
            self._start_watcher()
            self._last = h
            self._write({"event": "checkpoint", "step": step, "reason": reason, "stall_s": h.stall_s})
            self._last_ckpt_mono = time.monotonic()
            self._meter.reset()
            self._beat("training", force=True)
        if wait:
            try:
                h.wait()
            except ckpt.FencedError as e:
                self._fenced(step, e)  # exits
                raise
            self._poll_saves()
        return h

    def _ensure_checkpointer(self) -> ckpt.Checkpointer:
        if self._cp is None:
            assert self.ckpt_target is not None
            guard = self._optimizer if self.overlap and self._optimizer is not None else None
            self._cp = ckpt.Checkpointer(self.ckpt_target, keep=self.keep, guard=guard)  # a url or tiers
        return self._cp

    def _state(self, step: int) -> dict[str, Any]:
        train = {"step": step, "world_size": self.world_size, "job_id": self.env.job_id,
                 "data": self._sampler.state_dict() if self._sampler is not None else None}
        extra = {"train": train, **self._extra}
        if self._model is None:
            return extra
        return ckpt.training_state(self._model, self._optimizer, extra=extra)

    def _start_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="tidal-session-commits", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while not self._watch_stop.is_set():
            with self._io_lock:
                h = self._pending[0] if self._pending else None
            if h is None:
                self._watch_stop.wait(0.05)
                continue
            with contextlib.suppress(Exception):  # errors are reported by _poll_saves
                h.wait(timeout=0.05)
            if self._watch_stop.is_set():
                break
            self._poll_saves()

    def _poll_saves(self) -> None:
        with self._io_lock:
            for h in list(self._pending):
                for tier in list(h.committed):
                    if self.committed.get(tier, -1) < h.step:
                        self.committed[tier] = h.step
                if not h.done():
                    continue
                self._pending.remove(h)
                if isinstance(h.error, ckpt.FencedError):
                    self._fenced(h.step, h.error)
                elif h.error is not None:
                    log.warning("checkpoint of step %d failed (committed in: %s): %s", h.step,
                                h.committed or "none", h.error)
                    self._write({"event": "save_failed", "step": h.step, "tiers": list(h.committed),
                                 "error": str(h.error)[:2000]})
                else:
                    self._write({"event": "committed", "step": h.step, "tiers": list(h.committed),
                                 "persist_s": h.persist_s})

    def _fenced(self, step: int, error: BaseException) -> None:
        """The checkpoint location is another job's or attempt's now: exit ``EXIT_FENCED`` at once."""
        self._write({"event": "fenced", "step": step, "error": str(error)[:2000], "exit_code": EXIT_FENCED})
        line = (str(error).splitlines() or ["fenced"])[0]
        print(f"tidal: rank {self.rank}: {line}; exiting with code {EXIT_FENCED}", file=sys.stderr,
              flush=True)
        self._beat("stopped", force=True)
        self._exit_now(EXIT_FENCED)

    def _exit_now(self, code: int) -> None:
        """Flush what the rank printed, then end the process with ``code`` (no interpreter teardown)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._exit_fn(code)

    def _preempt(self, step: int, *, save: bool = True) -> None:
        n = self.notice
        if n.source is None:  # another rank was told; this one stops with it, under its own grace
            n.trigger("peer")
        self._write({"event": "notice", "source": n.source, "received": n.received_unix, "step": step})
        self._beat("stopping", force=True)
        tiers: list[str] = []
        h = self.checkpoint(step, reason="notice") if save else None
        if h is not None:
            while not h.done() and (self.notice_wait == "all" or not h.committed) and n.remaining_s() > 0:
                time.sleep(min(0.002, max(n.remaining_s(), 0.0)))
            tiers = list(h.committed)
        elif not save:  # stopping right after a restore: the restored step is where it was read from
            tiers = [t for t, s in self.committed.items() if s == step]
        self._poll_saves()
        assert n.received_unix is not None
        self._write({"event": "preempted", "step": step, "tiers": tiers, "exit_code": EXIT_PREEMPTED,
                     "notice_to_exit_s": time.time() - n.received_unix})
        if self.is_main:
            log.warning("notice (%s): stopped after step %d; checkpoint committed in %s; exiting with code "
                        "%d", n.source, step, tiers or "no tier", EXIT_PREEMPTED)
        raise Preempted(step, tiers)

    def close(self) -> None:
        """Wait for pending checkpoints, write the ``end`` record, tear the process group down."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._cp is not None:
                self._cp.close()
            self._poll_saves()
            self._write({"event": "end", "step": self.step})
            ended = True
        except BaseException:
            ended = False
            raise
        finally:
            self._teardown(PHASE_ENDED if ended else "stopped")

    def _teardown(self, phase: str = "stopped") -> None:
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        self._beat(phase, force=True)
        for w in self._writers:
            with contextlib.suppress(Exception):
                w.close()
        self._writers = []
        self.notice.uninstall()
        if self._owns_pg and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._owns_pg = False

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        self._closed = True
        preempted = isinstance(exc, Preempted)
        if preempted and self.notice_wait == "fast":  # the fast tier holds the step: hand the GPUs back
            self._teardown()
            self._exit_now(EXIT_PREEMPTED)
        if not preempted:
            self._write({"event": "error", "step": self.step, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        # "all" mode or an exit_fn that returned; after an error only alone (no peer can be missing)
        if self._cp is not None and (preempted or self.world_size == 1):
            with contextlib.suppress(Exception):
                self._cp.close()
        self._teardown()

    def _agree(self, stop: bool, due: bool,
               loss: float | torch.Tensor | None) -> tuple[bool, bool, float | None]:
        if not self.distributed:
            return stop, due, None if loss is None else float(loss)
        t = torch.zeros(3, dtype=torch.float64, device=self._reduce_device())
        t[0], t[1] = float(stop), float(due)
        if loss is not None:
            t[2] = loss.detach().to(torch.float64) if isinstance(loss, torch.Tensor) else float(loss)
        dist.all_reduce(t)
        s, d, total = t.tolist()
        return s > 0, d > 0, None if loss is None else total / self.world_size

    def _reduce_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _all_min(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._reduce_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def write(self, event: str, **fields: Any) -> None:
        """Add a record of your own to this rank's progress stream."""
        self._write({"event": event, "step": self.step, **fields})

    def _write(self, record: dict[str, Any]) -> None:
        if not self._writers:
            return
        rec = {"event": record["event"], "time": time.time(), "job_id": self.env.job_id, "rank": self.rank,
               **{k: v for k, v in record.items() if k != "event"}}
        with self._io_lock:  # the commit watcher writes too
            for w in self._writers:
                try:
                    w.write(rec)
                except Exception as e:  # reporting must never stop training
                    log.warning("progress writer %r failed: %s", w, e)

    def _beat(self, phase: str, *, force: bool = False) -> None:
        if self._heartbeat is not None:
            self._heartbeat.beat(self.step, phase, self._meter.avg_step_time_s, force=force)

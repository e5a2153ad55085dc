"""``tidal bench ckpt``: a checkpoint's stall, commit and load, Tidal next to memcpy, ``torch.save`` and DCP,
on one state in one process, alternating; medians, raw samples in the JSON, :data:`NOTES` say what each is."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal import ckpt
from tidal.bench.ckpt_state import (
    GB,
    RANKS,
    build_state,
    check_equal,
    machine,
    map_tensors,
    row_blocks,
    state_bytes,
    tensors,
    zero,
)
from tidal.ckpt.tiers.directory import SHM_BASE_ENV, shm_root_for

__all__ = ["GB", "RANKS", "build_state", "machine", "resharded_states", "run", "render", "state_bytes"]

# (competitor, metric) pairs in report order; every one is a dict {"samples": [...], "median": x}.
SAVE_METRICS: dict[str, tuple[str, ...]] = {
    "memcpy": ("copy_s",), "tidal": ("stall_s", "handle_stall_s", "commit_s"),
    "tidal_overlapped": ("stall_s", "handle_stall_s", "staged_s", "commit_s"),
    "torch_save": ("save_s", "durable_s"), "dcp_save": ("save_s",),
    "dcp_async": ("return_s", "stall_s", "total_s")}
LOAD_METRICS: dict[str, tuple[str, ...]] = {
    "tidal": ("load_s", "load_disk_s", "load_resharded_s", "load_resharded_read_amplification"),
    "dcp": ("load_s",)}
# name -> (numerator (group, competitor, metric), denominator, target or None)
RATIOS: dict[str, tuple[tuple[str, str, str], tuple[str, str, str], float | None]] = {
    "tidal_stall_over_memcpy": (("save", "tidal", "stall_s"), ("save", "memcpy", "copy_s"), 1.1),
    "overlapped_stall_over_memcpy": (("save", "tidal_overlapped", "stall_s"), ("save", "memcpy", "copy_s"),
                                     0.1),
    "tidal_stall_over_dcp_async_stall": (("save", "tidal", "stall_s"), ("save", "dcp_async", "stall_s"), 0.5),
    "overlapped_stall_over_dcp_async_stall": (("save", "tidal_overlapped", "stall_s"),
                                              ("save", "dcp_async", "stall_s"), None),
    "tidal_commit_over_dcp_async_total": (("save", "tidal", "commit_s"), ("save", "dcp_async", "total_s"),
                                          None),
    "tidal_load_over_dcp_load": (("load", "tidal", "load_s"), ("load", "dcp", "load_s"), None),
    "tidal_load_disk_over_dcp_load": (("load", "tidal", "load_disk_s"), ("load", "dcp", "load_s"), None),
}

NOTES = [
    "warm-up: one untimed round of every competitor before timing (two saves per Checkpointer, one per "
    "staging slot: the first save into a slot allocates and page-faults it; DCP's stager allocates on "
    "its first call too)",
    "competitors alternate within each repeat (order rotates per repeat); every save is waited for "
    "(committed / fsynced) before the next measurement starts; values are medians of the repeats",
    "tidal commit_s / tidal_overlapped commit_s: from the save call until SaveHandle.wait() returns "
    "(committed in node shared memory and in the directory, fsynced)",
    "tidal_overlapped staged_s: until the background copy of parameters and optimizer state finished "
    "(the next optimizer.step() would wait until then)",
    "dcp_async: DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, "
    "use_async_staging=True, use_non_blocking_copy=False)) created once and reused (no pinned memory "
    "without a GPU); return_s = async_save returned, stall_s = staging future done (training may "
    "modify the state only then; used in the ratios), total_s = upload future done",
    "torch_save save_s does not include an fsync (torch.save does none); durable_s adds os.fsync",
    "tidal load_s reads the fastest tier holding the step (node shared memory) and checks the CRC-32 of "
    "every 64 KiB block read; load_disk_s hides the shared-memory tier; files were just written, "
    "so disk reads (Tidal and DCP) are likely served from the page cache",
    f"tidal load_resharded_s: every tensor with >= {RANKS} rows split into {RANKS} uneven row blocks "
    f"(1/6, 2/6, 3/6) given as ckpt.LocalShard to {RANKS} simulated ranks, loaded one after another in "
    "this process; the sum of the three times (smaller tensors are whole on every rank; partial reads "
    "read and check the whole 64 KiB checksum blocks they touch, as in the engine; "
    "load_resharded_read_amplification: bytes read / bytes needed); DCP does not checksum on load",
]


def resharded_states(target: dict) -> list[dict]:
    """One state per simulated rank whose tensors are ``LocalShard`` row blocks (views) of ``target``."""
    out = []
    for r in range(RANKS):
        def piece(t: torch.Tensor, r: int = r) -> Any:
            if t.dim() == 0 or t.shape[0] < RANKS:
                return t
            start, n = row_blocks(t.shape[0])[r]
            return ckpt.LocalShard(t[start : start + n], (start,) + (0,) * (t.dim() - 1), tuple(t.shape))
        out.append(map_tensors(target, piece))
    return out


class _Bench:
    """Holds the state, every competitor's reusable buffers and its directories under ``root``."""

    def __init__(self, state: dict, opt: torch.optim.Optimizer, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.dcp = dcp
        self.state, self.root = state, root
        self.tensors = list(tensors(state))
        self.buffers = [torch.empty_like(t) for t in self.tensors]
        self.tidal_dir = root / "tidal"
        self.overlapped_dir = root / "tidal-overlapped"
        self.shm_roots = [shm_root_for(self.tidal_dir), shm_root_for(self.overlapped_dir)]
        self.cp = ckpt.Checkpointer(self.tidal_dir)
        self.cp_overlapped = ckpt.Checkpointer(self.overlapped_dir, guard=opt)
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))
        self.step = 0
        self.serial = 0

    def close(self) -> None:
        for cp in (self.cp, self.cp_overlapped):
            with contextlib.suppress(Exception):
                cp.close()
        with contextlib.suppress(Exception):
            self.stager.close()
        for d in self.shm_roots:
            shutil.rmtree(d, ignore_errors=True)

    def _fresh(self, kind: str) -> Path:
        self.serial += 1
        return self.root / kind / f"{self.serial:04d}"

    def memcpy(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(self.buffers, self.tensors, strict=True):
                dst.copy_(src)
        return {"copy_s": time.perf_counter() - t0}

    def _tidal(self, cp: ckpt.Checkpointer) -> dict[str, float]:
        self.step += 1
        t0 = time.perf_counter()
        h = cp.save(self.step, self.state)
        t1 = time.perf_counter()
        h.wait_staged()
        t2 = time.perf_counter()
        h.wait()
        t3 = time.perf_counter()
        out = {"stall_s": t1 - t0, "handle_stall_s": h.stall_s, "commit_s": t3 - t0}
        if cp.overlapped:
            out["staged_s"] = t2 - t0
        return out

    def tidal(self) -> dict[str, float]:
        return self._tidal(self.cp)

    def tidal_overlapped(self) -> dict[str, float]:
        return self._tidal(self.cp_overlapped)

    def torch_save(self) -> dict[str, float]:
        path = self._fresh("torch").with_suffix(".pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        torch.save(self.state, path)
        t1 = time.perf_counter()
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        path.unlink()
        return {"save_s": t1 - t0, "durable_s": t2 - t0}

    def dcp_save(self, keep: bool = False) -> dict[str, float]:
        d = self._fresh("dcp")
        t0 = time.perf_counter()
        self.dcp.save(self.state, checkpoint_id=d, no_dist=True)
        t1 = time.perf_counter()
        if keep:
            self.dcp_load_dir = d
        else:
            shutil.rmtree(d)
        return {"save_s": t1 - t0}

    def dcp_async(self) -> dict[str, float]:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        d = self._fresh("dcp-async")
        t0 = time.perf_counter()
        resp = self.dcp.async_save(self.state, checkpoint_id=d, async_stager=self.stager, no_dist=True)
        t1 = time.perf_counter()
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result()
            t2 = time.perf_counter()
            resp.upload_completion.result()
        else:  # a plain future: staging already happened inside async_save
            t2 = t1
            resp.result()
        t3 = time.perf_counter()
        shutil.rmtree(d)
        return {"return_s": t1 - t0, "stall_s": t2 - t0, "total_s": t3 - t0}

    def tidal_load(self, target: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        ckpt.load(self.tidal_dir, target)
        return {"load_s": time.perf_counter() - t0}

    def tidal_load_disk(self, target: dict) -> dict[str, float]:
        hidden = self.root / "no-shm"  # a shared-memory base that does not exist: only the directory is read
        old = os.environ.get(SHM_BASE_ENV)
        os.environ[SHM_BASE_ENV] = str(hidden)
        try:
            t0 = time.perf_counter()
            stats = ckpt.LoadStats()
            ckpt.load(self.tidal_dir, target, stats=stats)
            dt = time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ[SHM_BASE_ENV]
            else:
                os.environ[SHM_BASE_ENV] = old
        if set(stats.bytes_by_tier) != {"disk"}:
            raise RuntimeError(f"disk-only load read from tiers {sorted(stats.bytes_by_tier)}")
        return {"load_disk_s": dt}

    def tidal_load_resharded(self, target: dict) -> dict[str, float]:
        total = 0.0
        needed = read = 0
        for rank_state in resharded_states(target):
            t0 = time.perf_counter()
            stats = ckpt.LoadStats()
            ckpt.load(self.tidal_dir, rank_state, stats=stats)
            total += time.perf_counter() - t0
            needed, read = needed + stats.bytes_needed, read + stats.bytes_read
        return {"load_resharded_s": total,
                "load_resharded_read_amplification": read / needed if needed else 1.0}

    def dcp_load(self, target: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        self.dcp.load(target, checkpoint_id=self.dcp_load_dir, no_dist=True)
        return {"load_s": time.perf_counter() - t0}


def _summary(samples: list[float]) -> dict:
    return {"samples": samples, "median": statistics.median(samples)}


def run(size_gb: float = 1.0, repeat: int = 5, directory: str | os.PathLike | None = None,
        log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the benchmark and return the JSON-able result (see the module docstring)."""
    if size_gb <= 0:
        raise ValueError(f"size_gb must be > 0, got {size_gb}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tidal-bench-ckpt-", dir=directory))
    bench: _Bench | None = None
    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process call; the notes say what is going on.
            warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")
            log(f"building a ~{size_gb:g} GB model + Adam state")
            _model, opt, state, shape = build_state(int(size_gb * GB))
            size = state_bytes(state)
            bench = _Bench(state, opt, root)
            saves: dict[str, Callable[[], dict[str, float]]] = {n: getattr(bench, n) for n in SAVE_METRICS}
            log("warm-up round (untimed)")
            for name, fn in saves.items():
                fn()
                if name.startswith("tidal"):
                    fn()  # the second staging slot
            samples: dict[str, dict[str, dict[str, list[float]]]] = {
                "save": {c: {m: [] for m in ms} for c, ms in SAVE_METRICS.items()},
                "load": {c: {m: [] for m in ms} for c, ms in LOAD_METRICS.items()}}
            names = list(saves)
            for i in range(repeat):
                order = names[i % len(names):] + names[: i % len(names)]
                log(f"save repeat {i + 1}/{repeat}: {', '.join(order)}")
                for name in order:
                    gc.collect()
                    for metric, value in saves[name]().items():
                        samples["save"][name][metric].append(value)

            log("load: preparing sources and targets")
            bench.dcp_save(keep=True)
            target = map_tensors(state, torch.zeros_like)
            loads: list[tuple[str, Callable[[dict], dict[str, float]]]] = [
                ("tidal", bench.tidal_load), ("tidal", bench.tidal_load_disk),
                ("tidal", bench.tidal_load_resharded), ("dcp", bench.dcp_load)]
            for load in (f for _, f in loads):  # warm-up, and a check that every load is right
                zero(target)
                load(target)
                check_equal(target, state, load.__name__)
            for i in range(repeat):
                log(f"load repeat {i + 1}/{repeat}")
                k = i % len(loads)
                for group, load in loads[k:] + loads[:k]:
                    zero(target)
                    gc.collect()
                    for metric, value in load(target).items():
                        samples["load"][group][metric].append(value)
            del target
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(root, ignore_errors=True)

    results = {g: {c: {m: _summary(v) for m, v in ms.items()} for c, ms in cs.items()}
               for g, cs in samples.items()}
    ratios: dict[str, float | None] = {}
    targets: dict[str, dict[str, Any]] = {}
    for name, (num, den, goal) in RATIOS.items():
        a = results[num[0]][num[1]][num[2]]["median"]
        b = results[den[0]][den[1]][den[2]]["median"]
        r = ratios[name] = a / b if b > 0 else None
        if goal is not None and r is not None:
            targets[name] = {"ratio": r, "target_max": goal, "pass": r <= goal}
    return {"benchmark": "ckpt", "machine": machine(), "size_gb_requested": size_gb, "size_bytes": size,
            "tensors": len(bench.tensors) if bench is not None else 0,
            "model": {"kind": "nn.Linear stack + Adam (fp32), stepped once", **shape}, "repeat": repeat,
            "warmup_rounds": 1, "save": results["save"], "load": results["load"], "ratios": ratios,
            "targets": targets, "notes": NOTES}


def render(result: dict, console: Any) -> None:
    """Print ``result`` as Rich tables on ``console``."""
    from rich.table import Column, Table

    m = result["machine"]
    size = result["size_bytes"]
    title = (f"tidal bench ckpt — {size / GB:.3f} GB state ({result['tensors']} tensors), "
             f"median of {result['repeat']} after {result['warmup_rounds']} warm-up round")
    table = Table(title=title, caption=f"{m['cpu_count']} CPUs ({m['cpu']}), torch {m['torch']}, "
                                       f"CUDA {'yes' if m['cuda'] else 'no'}, {m['platform']}")
    for col in ("competitor", "metric"):
        table.add_column(col)
    for col in ("median s", "min s", "max s", "GB/s"):
        table.add_column(col, justify="right")
    for group in ("save", "load"):
        for comp, metrics in result[group].items():
            for metric, s in metrics.items():
                med = s["median"]
                table.add_row(comp if group == "save" else f"{comp} ({group})", metric, f"{med:.4f}",
                              f"{min(s['samples']):.4f}", f"{max(s['samples']):.4f}",
                              f"{size / med / GB:.2f}" if med > 0 and metric.endswith("_s") else "-")
        if group == "save":
            table.add_section()
    console.print(table)

    ratios = Table("ratio", Column("value", justify="right"), Column("target", justify="right"), "",
                   title="ratios (of medians)")
    for name, value in result["ratios"].items():
        t = result["targets"].get(name)
        verdict = ("[green]PASS[/]" if t["pass"] else "[red]MISS[/]") if t else ""
        goal = f"≤ {t['target_max']:g}×" if t else ""
        ratios.add_row(name, "-" if value is None else f"{value:.3f}×", goal, verdict)
    console.print(ratios)
    for note in result["notes"]:
        console.print(f"• {note}", highlight=False)


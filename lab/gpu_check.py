"""What the checkpoint engine and the GPT example do on one NVIDIA GPU: one run, one JSON.

Run by ``lab/gpu_check.sh`` on a machine with one GPU and its own PyTorch (nothing installed:
``PYTHONPATH=src``; only torch, numpy and safetensors are needed for what runs here). Sections, each
written to the JSON as soon as it is done (a timeout keeps what was measured):

* ``d2h``: device-to-host copy bandwidth of one large buffer into pageable memory, into
  ``pin_memory`` memory and into a ``/dev/shm`` mapping registered with ``cudaHostRegister`` (what
  the staging slots are), against the H200's ~50 GB/s host link.
* ``ckpt``: per state size (parameters + Adam state of a stack of ``nn.Linear``, on the GPU), the
  stall of ``Checkpointer.save`` (plain: every tensor copied before ``save`` returns) against the floor
  (one device-to-host copy of every tensor into preallocated pinned buffers), the time until the step
  is committed, and at the first size the overlapped mode (``guard=optimizer``: the copy runs on a side
  stream while the next forward/backward does).
* ``reshard``: the first size saved to a directory, loaded back to the GPU as three uneven row blocks
  (``LocalShard``) from the directory alone; bytes read / needed, GB/s, and an equality check.
* ``gpt``: the GPT example on the GPU (single process, then resumed from its checkpoint; then FSDP2
  under torchrun with one rank and NCCL).

``--device cpu`` runs the same code without a GPU (tiny sizes): the test suite does so, so the script
stays runnable on the day a GPU is there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tidal import ckpt
from tidal.bench.ckpt import machine, resharded_states
from tidal.ckpt.tiers.directory import SHM_BASE_ENV, shm_root_for

GB = 10**9
REPO = Path(__file__).resolve().parent.parent
LINK_GBPS = 50.0  # the H200's host link, one direction, as NVIDIA states it (PCIe Gen5 x16)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: torch.device, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "samples": samples}


# -- device to host -------------------------------------------------------------------------------

def d2h(device: torch.device, size: int, repeat: int, scratch: Path) -> dict:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"bytes": size}
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.zero_()
    targets: dict[str, torch.Tensor] = {"pageable": pageable}
    if device.type == "cuda":
        targets["pinned"] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    shm_file = Path("/dev/shm") / f"tidal-gpu-check-{os.getpid()}"
    mm = None
    try:
        fd = os.open(shm_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        shm = torch.frombuffer(mm, dtype=torch.uint8)
        shm.zero_()
        registered = False
        if device.type == "cuda":
            rc = torch.cuda.cudart().cudaHostRegister(shm.data_ptr(), size, 0)
            registered = int(getattr(rc, "value", rc)) == 0
        out["shm_registered"] = registered
        targets["shm_registered" if registered else "shm"] = shm
        for name, dst in targets.items():
            dst.copy_(src, non_blocking=device.type == "cuda")  # warm-up
            s = timed(lambda dst=dst: dst.copy_(src, non_blocking=device.type == "cuda"), device, repeat)
            out[name] = {**summary(s), "gbps": size / statistics.median(s) / GB}
        if registered:
            torch.cuda.cudart().cudaHostUnregister(shm.data_ptr())
        del shm, targets
    finally:
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
        shm_file.unlink(missing_ok=True)
    best = max(v["gbps"] for k, v in out.items() if isinstance(v, dict) and "gbps" in v)
    out["best_over_link"] = best / LINK_GBPS if device.type == "cuda" else None
    return out


# -- checkpoints ------------------------------------------------------------------------------------

def build(size: int, device: torch.device, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    layers = max(1, round(size / 12 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, ckpt.training_state(model, opt)


def tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, dict):
        return [t for x in v.values() for t in tensors(x)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in tensors(x)]
    return []


def ckpt_size(
    size: int, device: torch.device, repeat: int, scratch: Path, overlapped: bool, width: int
) -> dict:
    model, opt, state = build(size, device, width)
    ts = tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    floor_bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for t in ts]

    def floor() -> None:
        for d, s in zip(floor_bufs, ts, strict=True):
            d.copy_(s, non_blocking=True)

    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(ts), "layers": len(model)}
    floor()
    modes = [("plain", None)] + ([("overlapped", opt)] if overlapped else [])
    x = torch.randn(64, model[0].in_features, device=device)
    for mode, guard in modes:
        root = scratch / f"ckpt-{mode}-{nbytes}"
        # shm + a directory that only the first save goes to: the stall and the shm commit are timed.
        tiers = ["shm", {"url": str(root), "every": 10**6}]
        cp = ckpt.Checkpointer(tiers=tiers, guard=guard)
        try:
            rows: dict[str, list[float]] = {"floor_s": [], "stall_s": [], "commit_s": [], "staged_s": []}
            for i in range(2 + repeat):  # two warm-ups: one per staging slot (allocation, pinning)
                f = timed(floor, device, 1)[0]
                sync(device)
                t0 = time.perf_counter()
                h = cp.save(i, state)
                t1 = time.perf_counter()
                if guard is not None:  # the next step's forward/backward runs during the copy
                    model(x).sum().backward()
                    opt.step()  # waits for the copy (pre-hook)
                    opt.zero_grad(set_to_none=True)
                h.wait_staged()
                sync(device)
                t2 = time.perf_counter()
                h.wait()
                t3 = time.perf_counter()
                if i >= 2:
                    rows["floor_s"].append(f)
                    rows["stall_s"].append(t1 - t0)
                    rows["staged_s"].append(t2 - t0)
                    rows["commit_s"].append(t3 - t0)
            res = {k: summary(v) for k, v in rows.items() if v}
            res["stall_over_floor"] = res["stall_s"]["median"] / res["floor_s"]["median"]
            res["floor_gbps"] = nbytes / res["floor_s"]["median"] / GB
            res["shm_tier"] = cp.shm_tier is not None
            out[mode] = res
        finally:
            cp.close()
            shutil.rmtree(shm_root_for(root), ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
    return out


def reshard(size: int, device: torch.device, scratch: Path, width: int) -> dict:
    model, opt, state = build(size, device, width)
    root = scratch / "reshard"
    with ckpt.Checkpointer(root) as cp:
        cp.save(1, state).wait()
    target = _zeros_like(state)
    parts = resharded_states(target)
    old = os.environ.get(SHM_BASE_ENV)
    os.environ[SHM_BASE_ENV] = str(scratch / "no-shm")  # read the directory tier only
    try:
        stats = []
        t0 = time.perf_counter()
        for p in parts:
            s = ckpt.LoadStats()
            ckpt.load(root, p, stats=s)
            stats.append(s)
        sync(device)
        dt = time.perf_counter() - t0
    finally:
        if old is None:
            os.environ.pop(SHM_BASE_ENV, None)
        else:
            os.environ[SHM_BASE_ENV] = old
    equal = all(torch.equal(a, b) for a, b in zip(tensors(state), tensors(target), strict=True))
    needed = sum(s.bytes_needed for s in stats)
    read = sum(s.bytes_read for s in stats)
    shutil.rmtree(shm_root_for(root), ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes_needed": needed, "bytes_read": read, "read_amplification": read / max(1, needed),
            "load_s": dt, "gbps": needed / dt / GB, "equal": equal,
            "tiers": sorted({k for s in stats for k in s.bytes_by_tier})}


def _zeros_like(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: _zeros_like(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_zeros_like(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_zeros_like(x) for x in v)
    return v


# -- the GPT example -----------------------------------------------------------------------------

def gpt(device: torch.device, scratch: Path, steps: int, extra: list[str]) -> dict:
    script = REPO / "examples" / "gpt" / "train.py"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device.type != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    out: dict[str, Any] = {}
    d = scratch / "gpt"
    runs = [
        ("single", [sys.executable, str(script), "--parallel", "single", "--steps", str(steps)]),
        ("single_resumed", [sys.executable, str(script), "--parallel", "single", "--steps", str(steps * 2)]),
        (
            "fsdp_torchrun",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "1",
                str(script),
                "--parallel",
                "fsdp",
                "--steps",
                str(steps),
            ],
        ),
    ]
    for name, argv in runs:
        ck = d / ("fsdp" if name.startswith("fsdp") else "single")
        argv = [*argv, "--ckpt-dir", str(ck), "--ckpt-every", str(max(1, steps // 2)), *extra]
        t0 = time.perf_counter()
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
        lines = (p.stdout + p.stderr).strip().splitlines()
        out[name] = {"rc": p.returncode, "wall_s": time.perf_counter() - t0, "tail": lines[-6:],
                     "steps_committed": ckpt.steps(str(ck))}
    return out


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes-gb", default="4,16", help="state sizes of the ckpt section, comma-separated")
    ap.add_argument("--d2h-gb", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--width", type=int, default=8192, help="nn.Linear width of the state")
    ap.add_argument("--gpt-steps", type=int, default=200)
    ap.add_argument("--gpt-args", default="", help="extra arguments for examples/gpt/train.py")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="skip sections once this much time is spent"
    )
    ap.add_argument("--scratch", type=Path, default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    t_start = time.perf_counter()
    res: dict[str, Any] = {"machine": machine(), "argv": sys.argv[1:], "errors": {}, "skipped": []}
    if device.type == "cuda":
        res["machine"]["gpu"] = torch.cuda.get_device_name(0)
        res["machine"]["cuda_version"] = torch.version.cuda
    with contextlib.suppress(Exception):
        res["machine"]["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                  capture_output=True, text=True).stdout.strip() or None
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        res["machine"]["dev_shm_free_gb"] = st.f_bavail * st.f_frsize / GB
    sizes = [int(float(s) * GB) for s in a.sizes_gb.split(",") if s.strip()]
    scratch = a.scratch or Path(tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["elapsed_s"] = time.perf_counter() - t_start
        a.out.write_text(json.dumps(res, indent=2, default=str))

    def section(name: str, fn: Any) -> None:
        if time.perf_counter() - t_start > a.budget_s:
            res["skipped"].append(name)
            print(f"[gpu_check] {name}: skipped (budget {a.budget_s:.0f} s spent)", flush=True)
            return
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            res[name] = fn()
        except Exception as e:  # one section failing must not lose the others
            res["errors"][name] = "".join(traceback.format_exception_only(type(e), e)).strip()
            traceback.print_exc()
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[gpu_check] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    try:
        section("d2h", lambda: d2h(device, int(a.d2h_gb * GB), a.repeat, scratch))
        for i, size in enumerate(sizes):
            def one(size: int = size, first: bool = i == 0) -> dict:
                return ckpt_size(size, device, a.repeat if first else max(1, a.repeat - 1), scratch,
                                 overlapped=first, width=a.width)
            section(f"ckpt_{size / GB:g}gb", one)
        section("reshard", lambda: reshard(sizes[0], device, scratch, a.width))
        section("gpt", lambda: gpt(device, scratch, a.gpt_steps, a.gpt_args.split()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        save()
    print(json.dumps({k: v for k, v in res.items() if k in ("errors", "skipped", "elapsed_s")}), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

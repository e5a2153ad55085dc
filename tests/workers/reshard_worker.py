"""One rank of a save/load-with-resharding run (launched by tests/dist_harness.py, or by torchrun).

    python tests/workers/reshard_worker.py --phase save|load --layout fsdp|ddp|tp_dp|fsdp_tp|single --dir D \
        [--then PHASE:LAYOUT:DIR ...]

save: train a small model a few steps under ``--layout``, save it with ``tidal.ckpt`` as step 3 and
      write the full (unsharded) model + Adam state, gathered with torch.distributed.checkpoint, to
      D/ref.safetensors (+ D/ref_param_groups.json) from rank 0.
load: build the same model under ``--layout`` with a different seed, ``ckpt.load`` + apply, then
      check: the step and extra values, reads bounded by the checksum blocks touched on every rank,
      and - on rank 0 - that the gathered full state equals the reference bit for bit. Then train one
      more step.

Each job prints ``RESULT <phase>:<layout>:<dir name> OK|FAIL <details>`` on stdout; a failed check
lets the remaining jobs run (all collectives of the job are done by then), an exception stops the
process. Exits non-zero when any job failed. Layout ``single`` runs without a process group and
needs WORLD_SIZE=1; the other layouts use the default (gloo) group over all ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from tidal import ckpt

# FSDP2 warns that a wrapped Linear returns a view (a 3-D input to addmm); nothing here modifies it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

STEP = 3
VOCAB, DIM, HIDDEN, OUT = 29, 53, 37, 5  # odd sizes: uneven shards on 3 and 4 ranks, an empty one at 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, OUT)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.seen += idx.shape[0]
        x = self.norm(self.emb(idx))
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)


class CheckFailed(Exception):
    """A check failed after every collective of the job ran: report it and go on with the next job."""


def build(layout: str, seed: int):
    """(model, optimizer, rank, data_rank) for ``layout``; the model's values depend on ``seed``."""
    torch.manual_seed(seed)
    model = Net()
    with torch.no_grad():
        model.seen.fill_(seed)
    rank = world = 0
    if layout != "single":
        if not dist.is_initialized():
            raise RuntimeError(f"layout {layout!r} needs a process group")
        rank, world = dist.get_rank(), dist.get_world_size()
    data_rank = rank
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for sub in (model.emb, model.up, model.down, model.head):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout in ("tp_dp", "fsdp_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if world % 2:
            raise RuntimeError(f"{layout} needs an even world size, got {world}")
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        # The hidden size (37) splits unevenly over tp=2: keep `up`'s output a DTensor so `down` sees its true
        # global shape (from_local on a plain tensor would assume even shards).
        plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        if layout == "tp_dp":
            # Every DP replica sees the same data, so replicas stay identical without gradient sync.
            data_rank = 0
        else:  # 2-D: FSDP2 over dp on top of TP (params sharded on both mesh dims)
            for sub in (model.emb, model.up, model.down, model.head):
                fully_shard(sub, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            data_rank = mesh.get_local_rank("dp")
    elif layout == "single":
        if dist.is_initialized():
            raise RuntimeError("layout 'single' runs as one process without a process group")
    else:
        raise RuntimeError(f"unknown layout {layout!r}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt, rank, data_rank


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, data_rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    idx = torch.randint(0, VOCAB, (4, 6), generator=g)
    target = torch.randn(4, 6, OUT, generator=g)
    loss = torch.nn.functional.mse_loss(model(idx), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Gather the whole model + optimizer state (collective); meaningful on rank 0 only."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            key = f"{prefix}/{k}"
            if isinstance(v, dict):
                walk(key, v)
            elif isinstance(v, torch.Tensor):
                flat[key] = v.detach().cpu().clone().contiguous()
            else:
                raise RuntimeError(f"unexpected non-tensor {key} = {v!r} in the gathered state")

    walk("model", msd)
    walk("optim/state", osd.get("state", {}))
    return flat, json.loads(json.dumps(osd.get("param_groups", [])))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for k in sorted(set(want) - set(got)):
        problems.append(f"{k}: missing after load")
    for k in sorted(set(got) - set(want)):
        problems.append(f"{k}: not in the reference")
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(
                f"{k}: dtype/shape {a.dtype} {list(a.shape)} != reference {b.dtype} {list(b.shape)}"
            )
        elif not bitwise_equal(a, b):
            n = int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())
            problems.append(f"{k}: {n} bytes differ from the reference")
    return problems


def save_job(layout: str, d: Path) -> str:
    model, opt, rank, data_rank = build(layout, seed=1234)
    for s in range(STEP):
        train_step(model, opt, s, data_rank)
    state = ckpt.training_state(model, opt, extra={"step": STEP, "note": "x"})
    cp = ckpt.Checkpointer(d, process_group=None)
    cp.save(STEP, state).wait()
    cp.close()
    flat, groups = full_state(model, opt)
    if rank != 0:
        return f"saved step {STEP}"
    save_file(flat, str(d / "ref.safetensors.tmp"))
    os.replace(d / "ref.safetensors.tmp", d / "ref.safetensors")
    (d / "ref_param_groups.json").write_text(json.dumps(groups))
    return f"saved step {STEP} and a reference of {len(flat)} tensors"


def load_job(layout: str, d: Path) -> str:
    if not (d / "ref.safetensors").exists():  # every rank sees it: fail together, before any collective
        raise FileNotFoundError(f"{d}: no reference; the save job for this checkpoint did not finish")
    model, opt, rank, data_rank = build(layout, seed=987 + 17 * int(os.environ.get("RANK", "0")))
    ref = load_file(str(d / "ref.safetensors")) if rank == 0 else {}
    before, _ = full_state(model, opt)
    state = ckpt.training_state(model, opt, extra={"step": 0, "note": ""})
    stats = ckpt.LoadStats()
    step = ckpt.load(d, state, stats=stats)
    ckpt.apply_training_state(model, opt, state)
    after, groups = full_state(model, opt)  # collective: every rank gathers before any check
    loss = train_step(model, opt, STEP, data_rank)  # training goes on from the loaded state
    problems = []
    if step != STEP or state["step"] != STEP or state["note"] != "x":
        problems.append(f"load returned step {step}, state step {state['step']!r}, note {state['note']!r}; "
                        f"expected {STEP}, {STEP}, 'x'")
    # Reads are widened to the 64 KiB checksum blocks they touch: at most one block more at each end
    # of a piece's run (these pieces are row blocks, or small enough to be one or two blocks).
    slack = stats.pieces_read * 2 * (64 << 10)
    if stats.bytes_needed <= 0 or not stats.bytes_needed <= stats.bytes_read <= stats.bytes_needed + slack:
        problems.append(f"read amplification {stats.read_amplification}: read {stats.bytes_read} bytes "
                        f"for {stats.bytes_needed} needed (at most {slack} more expected)")
    if stats.fallbacks:
        problems.append(f"load fell back between tiers: {stats.fallbacks}")
    if not math.isfinite(loss):
        problems.append(f"training after load gave loss {loss}")
    if rank == 0:
        # The fresh model must differ from the reference, or the comparison proves nothing.
        same = [k for k in ref if k.startswith("model/") and k in before and bitwise_equal(before[k], ref[k])]
        if same:
            problems.append(f"before loading, the fresh model already equals the reference in {same}")
        problems += compare(after, ref)
        want_groups = json.loads((d / "ref_param_groups.json").read_text())
        if groups != want_groups:
            problems.append(f"param_groups {groups} != reference {want_groups}")
    if problems:
        raise CheckFailed(f"{len(problems)} problem(s): " + "; ".join(problems[:30]))
    tiers = ",".join(sorted(stats.bytes_by_tier))
    what = f"{len(after)} tensors bitwise equal, " if rank == 0 else ""
    return (f"{what}read {stats.bytes_read} of {stats.bytes_needed} bytes needed in {stats.pieces_read} "
            f"pieces; tiers={tiers}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--layout", choices=["fsdp", "ddp", "tp_dp", "fsdp_tp", "single"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--then", action="append", default=[], metavar="PHASE:LAYOUT:DIR",
                    help="further jobs run in order by the same processes (saves torch start-up time)")
    args = ap.parse_args()
    jobs = [(args.phase, args.layout, args.dir)]
    for j in args.then:
        phase, layout, d = j.split(":", 2)
        jobs.append((phase, layout, d))
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or any(lay != "single" for _, lay, _ in jobs):
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    failed = False
    try:
        for phase, layout, d in jobs:
            name = f"{phase}:{layout}:{Path(d).name}"
            try:
                msg = save_job(layout, Path(d)) if phase == "save" else load_job(layout, Path(d))
                print(f"RESULT {name} OK {msg}", flush=True)
            except CheckFailed as e:  # every rank finished the job's collectives: go on
                failed = True
                print(f"RESULT {name} FAIL {e}", flush=True)
                print(f"[rank {rank}] {name} FAILED: {e}", file=sys.stderr, flush=True)
            except BaseException as e:  # collectives may be out of step: stop here
                print(f"RESULT {name} FAIL {type(e).__name__}: {e}", flush=True)
                raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()

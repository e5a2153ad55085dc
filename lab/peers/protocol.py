"""The adapter's side of the peer protocol: build the state, time each engine like ``tidal bench ckpt``,
write JSON.

An adapter module defines ``open_engines(ctx) -> dict[name, Engine | Exception]`` and calls
:func:`main`. An :class:`Engine` saves the state (``save(step)`` returns at least ``stall_s``, the time
the training loop was blocked, and ``durable_s``, the time until the step is on disk and fsynced, both
from the save call) and lists its loads (each fills ``target``, a zeroed copy of the state, in place and
returns its times). The protocol is the main benchmark's: one untimed warm-up round (saves, and every
load, whose result is checked against the state), then ``repeat`` rounds in an order rotating from one
round to the next, every save waited for until durable before the next starts; medians are reported.

An engine that cannot be opened here, or fails in its warm-up or a timed round, is reported as
``{"status": "unavailable", "reason": <one line>}``; the others still run. The document::

    {"protocol": 1, "peer": ..., "versions": {...}, "machine": {...}, "size_bytes": N, "tensors": n,
     "repeat": r, "memcpy": {"copy_s": {"samples": [...], "median": x}},
     "engines": {name: {"status": "ok", "save": {metric: {...}}, "load": {metric: {...}}, "notes": [...]}
                        | {"status": "unavailable", "reason": "...", "notes": [...]}}}

Needs torch and :mod:`tidal.bench.ckpt_state` only (it runs in a peer's venv).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lab.peers import PROTOCOL
from tidal.bench.ckpt_state import build_state, check_equal, machine, map_tensors, state_bytes, tensors, zero
from tidal.files import AS_OPEN, write_atomic

Load = Callable[[dict], dict[str, float]]
REASON_MAX = 400


@dataclass
class Context:
    """What an adapter gets to open its engines: the state and a scratch directory of its own."""

    state: dict
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    root: Path
    size_bytes: int  # what build_state was asked for (an engine may build a second state of the same shapes)
    seed: int
    notes: list[str] = field(default_factory=list)


class Engine:
    """One way of checkpointing with a peer (subclassed by the adapters)."""

    warmup_saves = 1  # untimed saves before timing (e.g. 2 where staging buffers alternate)
    notes: tuple[str, ...] = ()

    def save(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def loads(self) -> dict[str, Load]:
        """name -> a load that fills ``target`` in place and returns ``{metric: seconds}``."""
        return {}

    def close(self) -> None:
        pass


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (at most REASON_MAX characters), for a reason in the JSON.

    An exception without a message (a bare ``assert``) is named by where it was raised instead.
    """
    msg = str(e).strip().splitlines()
    if msg:
        text = f"{type(e).__name__}: {msg[0]}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        where = ""
        if frames:
            f = frames[-1]
            path = f.filename.split("site-packages/")[-1]
            where = f" at {path}:{f.lineno}" + (f" ({f.line.strip()})" if f.line else "")
        text = f"{type(e).__name__}{where}"
    return text if len(text) <= REASON_MAX else text[: REASON_MAX - 1] + "…"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or the file ``path``) and the directories holding them."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    dirs = {p.parent for p in files} | ({path} if path.is_dir() else set())
    for p in [*files, *dirs]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def copy_into(target: dict, loaded: dict) -> None:
    """Copy a loaded state (same nesting) into ``target``'s tensors."""
    with torch.no_grad():
        for dst, src in zip(tensors(target), tensors(loaded), strict=True):
            dst.copy_(src)


def _summary(samples: list[float]) -> dict:
    return {"samples": samples, "median": statistics.median(samples)}


def _rotate(names: list[str], i: int) -> list[str]:
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def measure(engines: dict[str, Engine | BaseException], ctx: Context, repeat: int,
            log: Callable[[str], None]) -> tuple[dict, dict]:
    """Time every engine with the protocol; returns ``(memcpy metrics, engines' results)``."""
    state = ctx.state
    srcs = list(tensors(state))
    bufs = [torch.empty_like(t) for t in srcs]

    def memcpy() -> dict[str, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(bufs, srcs, strict=True):
                dst.copy_(src)
        return {"copy_s": time.perf_counter() - t0}

    out: dict[str, dict] = {}
    live: dict[str, Engine] = {}
    for name, e in engines.items():
        if isinstance(e, BaseException):
            log(f"{name}: cannot be opened:\n{''.join(traceback.format_exception(e))}")
            out[name] = {"status": "unavailable", "reason": one_line(e)}
        else:
            live[name] = e
            out[name] = {"status": "ok", "save": {}, "load": {}, "notes": list(e.notes)}

    def fail(name: str, when: str, e: BaseException) -> None:
        log(f"{name}: failed {when}: {one_line(e)}\n{traceback.format_exc()}")
        out[name] = {"status": "unavailable", "reason": f"failed {when}: {one_line(e)}",
                     "notes": out[name].get("notes", [])}
        eng = live.pop(name)
        try:
            eng.close()
        except Exception as ce:  # noqa: BLE001 (the engine is broken already; its close may be too)
            log(f"{name}: close failed too: {one_line(ce)}")

    step = 0
    raw: dict[str, dict[str, dict[str, list[float]]]] = {n: {"save": {}, "load": {}} for n in live}
    copy: list[float] = []
    memcpy()
    for name in list(live):  # warm-up
        try:
            for _ in range(live[name].warmup_saves):
                step += 1
                live[name].save(step)
        except Exception as e:  # noqa: BLE001 (reported, the other engines go on)
            fail(name, "in the warm-up save", e)
    for i in range(repeat):
        order = _rotate(["memcpy", *live], i)
        log(f"save repeat {i + 1}/{repeat}: {', '.join(order)}")
        for name in order:
            gc.collect()
            if name == "memcpy":
                copy.append(memcpy()["copy_s"])
                continue
            if name not in live:
                continue
            step += 1
            try:
                for metric, value in live[name].save(step).items():
                    raw[name]["save"].setdefault(metric, []).append(value)
            except Exception as e:  # noqa: BLE001
                fail(name, f"in save repeat {i + 1}", e)

    target = map_tensors(state, torch.zeros_like)
    loads = [(n, ln, fn) for n, e in list(live.items()) for ln, fn in e.loads().items()]
    for name, lname, fn in loads:  # warm-up, and the check that every load is right
        if name not in live:
            continue
        zero(target)
        try:
            fn(target)
            check_equal(target, state, f"{name} {lname}")
        except Exception as e:  # noqa: BLE001
            fail(name, f"in the warm-up load {lname}", e)
    for i in range(repeat):
        log(f"load repeat {i + 1}/{repeat}")
        k = i % len(loads) if loads else 0
        for name, lname, fn in loads[k:] + loads[:k]:
            if name not in live:
                continue
            zero(target)
            gc.collect()
            try:
                for metric, value in fn(target).items():
                    raw[name]["load"].setdefault(metric, []).append(value)
            except Exception as e:  # noqa: BLE001
                fail(name, f"in load repeat {i + 1} ({lname})", e)
    del target

    for name, eng in live.items():
        out[name]["save"] = {m: _summary(v) for m, v in raw[name]["save"].items()}
        out[name]["load"] = {m: _summary(v) for m, v in raw[name]["load"].items()}
        try:
            eng.close()
        except Exception as e:  # noqa: BLE001
            log(f"{name}: close failed: {one_line(e)}")
    return {"copy_s": _summary(copy)}, out


def main(peer: str, dists: list[str], open_engines: Callable[[Context], dict[str, Engine | BaseException]],
         argv: list[str] | None = None, prepare: Callable[[], object] | None = None) -> int:
    """Parse the runner's arguments, measure, write the JSON document to ``--out``; 0 once written.

    ``prepare`` runs before the state is built: what a launcher would have started before training
    (DLRover's saver process, which ``dlrover-run``'s agent owns).
    """
    ap = argparse.ArgumentParser(prog=f"lab.peers ({peer})")
    ap.add_argument("--size-bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory (made; removed at the end)")
    ap.add_argument("--out", type=Path, required=True, help="where the JSON document goes")
    args = ap.parse_args(argv)
    if args.size_bytes <= 0 or args.repeat < 1:
        ap.error("--size-bytes must be > 0 and --repeat >= 1")

    def log(s: str) -> None:
        print(f"[{peer}] {s}", file=sys.stderr, flush=True)

    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    try:
        failed: BaseException | None = None
        try:
            if prepare is not None:
                prepare()
        except Exception as e:  # noqa: BLE001 (reported as the reason the peer cannot run here)
            failed = e
        model, opt, state, shape = build_state(args.size_bytes, args.seed)
        ctx = Context(state, model, opt, root, args.size_bytes, args.seed)
        engines: dict[str, Engine | BaseException]
        try:
            engines = {peer: failed} if failed is not None else open_engines(ctx)
        except Exception as e:  # noqa: BLE001 (the import or set-up of the peer itself failed)
            engines = {peer: e}
        memcpy, results = measure(engines, ctx, args.repeat, log)
        doc = {
            "protocol": PROTOCOL,
            "peer": peer,
            "versions": {d: version(d) for d in ["torch", *dists]},
            "machine": machine(),
            "size_bytes": state_bytes(state),
            "tensors": len(list(tensors(state))),
            "model": shape,
            "repeat": args.repeat,
            "memcpy": memcpy,
            "engines": results,
            "notes": ctx.notes,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_atomic(args.out, json.dumps(doc, indent=1), mode=AS_OPEN, durable=False)
    return 0


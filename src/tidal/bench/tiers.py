"""``tidal bench tiers``: every checkpoint tier against the raw device under it (persist, then load), and
what checkpointing costs a training loop (:mod:`tidal.bench.tiers_train`), in one run (docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal import ckpt
from tidal.bench.ckpt import resharded_states
from tidal.bench.ckpt_state import check_equal, machine, map_tensors, tensors
from tidal.bench.tiers_env import Env
from tidal.bench.tiers_train import train
from tidal.ckpt.tiers.directory import SHM_BASE_ENV

MIB = 1 << 20
BLOCK = 16 * MIB
SETTLE_S = 1.0  # pause before each persist measurement: servers finish deferred work (deletes, page freeing)
GOALS = {"persist_over_raw_min": 0.9, "overhead_max": 0.03, "overhead_over_dcp_max": 0.5}


def _payload(size_bytes: int, pieces: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    n = size_bytes // 4 // pieces
    rows = max(1, n // 1024)
    return {f"t{i}": torch.randn(rows, n // rows, generator=g) for i in range(pieces)}


def _flat(state: dict) -> memoryview:
    """The state's bytes, contiguous: what the raw baselines write."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors(state)]).numpy().data


class _Persist:
    def __init__(self, env: Env, state: dict) -> None:
        from tidal.ckpt.tiers.s3 import S3Tier

        self.env, self.state, self.data = env, state, _flat(state)
        self.step = 0
        self.cps = {
            "disk": ckpt.Checkpointer(tiers=["shm", {"url": str(env.disk / "persist"), "keep": 1}], keep=1),
            "s3": ckpt.Checkpointer(tiers=["shm", {"url": env.s3_url("persist"), "keep": 1}], keep=1),
            "peer": ckpt.Checkpointer(tiers=["shm", env.peer("persist", keep=1)], keep=1)}
        self.s3 = S3Tier(env.s3_url("raw"))

    def tidal(self, tier: str) -> float:
        self.step += 1
        cp = self.cps[tier]
        h = cp.save(self.step, self.state)
        h.wait()
        if tier not in h.committed:
            raise RuntimeError(f"step {self.step} was not committed in tier {tier}: {h.committed}")
        # Let retention (which runs after the commit) finish, so it does not overlap the next measurement.
        deadline = time.monotonic() + 60
        while cp.status().tier(tier).steps != (self.step,) and time.monotonic() < deadline:
            time.sleep(0.05)
        return h.persist_s

    def raw(self, tier: str) -> float:
        return {"disk": self._dd, "s3": self._put_s3, "peer": self._put_http}[tier]()

    def _dd(self) -> float:
        path = self.env.disk / "dd.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for off in range(0, len(self.data), BLOCK):
                chunk, w = self.data[off : off + BLOCK], 0
                while w < len(chunk):
                    w += os.write(fd, chunk[w:])
            os.fsync(fd)
        finally:
            os.close(fd)
        dt = time.perf_counter() - t0
        path.unlink()
        return dt

    def _put_s3(self) -> float:
        import obstore

        t0 = time.perf_counter()
        obstore.put(self.s3._store, "raw.bin", self.data, use_multipart=True,
                    chunk_size=self.s3.part_size_bytes, max_concurrency=self.s3.concurrency)
        dt = time.perf_counter() - t0
        obstore.delete(self.s3._store, "raw.bin")
        return dt

    def _put_http(self) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.env.recv_port, timeout=300)
        try:
            t0 = time.perf_counter()
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request("PUT", "/raw", body=self.data)
            resp = conn.getresponse()
            resp.read()
            dt = time.perf_counter() - t0
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"receiver answered HTTP {resp.status}")
        return dt

    def close(self) -> None:
        for cp in self.cps.values():
            with contextlib.suppress(Exception):
                cp.close()


def persist(p: _Persist, repeat: int, log: Callable[[str], None]) -> dict:
    tiers = list(p.cps)
    log("persist: warm-up (two saves per Checkpointer: one per staging slot; one raw write each)")
    for t in tiers:
        p.tidal(t)
        p.tidal(t)
        p.raw(t)
    samples: dict[str, dict[str, list[float]]] = {t: {"raw_s": [], "tidal_s": []} for t in tiers}
    for i in range(repeat):
        order = tiers[i % 3:] + tiers[: i % 3]
        log(f"persist repeat {i + 1}/{repeat}: {', '.join(order)}")
        for t in order:
            first, second = ("raw", "tidal") if i % 2 == 0 else ("tidal", "raw")
            # One untimed raw write first: the first write after another tier's work was up to ~4x slower
            os.sync()
            p.raw(t)
            for kind in (first, second):
                os.sync()  # the previous sample's dirty pages (SeaweedFS's volume too) written back first
                time.sleep(SETTLE_S)
                samples[t][f"{kind}_s"].append(p.raw(t) if kind == "raw" else p.tidal(t))
    size = len(p.data)
    out = {}
    for t, s in samples.items():
        raw, tid = statistics.median(s["raw_s"]), statistics.median(s["tidal_s"])
        out[t] = {"raw_mib_s": size / raw / MIB, "tidal_mib_s": size / tid / MIB, "ratio": raw / tid,
                  "samples": s}
    return out


def loads(env: Env, p: _Persist, repeat: int, log: Callable[[str], None]) -> dict:
    sources: dict[str, list[Any]] = {
        "shm": ["shm", str(env.disk / "persist")],
        "disk": [str(env.disk / "persist")],
        "s3": [env.s3_url("persist")],
        "peer": [env.peer("persist", agent=env.b)],  # the buddy's replica: the node that saved is "gone"
    }
    target = map_tensors(p.state, torch.zeros_like)
    out: dict[str, dict] = {}
    size = len(p.data)
    for tier, spec in sources.items():
        same, resharded = [], []
        for i in range(repeat + 1):  # the first round is a warm-up and a check
            stats = ckpt.LoadStats()
            t0 = time.perf_counter()
            ckpt.load(spec, target, stats=stats)
            dt = time.perf_counter() - t0
            if set(stats.bytes_by_tier) != {tier}:
                raise RuntimeError(f"load from {tier} read from {sorted(stats.bytes_by_tier)}")
            total = 0.0
            for rank_state in resharded_states(target):
                t1 = time.perf_counter()
                ckpt.load(spec, rank_state)
                total += time.perf_counter() - t1
            if i == 0:
                check_equal(target, p.state, f"load from {tier}")
                continue
            same.append(dt)
            resharded.append(total)
        log(f"load from {tier}: {size / statistics.median(same) / 1e9:.2f} GB/s")
        out[tier] = {"same_gb_s": size / statistics.median(same) / 1e9,
                     "resharded_gb_s": size / statistics.median(resharded) / 1e9,
                     "samples": {"same_s": same, "resharded_s": resharded}}
    return out


def run(size_mb: float = 512, repeat: int = 5, train_s: float = 60.0, interval_s: float = 10.0,
        model_mb: float = 32.0, batch: int = 64, directory: str | os.PathLike | None = None,
        log: Callable[[str], None] = lambda s: None, rounds: int = 3) -> dict:
    """Run the benchmark and return the JSON-able result (see the module docstring)."""
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tidal-bench-tiers-", dir=directory))
    shm_base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    shm = Path(tempfile.mkdtemp(prefix="tidal-bench-tiers-", dir=shm_base))
    saved_env = {k: os.environ.get(k) for k in (SHM_BASE_ENV, "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                                "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
                                                "AWS_ALLOW_HTTP")}
    os.environ[SHM_BASE_ENV] = str(shm)  # staging slots and shm tiers here; the agents may copy from here
    env: Env | None = None
    p: _Persist | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")
            env = Env(root, shm, log)
            log(f"building a {size_mb:g} MiB state")
            p = _Persist(env, _payload(int(size_mb * MIB)))
            result_persist = persist(p, repeat, log)
            result_load = loads(env, p, repeat, log)
            p.close()
            p = None
            result_train = (train(env, train_s, interval_s, model_mb, batch, log, rounds) if train_s > 0
                            else None)
    finally:
        if p is not None:
            p.close()
        if env is not None:
            env.close()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return {"benchmark": "tiers", "machine": machine(), "size_bytes": int(size_mb * MIB), "repeat": repeat,
            "persist": result_persist, "load": result_load, "train": result_train, "goals": GOALS}


def render(result: dict, console: Any) -> None:
    from rich.table import Table

    m = result["machine"]
    caption = f"{m['cpu_count']} CPUs ({m['cpu']}), torch {m['torch']}, CUDA {'yes' if m['cuda'] else 'no'}"
    t = Table(title=f"persist {result['size_bytes'] / MIB:g} MiB (median of {result['repeat']})",
              caption=caption)
    for c in ("tier", "raw device", "raw MiB/s", "tidal MiB/s", "tidal / raw",
              f"goal ≥ {GOALS['persist_over_raw_min']}"):
        t.add_column(c, justify="left" if c in ("tier", "raw device") else "right")
    raw_name = {"disk": "write + fsync (dd)", "s3": "obstore multipart PUT", "peer": "HTTP PUT to a receiver"}
    for tier, r in result["persist"].items():
        ok = r["ratio"] >= GOALS["persist_over_raw_min"]
        t.add_row(tier, raw_name[tier], f"{r['raw_mib_s']:.0f}", f"{r['tidal_mib_s']:.0f}",
                  f"{r['ratio']:.2f}", "[green]PASS[/]" if ok else "[red]MISS[/]")
    console.print(t)
    t = Table(title="load (GB/s, median)")
    for c in ("tier", "same layout", "resharded (3 row blocks)"):
        t.add_column(c, justify="left" if c == "tier" else "right")
    for tier, r in result["load"].items():
        t.add_row(tier, f"{r['same_gb_s']:.2f}", f"{r['resharded_gb_s']:.2f}")
    console.print(t)
    tr = result["train"]
    if tr is None:
        return
    run0 = tr["runs"][0]
    t = Table(title=f"training overhead: MLP width {run0['width']} + Adam ({run0['state_mib']:.0f} MiB "
              f"state), 1 thread, checkpoint every {tr['interval_s']:g} s; {tr['rounds']} rounds of "
              f"{tr['segment_s']:g} s per mode")
    for c in ("mode", "steps/s", "saves", "save() call s", "overhead", "paired (median of rounds)",
              "CPU s/s: this process", "agents", "S3 server"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    paired = tr.get("overhead_paired", {})
    for r in tr["runs"]:
        over, pair = tr["overhead"].get(r["mode"]), paired.get(r["mode"])
        cpu = r["cpu_per_s"]
        t.add_row(r["mode"], f"{r['steps_per_s']:.2f}", str(r["saves"]), f"{r['save_call_s_median']:.3f}",
                  "-" if over is None else f"{over * 100:.1f}%",
                  "-" if pair is None else f"{pair * 100:.1f}%",
                  *(f"{cpu.get(k, 0):.2f}" for k in ("this process", "agents", "S3 server")))
    console.print(t)
    ratio = tr["overhead_over_dcp"]
    pratio = tr.get("overhead_paired_over_dcp")
    console.print(
        f"baseline {tr['baseline_steps_per_s']:.2f} steps/s (its rounds spread over "
        f"{tr['baseline_spread'] * 100:.1f}%); tidal overhead {tr['overhead']['tidal'] * 100:.1f}% "
        f"(goal ≤ {GOALS['overhead_max'] * 100:g}%), "
        f"DCP async_save {tr['overhead']['dcp_async'] * 100:.1f}%, "
        f"tidal / DCP = {'-' if ratio is None else f'{ratio:.2f}'} "
        f"(goal ≤ {GOALS['overhead_over_dcp_max']}); "
        f"paired: tidal {paired.get('tidal', float('nan')) * 100:.1f}%, DCP "
        f"{paired.get('dcp_async', float('nan')) * 100:.1f}%, tidal / DCP "
        f"{'-' if pratio is None else f'{pratio:.2f}'}",
        highlight=False,
    )

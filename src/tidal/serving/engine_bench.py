"""``tidal serving engine-bench``: does lending hurt a real engine's users? The same open-loop traffic (real
prompts, streamed completions, the same arrivals) against replicas of llama.cpp behind nginx, twice: once
lending the replicas the queueing model finds idle at the TTFT target, and taking them back two measured
warm-ups before they are due; once without lending. Per phase (before, lent, reclaiming, after): TTFT
p50/p99, tokens/s, requests failed. While lent, a training rank (a CPU-bound loop standing for the spot
job) runs on the lent replicas' CPUs. With ``pin`` (where there are 2 CPUs or more) replica i runs on CPU
i mod N and the training rank only on CPUs no serving replica has, as a lent GPU is never the serving one;
without it everything shares every CPU. With ``pairs`` above 1 the two runs are made that many times in
turns (each pair its own arrivals), and each phase's requests are pooled over the pairs: a p99 of hundreds
of requests instead of tens, the machine's drift shared by both sides. docs/loaning.md says how to read
it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tidal.ckpt.agent.childproc import stop_process
from tidal.serving import loadgen
from tidal.serving.engine_replicas import EngineError, EngineReplicas, engine_version, llama_server, on_cpus
from tidal.serving.engines import replicas_needed
from tidal.serving.tiny_gguf import write_tiny_gguf

PROMPTS = ("The tide comes in twice a day, and the harbour", "Write a short note to the team about the",
           "In the morning the servers were busy, so the", "Explain why a checkpoint taken before a",
           "Once upon a time, in a datacenter far away,", "The quick brown fox jumps over the lazy dog and",
           "List three reasons to lend idle GPUs at night:", "Summarise the weather report for the coast:")
PHASES = ("before", "lent", "reclaiming", "after")
MIN_REQUESTS = 10  # a phase with fewer requests in either run has no TTFT ratio (its p99 is one request's)
TRAIN_RANK = ("import numpy as np\na = np.random.default_rng(0).random((384, 384))\n"
              "while True:\n    a = np.tanh(a @ a.T / 384.0)\n")  # the spot job's rank: CPU-bound, no I/O


@dataclass(frozen=True)
class BenchOptions:
    replicas: int = 2
    rate_per_s: float = 4.0
    duration_s: float = 24.0
    lend_at: float = 0.25  # fraction of the run: the loan starts
    due_at: float = 0.7  # ... serving needs the replica back (the notice comes one lead time earlier)
    max_tokens: int = 32
    slo_s: float = 0.5  # p99 TTFT target the queueing model lends against
    slots: int = 2
    threads: int = 1
    seed: int = 0
    model: str | None = None  # default: the tiny model, written in the work directory
    pin: bool = True  # replicas and the training rank on disjoint CPUs (where there are 2 or more)
    train: bool = True  # a training rank on the lent replicas' CPUs while they are lent
    pairs: int = 1  # runs with and without lending, in turns; each phase pooled over them

    def check(self) -> None:
        if not 2 <= self.replicas <= 16:
            raise ValueError(f"--replicas {self.replicas}: expected 2 to 16 (one is lent, one serves)")
        if not (0 < self.rate_per_s <= 200 and 4 <= self.duration_s <= 3600):
            raise ValueError("--rate must be in (0, 200] requests/s and --duration-s in [4, 3600]")
        if not 0 < self.lend_at < self.due_at < 1:
            raise ValueError("lend_at < due_at, both fractions of the run in (0, 1)")
        if not 1 <= self.max_tokens <= 1024 or not self.slo_s > 0:
            raise ValueError("--max-tokens must be 1 to 1024 and --slo-s > 0")
        if not 1 <= self.pairs <= 50:
            raise ValueError(f"--pairs {self.pairs}: expected 1 to 50")


def cpu_sets(replicas: int, pin: bool) -> list[list[int]] | None:
    """The CPUs of each replica (replica i: CPU i mod N of this process's); None without ``pin`` or with
    fewer than 2 CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    return [[cpus[i % len(cpus)]] for i in range(replicas)] if pin and len(cpus) >= 2 else None


def start_training(r: EngineReplicas, lent: list[int]) -> tuple[subprocess.Popen, list[int] | None]:
    """The training rank on the lent replicas' CPUs that no serving replica has (all of them when that
    leaves none; any CPU when the replicas are not pinned)."""
    theirs = sorted({c for i in lent for c in r.cpus_of(i) or ()})
    serving = {c for i in r.routed() for c in r.cpus_of(i) or ()}
    cpus = [c for c in theirs if c not in serving] or theirs or None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(on_cpus([sys.executable, "-c", TRAIN_RANK], cpus), env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True), cpus


def request_body(i: int, max_tokens: int) -> bytes:
    """The i-th request: a real prompt, ``max_tokens`` streamed tokens (end-of-text ignored)."""
    return json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()


def phase_stats(recs: list[loadgen.Record], spans: list[tuple[float, float]]) -> dict[str, Any]:
    """The requests due within ``spans`` (traffic seconds, ``[from, to)``): count, failed, TTFT p50/p99,
    tokens/s over the spans' length."""
    sel = [r for r in recs if any(lo <= r.t_s < hi for lo, hi in spans)]
    ttft = np.array([r.ttft_s for r in sel if r.ok and r.ttft_s is not None], dtype=float)
    q = (lambda p: round(float(np.quantile(ttft, p)), 4)) if len(ttft) else (lambda p: None)
    span = sum(hi - lo for lo, hi in spans)
    return {"from_s": round(spans[0][0], 2) if spans else None, "to_s": round(spans[-1][1], 2) if spans
            else None, "seconds": round(span, 2), "requests": len(sel), "failed": sum(not r.ok for r in sel),
            "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99),
            "tokens_per_s": round(sum(r.tokens for r in sel if r.ok) / span, 1) if span > 0 else None,
            "errors": sorted({r.error for r in sel if not r.ok})[:3]}


def compare(with_: dict[str, dict], without: dict[str, dict], phases: tuple[str, ...]) -> dict[str, Any]:
    """TTFT p99 ratios (with lending ÷ without) of every phase that holds :data:`MIN_REQUESTS` in both;
    ``ttft_p99_ratio``: the worst of ``phases`` (the others, run alike in both, show the noise)."""
    ratios = {}
    for p in with_:
        a, b = with_[p]["ttft_p99_s"], without[p]["ttft_p99_s"]
        if a is not None and b and min(with_[p]["requests"], without[p]["requests"]) >= MIN_REQUESTS:
            ratios[p] = round(a / b, 3)
    worst = [ratios[p] for p in phases if p in ratios]
    failed = {"with_lending": sum(v["failed"] for v in with_.values()),
              "without": sum(v["failed"] for v in without.values())}
    return {"ttft_p99_ratio": max(worst) if worst else None, "ttft_p99_ratio_by_phase": ratios,
            "requests_failed": failed,
            "requests_failed_by_reclaim": max(0, failed["with_lending"] - failed["without"])}


def one_run(opts: BenchOptions, model: Path, workdir: Path, lend: bool,
            bounds: tuple[float, float, float] | None = None) -> tuple[dict[str, Any], list[loadgen.Record]]:
    """One run of the traffic; with ``lend``, the loan and its reclaim. ``bounds``: the phase limits
    (lent from, notice at, serving again at: traffic seconds) to cut this run's records at (the lending
    run's, for the run without). Returns its figures and its requests."""
    d = opts.duration_s
    rate = loadgen.constant(opts.rate_per_s)
    recs: list[loadgen.Record] = []
    failed: list[str] = []
    cpus = cpu_sets(opts.replicas, opts.pin)
    trainer: subprocess.Popen | None = None
    train_cpus: list[int] | None = None
    trained_s = 0.0
    with EngineReplicas(model, workdir, opts.replicas, slots=opts.slots, threads=opts.threads,
                        cpus=cpus) as r:
        warm = r.warmup_s() or 0.0
        r.planned_warmup_s = lead_s = max(0.2, 2.0 * warm)  # the notice comes this long before it is due
        url = f"{r.url}/v1/completions"
        t0 = time.perf_counter()
        unix0 = time.time()

        def traffic() -> None:
            try:
                recs.extend(asyncio.run(loadgen.generate(
                    url, rate, d, body=lambda i: request_body(i, opts.max_tokens), stream=True,
                    seed=opts.seed, start=t0, timeout_s=60.0)))
            except Exception as e:  # noqa: BLE001 (said in the result)
                failed.append(f"{type(e).__name__}: {e}")

        th = threading.Thread(target=traffic, name="tidal-engine-traffic", daemon=True)
        th.start()
        now = lambda: time.perf_counter() - t0  # noqa: E731
        scrape_at = opts.lend_at * d * 0.2
        while now() < scrape_at:
            time.sleep(0.05)
        s0, n0, m0 = r.scrape(), r.router_requests(), now()
        while now() < opts.lend_at * d:
            time.sleep(0.05)
        s1, n1 = r.scrape(), r.router_requests()
        common = sorted(set(s0) & set(s1))
        demand = replicas_needed([s0[i] for i in common], [s1[i] for i in common], now() - m0,
                                 slo_s=opts.slo_s, slots=opts.slots, router_requests=n1 - n0)
        lendable = 0 if math.isnan(demand.replicas) else max(0, opts.replicas - int(demand.replicas))
        due_s = opts.due_at * d
        lent_from = notice = back = None
        lent = list(range(opts.replicas - lendable, opts.replicas)) if lend else []
        if lent:
            lent_from = now()
            for i in lent:
                r.lend(i)
            if opts.train:
                trainer, train_cpus = start_training(r, lent)
        missed = 0
        while now() < d:
            r.check()
            if lent and notice is None and now() >= due_s - lead_s:
                notice, broke = now(), 0
                if trainer is not None:  # the notice: the rank leaves the lent GPUs, then serving starts
                    stop_process(trainer, 5.0)
                    trainer, trained_s = None, now() - (lent_from or 0.0)
                for i in lent:
                    try:
                        r.take_back(i)
                    except EngineError:  # its events say why; the replica stays out
                        broke += 1
                back = now()
                missed = broke if back <= due_s else len(lent)
            time.sleep(0.05)
        stop_process(trainer, 5.0)
        th.join(d + 120.0)
        events = [{**e, "at_s": round(e["time_s"] - unix0, 3)} for e in r.events]
        starts = list(r.starts)
    if bounds is None:
        bounds = (lent_from or due_s, notice or due_s, max(back or due_s, due_s))
    phases = pooled([(recs, bounds)], d)
    return {"lending": lend, "phases": phases, "bounds": bounds, "demand": asdict(demand),
            "lendable": lendable, "lent": lent, "lead_s": round(lead_s, 3), "due_s": due_s,
            "notice_s": notice, "back_s": back, "returns_missed": missed, "loaned_replica_s":
            len(lent) * (notice - lent_from) if lent_from is not None and notice is not None else 0.0,
            "start_to_healthy_s": [round(x, 3) for x in starts], "events": events,
            "cpus": {"replicas": cpus, "training": train_cpus, "trained_s": round(trained_s, 2)},
            "traffic_error": failed[0] if failed else None}, recs


def pooled(runs: list[tuple[list[loadgen.Record], tuple[float, float, float]]], duration_s: float
           ) -> dict[str, dict[str, Any]]:
    """Each phase's figures over the requests of every run, each run cut at its own ``bounds``."""
    recs: list[loadgen.Record] = []
    spans: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
    for j, (rs, bounds) in enumerate(runs):  # run j laid after the ones before it on one time line
        off = j * (duration_s + 1.0)
        recs += [replace(r, t_s=r.t_s + off) for r in rs]
        cuts = [0.0, *bounds, duration_s]
        for k, p in enumerate(PHASES):
            spans[p].append((cuts[k] + off, cuts[k + 1] + off))
    return {p: phase_stats(recs, spans[p]) for p in PHASES}


def run(opts: BenchOptions, workdir: str | Path | None = None) -> dict[str, Any]:
    """Both runs, lending first (its phase limits cut the other's records), ``pairs`` times in turns, and
    the comparison of the phases pooled over the pairs (with one pair, its own)."""
    opts.check()
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    recs: tuple[list, list] = ([], [])
    with tempfile.TemporaryDirectory(prefix="tidal-engine-bench-", dir=workdir) as tmp:
        model = Path(opts.model) if opts.model else write_tiny_gguf(Path(tmp) / "tiny.gguf")
        for k in range(opts.pairs):
            o = replace(opts, seed=opts.seed + k)  # each pair its own arrivals, the same on both sides
            w, w_recs = one_run(o, model, Path(tmp) / f"lending-{k}", True)
            b, b_recs = one_run(o, model, Path(tmp) / f"baseline-{k}", False, w["bounds"])
            pairs.append((w, b))
            recs[0].append((w_recs, w["bounds"]))
            recs[1].append((b_recs, w["bounds"]))
    with_, without = pairs[0]
    if opts.pairs > 1:
        with_ = {**with_, "phases": pooled(recs[0], opts.duration_s)}
        without = {**without, "phases": pooled(recs[1], opts.duration_s)}
    lending = ("lent", "reclaiming")
    return {"engine": {"name": "llama.cpp", "version": engine_version(llama_server())},
            "options": asdict(opts), **compare(with_["phases"], without["phases"], lending),
            "reclaim_notices": sum(w["notice_s"] is not None for w, _ in pairs),
            "returns_missed": sum(w["returns_missed"] for w, _ in pairs),
            "loaned_gpu_hours": round(sum(w["loaned_replica_s"] for w, _ in pairs) / 3600.0, 6),
            "with_lending": with_, "without_lending": without,
            **({"pairs": [{**compare(w["phases"], b["phases"], lending), "with_lending": w,
                           "without_lending": b} for w, b in pairs]} if opts.pairs > 1 else {})}

"""What the rank sandbox costs (tidal.exec.sandbox): rank start time and a training step, with and without.

    PYTHONPATH=src python -m lab.sandbox_overhead [--pairs 10] [--steps 40] [--no-memory-cgroup] [--json]

Two local executors, one sandboxed (the default) and one with ``isolation: none``, run the same jobs in
pairs, the two variants back to back (which one goes first alternates from pair to pair, so neither
always gets the warmer or the quieter moment): (1) a 1-rank job whose first Python line prints
``time.time()`` (start = that minus the launch call; the interpreter's own start-up is in both); (2) a
2-rank DDP job over gloo (an MLP of 4 x 1024 x 1024, batch 64) printing its median step time over
``--steps`` steps after 5 warm-up steps. Each pair gives a step ratio (sandbox / none) and a start
difference (sandbox - none); printed: their median and quartiles, and each variant's medians. On a
loaded machine the load drifts between pairs but less within one, which is why the ratio is per pair.
The defaults take about 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tidal.exec.isolation import IsolationConfig
from tidal.exec.local import LocalExecutor
from tidal.exec.protocol import LaunchRequest

START = "import time; print('T0', time.time(), flush=True)"
STEP = """
import os, statistics, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
m = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024)] * 4))
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
x = torch.randn(64, 1024)
times = []
for i in range(5 + int(os.environ["STEPS"])):
    t = time.perf_counter()
    opt.zero_grad(); m(x).square().mean().backward(); opt.step()
    times.append(time.perf_counter() - t)
print("STEP", statistics.median(times[5:]), flush=True)
dist.destroy_process_group()
"""
VARIANTS = ("sandbox", "none")


def _run(ex: LocalExecutor, job: str, code: str, n: int, env: dict[str, str]) -> tuple[float, str]:
    t = time.time()
    ex.launch(LaunchRequest(job, 1, (sys.executable, "-c", code), {"local": n}, env=env), t)
    while not ex.observe(time.time())[job].done:
        time.sleep(0.01)
    ex.release(job)
    return t, Path(ex.log_path(job, 0)).read_text()


def _one(ex: LocalExecutor, i: int, steps: int) -> tuple[float, float]:
    """One variant's (rank start s, median step s) in pair ``i``."""
    t, log = _run(ex, f"s{i}", START, 1, {})
    start_s = float(log.split("T0 ")[-1].split()[0]) - t
    _, log = _run(ex, f"d{i}", STEP, 2, {"STEPS": str(steps)})
    return start_s, float(log.split("STEP ")[-1].split()[0])


def _spread(xs: list[float]) -> dict[str, float]:
    """Median and quartiles (``statistics.quantiles``, inclusive)."""
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"q1": q1, "median": q2, "q3": q3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-memory-cgroup", action="store_true", help="max_memory_bytes: null in both")
    a = ap.parse_args()
    if a.pairs < 2:
        ap.error("--pairs must be at least 2 (quartiles of the per-pair ratios)")
    base = Path(tempfile.mkdtemp(prefix="tidal-sbx-bench-"))
    memory = {"max_memory_bytes": None} if a.no_memory_cgroup else {}
    variants = {"sandbox": IsolationConfig(**memory), "none": IsolationConfig(mode="none", **memory)}
    exs = {k: LocalExecutor(base / k / "jobs", slots=2, isolation=iso) for k, iso in variants.items()}
    got: dict[str, dict[str, list[float]]] = {k: {"start_s": [], "step_s": []} for k in VARIANTS}
    t0 = time.monotonic()
    _one(exs["none"], -1, 5)  # warm-up (page cache, torch's first import): in neither variant's figures
    for i in range(a.pairs):
        for k in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            start_s, step_s = _one(exs[k], i, a.steps)
            got[k]["start_s"].append(start_s)
            got[k]["step_s"].append(step_s)
    s, n = got["sandbox"], got["none"]
    out = {
        "pairs": a.pairs, "steps": a.steps, "wall_s": time.monotonic() - t0,
        "step_ratio": _spread([x / y for x, y in zip(s["step_s"], n["step_s"], strict=True)]),
        "start_extra_s": _spread([x - y for x, y in zip(s["start_s"], n["start_s"], strict=True)]),
        "median": {k: {m: statistics.median(v) for m, v in d.items()} for k, d in got.items()},
        "samples": got,
    }
    if a.json:
        print(json.dumps(out))
        return
    print(f"{'variant':<9} {'rank start s':>13} {'step ms':>9}   (medians of {a.pairs} runs)")
    for k, m in out["median"].items():
        print(f"{k:<9} {m['start_s']:13.3f} {m['step_s'] * 1e3:9.2f}")
    r, e = out["step_ratio"], out["start_extra_s"]
    print(f"per pair, sandbox/none step: median x{r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f}); "
          f"start +{e['median'] * 1e3:.0f} ms (quartiles {e['q1'] * 1e3:.0f}-{e['q3'] * 1e3:.0f} ms); "
          f"{out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

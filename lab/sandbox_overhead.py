"""What the rank sandbox costs (tidal.exec.sandbox): rank start time and a training step, with and without.

    PYTHONPATH=src python -m lab.sandbox_overhead [--runs 3] [--steps 40] [--no-memory-cgroup] [--json]

Each run launches the same jobs on two local executors, one sandboxed (the default) and one with
``isolation: none``, alternating: (1) a 1-rank job whose first Python line prints ``time.time()``
(start = that minus the launch call; the interpreter's own start-up is in both); (2) a 2-rank DDP job
over gloo (an MLP of 4 x 1024 x 1024, batch 64) printing its median step time over ``--steps``
steps after 5 warm-up steps. Prints medians per variant and the ratios.
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


def _run(ex: LocalExecutor, job: str, code: str, n: int, env: dict[str, str]) -> tuple[float, str]:
    t = time.time()
    ex.launch(LaunchRequest(job, 1, (sys.executable, "-c", code), {"local": n}, env=env), t)
    while not ex.observe(time.time())[job].done:
        time.sleep(0.01)
    ex.release(job)
    return t, Path(ex.log_path(job, 0)).read_text()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-memory-cgroup", action="store_true", help="max_memory_bytes: null in both")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tidal-sbx-bench-"))
    memory = {"max_memory_bytes": None} if a.no_memory_cgroup else {}
    variants = {"sandbox": IsolationConfig(**memory), "none": IsolationConfig(mode="none", **memory)}
    exs = {k: LocalExecutor(base / k / "jobs", slots=2, isolation=iso) for k, iso in variants.items()}
    got: dict[str, dict[str, list[float]]] = {k: {"start_s": [], "step_s": []} for k in variants}
    for i in range(a.runs):
        for k, ex in exs.items():
            t, log = _run(ex, f"s{i}", START, 1, {})
            got[k]["start_s"].append(float(log.split("T0 ")[-1].split()[0]) - t)
            _, log = _run(ex, f"d{i}", STEP, 2, {"STEPS": str(a.steps)})
            got[k]["step_s"].append(float(log.split("STEP ")[-1].split()[0]))
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in got.items()}
    out = {"median": med, "ratio": {m: med["sandbox"][m] / med["none"][m] for m in ("start_s", "step_s")},
           "runs": a.runs, "steps": a.steps}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{'variant':<9} {'rank start s':>13} {'step s':>9}")
    for k, m in med.items():
        print(f"{k:<9} {m['start_s']:13.3f} {m['step_s']:9.4f}")
    extra_s = med["sandbox"]["start_s"] - med["none"]["start_s"]
    print(f"sandbox/none: start x{out['ratio']['start_s']:.2f} (+{extra_s:.3f} s), "
          f"step x{out['ratio']['step_s']:.3f}")


if __name__ == "__main__":
    main()

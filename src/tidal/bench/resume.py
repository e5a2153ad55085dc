"""``tidal bench resume`` (or ``python -m tidal.bench.resume --json``): notice → exit, and process start →
first step after a resharded restore from node memory and from disk, for the example job (docs/train.md)."""

from __future__ import annotations

import argparse
import json
import operator
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import reduce
from pathlib import Path
from typing import Any

from tidal.bench.runs import Segment, SegmentResult, check_model, example_script, job_env, run_segment
from tidal.contract import ENV_CKPT_URL


@dataclass
class MeasureConfig:
    world: int = 2
    layout: str = "fsdp"
    resume_world: int = 1
    resume_layout: str = "ddp"
    n_embd: int = 384
    n_layer: int = 6
    n_head: int = 6
    block: int = 128
    global_batch: int = 8
    micro_batch: int = 2
    notice_step: int = 3
    repeat: int = 1
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_model([self.layout, self.resume_layout], self.n_embd, self.n_head)

    def job_args(self, steps: int) -> list[str]:
        return ["--steps", str(steps), "--global-batch", str(self.global_batch), "--micro-batch",
                str(self.micro_batch), "--block", str(self.block), "--n-layer", str(self.n_layer), "--n-head",
                str(self.n_head), "--n-embd", str(self.n_embd), "--ckpt-every", "2", "--log-every", "1"]


def _ckpt_bytes(url: Path) -> int:
    from tidal import ckpt

    _, man = ckpt.read_manifest(url)
    return sum(p.nbytes for t in man.tensors.values() for p in t.pieces)


def run_once(
    cfg: MeasureConfig, script: Path, work: Path, shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    env = job_env(work, shm)
    log(f"notice: {cfg.layout} x{cfg.world}, SIGTERM to every rank once step {cfg.notice_step} is reported")
    stop = run_segment(Segment(cfg.world, cfg.layout, stop_at=cfg.notice_step), script, cfg.job_args(10**6),
                       work, 0, env=env, timeout_s=cfg.timeout_s)
    s = stop.summary()
    steps = stop.events("step")
    step_times = [r["step_time_s"] for r in steps if r.get("step_time_s")]
    ckpts = stop.events("checkpoint")
    notice_ckpt = [c for c in ckpts if c.get("reason") == "notice"]
    stall = notice_ckpt[0]["stall_s"] if notice_ckpt else 0.0
    step_s = statistics.median(step_times) if step_times else None
    pre = (stop.events("preempted") or [{}])[0]
    notice_rec = (stop.events("notice") or [{}])[0]
    persist = [c["persist_s"] for c in stop.events("committed") if c.get("persist_s")]
    sent = stop.notice_unix
    notice = {
        "persist_s": statistics.median(persist) if persist else None, "stop_step": s["stop_step"],
        "committed_tiers": s["stop_tiers"], "exit_codes": s["exit_codes"],
        "notice_to_exit_s": s["notice_to_exit_s"],
        "notice_to_commit_s": (pre["time"] - sent) if pre and sent else None, "step_s": step_s,
        "save_stall_s": stall,
        "signal_to_step_end_s": (notice_rec["time"] - sent) if notice_rec and sent else None,
        "goal_s": (step_s or 0.0) + stall + 1.0, "checkpoint_bytes": _ckpt_bytes(work / "ckpt")}
    took = notice["notice_to_exit_s"]
    notice["within_goal"] = took is not None and took <= notice["goal_s"]
    disk_copy = work / "ckpt-disk-only"
    shutil.copytree(work / "ckpt", disk_copy)  # another URL: no node-memory tier holds it
    resumes = {}
    for i, (name, url) in enumerate((("node_memory", work / "ckpt"), ("disk", disk_copy))):
        target = int(s["stop_step"] or cfg.notice_step) + 2  # the disk tier may hold an older step
        log(f"resume from {name}: {cfg.resume_layout} x{cfg.resume_world}, to step {target}")
        # the same job's next attempts: its checkpoint key, which signs the manifests, is the job's
        res = run_segment(Segment(cfg.resume_world, cfg.resume_layout), script, cfg.job_args(target),
                          work, i + 1, env={**env, ENV_CKPT_URL: str(url)}, timeout_s=cfg.timeout_s)
        resumes[name] = _resume_figures(res)
    return {"notice": notice, "resume": resumes}


def _resume_figures(res: SegmentResult) -> dict[str, Any]:
    start = (res.events("start") or [{}])[0]
    restore = (res.events("restore") or [{}])[0]
    first = (res.events("step") or [{}])[0]
    t0 = res.started_unix
    return {
        "restored_step": restore.get("step"), "tier": restore.get("tier"),
        "saved_world_size": restore.get("saved_world_size"), "bytes_read": restore.get("bytes_read"),
        "read_amplification": restore.get("read_amplification"),
        "start_to_session_s": start["time"] - t0 if start else None,
        "setup_s": restore["time"] - restore["duration_s"] - start["time"] if start and restore else None,
        "restore_s": restore.get("duration_s"),
        "start_to_restored_s": restore["time"] - t0 if restore else None,
        "first_step_s": first.get("time", 0) - restore.get("time", 0) if first and restore else None,
        "start_to_first_step_s": first["time"] - t0 if first else None}


def run(
    cfg: MeasureConfig, *, script: Path | None = None, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    script = example_script(script)
    shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
    runs = []
    for i in range(cfg.repeat):
        work = Path(tempfile.mkdtemp(prefix="tidal-bench-resume-"))
        shm = Path(tempfile.mkdtemp(prefix="tidal-bench-resume-shm-", dir=shm_parent))
        try:
            log(f"repeat {i + 1}/{cfg.repeat}")
            runs.append(run_once(cfg, script, work, shm, log))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)

    def med(*path: str) -> float | None:
        got: list[Any] = [reduce(operator.getitem, path, r) for r in runs]
        vals = [float(v) for v in got if isinstance(v, (int, float))]
        return statistics.median(vals) if vals else None

    summary = {k: med("notice", k) for k in ("notice_to_exit_s", "goal_s", "step_s", "save_stall_s")}
    for t in ("node_memory", "disk"):
        summary[f"start_to_first_step_{t}_s"] = med("resume", t, "start_to_first_step_s")
        summary[f"restore_{t}_s"] = med("resume", t, "restore_s")
    from tidal.bench.ckpt_state import machine

    return {"config": asdict(cfg), "machine": machine(), "summary": summary, "runs": runs}


def render(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    cfg, m = result["config"], result["machine"]

    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    t = Table(title=f"reclaim notice → exit ({cfg['layout']} x{cfg['world']}, {m['cpu_count']} CPUs, "
                    f"gpu: {m['gpu'] or 'none'}; seconds)", title_justify="left")
    for col in ("run", "ckpt MB", "step", "stall", "persist", "signal→step end", "→ committed", "→ exit",
                "goal", "tiers", "exit"):
        t.add_column(col, justify="right")
    for i, r in enumerate(result["runs"]):
        n = r["notice"]
        t.add_row(str(i), f(n["checkpoint_bytes"] / 1e6, "{:.0f}"), f(n["step_s"]),
                  f(n["save_stall_s"], "{:.3f}"), f(n["persist_s"]), f(n["signal_to_step_end_s"]),
                  f(n["notice_to_commit_s"]), f(n["notice_to_exit_s"]),
                  f(n["goal_s"]) + (" ok" if n["within_goal"] else " MISSED"),
                  ",".join(n["committed_tiers"] or []), ",".join(map(str, n["exit_codes"])))
    console.print(t)
    t2 = Table(title=f"process start → first step after a resharded restore ({cfg['layout']} x{cfg['world']} "
               f"→ {cfg['resume_layout']} x{cfg['resume_world']}; seconds)", title_justify="left")
    for col in ("run", "from", "tier", "step", "start→session", "setup", "restore", "1st step",
                "start→1st step"):
        t2.add_column(col, justify="right")
    for i, r in enumerate(result["runs"]):
        for name, x in r["resume"].items():
            t2.add_row(str(i), name.replace("node_memory", "node mem"), str(x["tier"]),
                       str(x["restored_step"]), f(x["start_to_session_s"]), f(x["setup_s"]),
                       f(x["restore_s"], "{:.3f}"),
                       f(x["first_step_s"]), f(x["start_to_first_step_s"]))
    console.print(t2)


def main(argv: list[str] | None = None) -> None:
    """``python -m tidal.bench.resume [--json] [--repeat N] ...``"""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(MeasureConfig()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--script", type=Path, default=None)
    a = vars(p.parse_args(argv))
    as_json, script = a.pop("json"), a.pop("script")
    from rich.console import Console

    err = Console(stderr=True)
    result = run(MeasureConfig(**a), script=script, log=lambda s: err.print(f"[dim]{s}[/]", highlight=False))
    render(result, err if as_json else Console())
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()

"""``tidal verify-resume``: the example job run uninterrupted and as a chain of interrupted, resharded
segments must train on identical global batches with losses within ``rtol`` (docs/train.md)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tidal.bench.runs import (
    Segment,
    SegmentResult,
    check_model,
    example_script,
    job_env,
    per_step,
    run_segment,
)
from tidal.train.data import check_batch


@dataclass
class VerifyConfig:
    steps: int = 24
    baseline: tuple[int, str] = (4, "fsdp")
    plan: list[tuple[int, str]] = field(default_factory=lambda: [(4, "fsdp"), (2, "ddp"), (3, "fsdp")])
    rtol: float = 1e-3
    global_batch: int = 24
    micro_batch: int = 2
    block: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    ckpt_every: int = 5
    seed: int = 1337
    timeout_s: float = 300.0

    def job_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--global-batch", str(self.global_batch), "--micro-batch",
                str(self.micro_batch), "--block", str(self.block), "--n-layer", str(self.n_layer), "--n-head",
                str(self.n_head), "--n-embd", str(self.n_embd), "--seed", str(self.seed), "--ckpt-every",
                str(self.ckpt_every), "--warmup", "4", "--log-every", str(10**9), "--record-indices"]

    def segments(self) -> list[Segment]:
        """The interrupted run: notices spread evenly, SIGTERM to one rank and the notice file in turn."""
        n = len(self.plan)
        out = []
        for i, (world, layout) in enumerate(self.plan):
            if i == n - 1:
                out.append(Segment(world, layout))
                continue
            stop = max(1, round(self.steps * (i + 1) / n) - 1)
            out.append(Segment(world, layout, stop_at=stop, notice="sigterm" if i % 2 == 0 else "file",
                               notice_ranks=[world - 1] if i % 2 == 0 else None))
        return out

    def check(self) -> None:
        """Reject impossible settings before starting any process."""
        if self.steps < len(self.plan) + 1:
            raise ValueError(f"steps ({self.steps}) must exceed the number of segments ({len(self.plan)})")
        check_model([layout for _, layout in [self.baseline, *self.plan]], self.n_embd, self.n_head)
        for world, layout in [self.baseline, *self.plan]:
            if layout == "single" and world != 1:
                raise ValueError(f"layout 'single' runs on 1 rank, not {world}")
            dp = world // 2 if layout == "tp" else world
            if layout == "tp" and (world % 2 or self.n_head % 2):
                raise ValueError(f"layout 'tp' (tp=2) needs an even world size and n_head, got {world}, "
                                 f"{self.n_head}")
            check_batch(self.global_batch, self.micro_batch, dp)


def parse_plan(text: str) -> list[tuple[int, str]]:
    """``"4:fsdp,2:ddp,3:fsdp"`` -> ``[(4, "fsdp"), (2, "ddp"), (3, "fsdp")]``."""
    out = []
    for part in text.split(","):
        world, _, layout = part.strip().partition(":")
        try:
            out.append((int(world), layout or "fsdp"))
        except ValueError:
            raise ValueError(f"plan item {part!r}: expected WORLD:LAYOUT, e.g. 4:fsdp") from None
    return out


def run(cfg: VerifyConfig, *, workdir: Path | None = None, script: Path | None = None,
        log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run both jobs and compare them; returns the JSON-able result (``result["ok"]`` is the verdict)."""
    cfg.check()
    script = example_script(script)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="tidal-verify-")) if workdir is None else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
    shm = Path(tempfile.mkdtemp(prefix="tidal-verify-shm-", dir=shm_parent))
    try:
        w, layout = cfg.baseline
        log(f"baseline: {layout} x{w}, {cfg.steps} steps")
        base = [run_segment(Segment(w, layout), script, cfg.job_args(), work / "baseline", 0,
                            env=job_env(work / "baseline", shm / "baseline"), timeout_s=cfg.timeout_s)]
        resumed: list[SegmentResult] = []
        for i, seg in enumerate(cfg.segments()):
            log(f"segment {i}: {seg.describe()}")
            env = job_env(work / "resumed", shm / "resumed")
            resumed.append(run_segment(seg, script, cfg.job_args(), work / "resumed", i, env=env,
                                       timeout_s=cfg.timeout_s))
        return compare(cfg, base, resumed, work=work if not own else None)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)


def compare(cfg: VerifyConfig, base: list[SegmentResult], resumed: list[SegmentResult], *,
            work: Path | None = None) -> dict[str, Any]:
    b, r = per_step(base), per_step(resumed)
    wanted = list(range(1, cfg.steps + 1))
    missing = {"baseline": [s for s in wanted if s not in b], "resumed": [s for s in wanted if s not in r]}
    rows = []
    first_mismatch = None
    max_rel, max_rel_step = 0.0, None
    for s in wanted:
        if s not in b or s not in r:
            continue
        same = b[s]["indices"] == r[s]["indices"] and bool(b[s]["indices"])
        if not same and first_mismatch is None:
            first_mismatch = s
        lb, lr = b[s]["loss"], r[s]["loss"]
        rel = abs(lb - lr) / max(abs(lb), 1e-12) if lb is not None and lr is not None else None
        if rel is not None and rel >= max_rel:
            max_rel, max_rel_step = rel, s
        rows.append({"step": s, "baseline_loss": lb, "resumed_loss": lr, "rel_diff": rel,
                     "same_indices": same, "segment": r[s]["segment"]})
    # Steps before the first world-size change ran in the same world and layout: they must match exactly.
    seg0 = [row for row in rows if row["segment"] == 0]
    same_layout = base[0].segment.world == resumed[0].segment.world and \
        base[0].segment.layout == resumed[0].segment.layout
    bitwise_first = all(row["rel_diff"] == 0.0 for row in seg0) if same_layout and seg0 else None
    indices_ok = first_mismatch is None and not missing["baseline"] and not missing["resumed"]
    loss_ok = max_rel <= cfg.rtol and len(rows) == len(wanted)
    stops = [res.summary()["stop_step"] for res in resumed[:-1]]
    return {"ok": bool(indices_ok and loss_ok), "indices_identical": indices_ok,
            "first_index_mismatch_step": first_mismatch, "missing_steps": missing,
            "max_rel_loss_diff": max_rel, "max_rel_loss_diff_step": max_rel_step, "rtol": cfg.rtol,
            "bitwise_equal_before_first_change": bitwise_first, "stop_steps": stops,
            "baseline": [res.summary() for res in base], "segments": [res.summary() for res in resumed],
            "steps": rows,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
            "workdir": str(work) if work else None}


def render(result: dict[str, Any], console: Any) -> None:
    """The result as Rich tables."""
    from rich.table import Table

    t = Table(title="runs (times in seconds)", title_justify="left")
    for col in ("run", "ranks", "ended by", "steps", "exit", "notice→exit", "restore", "start→1st step"):
        t.add_column(col, justify="left" if col in ("run", "ranks", "ended by") else "right")

    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    for name, segs in (("baseline", result["baseline"]), ("resumed", result["segments"])):
        for i, s in enumerate(segs):
            t.add_row(name if name == "baseline" else f"resumed {i}", f"{s['layout']} x{s['world']}",
                      s["ending"], f"{s['restored_step']}→{f(s['last_step'], '{}')}",
                      ",".join(map(str, s["exit_codes"])), f(s["notice_to_exit_s"]), f(s["restore_s"]),
                      f(s["start_to_first_step_s"]))
    console.print(t)
    rows = result["steps"]
    st = Table(title="loss per step (around each resume, and a sample)", title_justify="left")
    for col in ("step", "run", "baseline loss", "resumed loss", "rel diff", "same batch"):
        st.add_column(col, justify="right")
    changes = {row["step"] for i, row in enumerate(rows) if i and row["segment"] != rows[i - 1]["segment"]}
    stride = max(1, len(rows) // 8)
    for i, row in enumerate(rows):
        if i % stride == 0 or row["step"] in changes or row["step"] - 1 in changes or i == len(rows) - 1:
            st.add_row(str(row["step"]), f"resumed {row['segment']}", f(row["baseline_loss"], "{:.6f}"),
                       f(row["resumed_loss"], "{:.6f}"), f(row["rel_diff"], "{:.2e}"),
                       "yes" if row["same_indices"] else "NO")
    console.print(st)
    verdict = "[green]PASS[/]" if result["ok"] else "[red]FAIL[/]"
    console.print(
        f"{verdict}: data order {'identical' if result['indices_identical'] else 'DIFFERENT'} on all "
        f"{len(rows)} steps"
        + ("" if (bad := result["first_index_mismatch_step"]) is None else f" (first mismatch at step {bad})")
        + "; max relative loss difference "
        f"{result['max_rel_loss_diff']:.2e} at step {result['max_rel_loss_diff_step']} (tolerance "
        f"{result['rtol']:.0e}); bitwise equal before the first world-size change: "
        f"{result['bitwise_equal_before_first_change']}")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Both loss curves, the interruption points and the relative difference, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["steps"]
    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    base_label = "baseline: {layout} x{world}, uninterrupted".format(**result["baseline"][0])
    chain = " → ".join("{layout} x{world}".format(**s) for s in result["segments"])
    ax.plot(steps, [r["baseline_loss"] for r in rows], label=base_label, lw=2.5, color="#999999")
    ax.plot(steps, [r["resumed_loss"] for r in rows], label=f"interrupted: {chain}", lw=1.2, ls="--",
            color="#d62728")
    for s in result["stop_steps"]:
        if s is not None:
            for a in (ax, ax2):
                a.axvline(s + 0.5, color="#1f77b4", lw=0.8, ls=":")
    ax.set_ylabel("training loss")
    ax.set_title(f"tidal verify-resume: {'PASS' if result['ok'] else 'FAIL'} "
                 f"(max rel diff {result['max_rel_loss_diff']:.1e}, tolerance {result['rtol']:.0e})")
    ax.legend()
    rel = [max(r["rel_diff"] or 0.0, 1e-12) for r in rows]
    ax2.semilogy(steps, rel, color="#2ca02c", marker=".", lw=0.8)
    ax2.axhline(result["rtol"], color="#d62728", lw=0.8, ls="--")
    ax2.set_ylabel("rel. diff")
    ax2.set_xlabel("step (dotted: reclaim notice, resume on another world size)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

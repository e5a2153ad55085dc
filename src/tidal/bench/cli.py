"""``tidal bench``: benchmarks that print a Rich table, or JSON on stdout with ``--json``; and
``tidal verify-resume`` (``verify_resume``, registered by :mod:`tidal.cli`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help="Benchmarks (side by side, --json).", no_args_is_help=True, add_completion=False)


def _consoles(json_out: bool) -> tuple[Any, Any, Callable[[str], None]]:
    """(stderr console, the tables' console: stderr with ``--json``, a progress logger to stderr)."""
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    return err, err if json_out else Console(), lambda s: err.print(f"[dim]{escape(s)}[/]", highlight=False)


def _show(result: dict[str, Any], render: Callable[[dict[str, Any], Any], None], out: Any,
          json_out: bool) -> None:
    render(result, out)
    if json_out:
        print(json.dumps(result, indent=2))


@app.command("ckpt")
def ckpt(
    size_gb: float = typer.Option(1.0, "--size-gb", min=0.0001, help="State size in GB (1e9 bytes): "
                                  "parameters + Adam exp_avg + exp_avg_sq, fp32."),
    repeat: int = typer.Option(5, "--repeat", min=1, help="Timed repeats; medians are reported."),
    json_out: bool = typer.Option(False, "--json",
                                  help="Print a JSON object on stdout (the table goes to stderr)."),
    directory: Path | None = typer.Option(None, "--dir", help="Make the scratch directory under DIR "
                                          "(default: the system temp directory); removed at the end."),
) -> None:
    """Checkpoint stall, commit and load: Tidal vs memcpy, torch.save and DCP, on one state."""
    from tidal.bench.ckpt import render, run

    _, out, log = _consoles(json_out)
    _show(run(size_gb, repeat, directory, log=log), render, out, json_out)


@app.command("tiers")
def tiers(
    size_mb: float = typer.Option(512.0, "--size-mb", min=1.0,
                                  help="State size for persist and load, MiB."),
    repeat: int = typer.Option(5, "--repeat", min=1,
                               help="Timed repeats of persist and load; medians reported."),
    train_s: float = typer.Option(60.0, "--train-s", min=0.0, help="Seconds per training run (0: skip "
                                  "the training-overhead part)."),
    interval_s: float = typer.Option(10.0, "--interval-s", min=0.1,
                                     help="Checkpoint interval while training, s."),
    model_mb: float = typer.Option(32.0, "--model-mb", min=0.1, help="Parameters of the training MLP, MiB "
                                   "(the checkpoint is 3x: parameters + Adam's two moments)."),
    batch: int = typer.Option(64, "--batch", min=1, help="Training batch size."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds the training time of each mode "
                               "is split into (overheads also reported paired per round, median)."),
    json_out: bool = typer.Option(False, "--json",
                                  help="Print a JSON object on stdout (tables to stderr)."),
    directory: Path | None = typer.Option(None, "--dir", help="Make the scratch directory (disk tier, "
                                          "SeaweedFS data) under DIR; removed at the end."),
) -> None:
    """Each checkpoint tier vs the raw device (disk, S3, peer), loads per tier, and training overhead of
    checkpointing every 10 s through all tiers vs none vs DCP async_save to S3."""
    from tidal.bench.tiers import render, run

    _, out, log = _consoles(json_out)
    result = run(size_mb, repeat, train_s, interval_s, model_mb, batch, directory, log=log, rounds=rounds)
    _show(result, render, out, json_out)


@app.command("resume")
def bench_resume(
    world: int = typer.Option(2, "--world", min=1, help="Ranks of the job that gets the notice."),
    layout: str = typer.Option("fsdp", "--layout", help="Its layout: fsdp, ddp, tp."),
    resume_world: int = typer.Option(1, "--resume-world", min=1, help="Ranks of the resumed job."),
    resume_layout: str = typer.Option("ddp", "--resume-layout", help="Its layout."),
    n_embd: int = typer.Option(384, "--n-embd", min=8, help="Model width (384: ~11M parameters, ~130 MB "
                               "of parameters + Adam state)."),
    n_layer: int = typer.Option(6, "--n-layer", min=1, help="Transformer blocks."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Notices (each followed by one resume)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    script: Path | None = typer.Option(None, "--script", help="The example job."),
) -> None:
    """Reclaim notice → exit, and process start → first step after a resharded restore.

    For the example job: the time from SIGTERM to the exit with the final checkpoint committed, and
    from process start to the first training step after a resharded restore, from node memory and
    from disk.
    """
    from tidal.bench import resume

    err, out, log = _consoles(json_out)
    try:
        cfg = resume.MeasureConfig(world=world, layout=layout, resume_world=resume_world,
                                   resume_layout=resume_layout, n_embd=n_embd, n_layer=n_layer, repeat=repeat)
    except ValueError as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    _show(resume.run(cfg, script=script, log=log), resume.render, out, json_out)


def verify_resume(
    steps: int = typer.Option(24, "--steps", min=2, help="Optimizer steps of each run."),
    baseline: str = typer.Option("4:fsdp", "--baseline", help="WORLD:LAYOUT of the uninterrupted run."),
    plan: str = typer.Option("4:fsdp,2:ddp,3:fsdp", "--plan", help="WORLD:LAYOUT of each segment of the "
                             "interrupted run, comma-separated; layouts: fsdp, ddp, tp (tp=2), single."),
    rtol: float = typer.Option(1e-3, "--rtol", min=0.0, help="Largest relative loss difference accepted."),
    global_batch: int = typer.Option(24, "--global-batch", min=1, help="Sequences per step, all ranks."),
    micro_batch: int = typer.Option(2, "--micro-batch", min=1, help="Sequences per forward/backward."),
    n_embd: int = typer.Option(64, "--n-embd", min=8, help="Model width."),
    n_layer: int = typer.Option(2, "--n-layer", min=1, help="Transformer blocks."),
    block: int = typer.Option(64, "--block", min=8, help="Context length (bytes)."),
    plot_path: Path = typer.Option(Path("verify-resume.png"), "--plot", help="Where to write the PNG."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Keep checkpoints, progress and logs under "
                                        "this directory (default: a temporary one, removed)."),
    script: Path | None = typer.Option(None, "--script", help="The example job (default: "
                                       "examples/gpt/train.py of this source tree)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout (tables go to "
                                  "stderr)."),
) -> None:
    """Check that training is reproduced after reclaim notices and world-size changes.

    Runs the example job uninterrupted, then again with notices and world-size/layout changes, and
    compares the data order (must be identical) and the loss curves (within --rtol). Exit code 1 on a
    mismatch.
    """
    from rich.markup import escape

    from tidal.bench import verify

    err, out, log = _consoles(json_out)
    try:
        cfg = verify.VerifyConfig(steps=steps, baseline=verify.parse_plan(baseline)[0],
                                  plan=verify.parse_plan(plan), rtol=rtol, global_batch=global_batch,
                                  micro_batch=micro_batch, n_embd=n_embd, n_layer=n_layer, block=block)
        cfg.check()
    except ValueError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    result = verify.run(cfg, workdir=workdir, script=script, log=log)
    try:
        result["plot"] = str(verify.plot(result, plot_path))
    except ImportError:
        result["plot"] = None
        err.print("[yellow]matplotlib is not installed: no plot written[/]")

    def render(result: dict[str, Any], out: Any) -> None:
        verify.render(result, out)
        if result["plot"]:
            out.print(f"plot: {result['plot']}")

    _show(result, render, out, json_out)
    if not result["ok"]:
        raise typer.Exit(1)

"""``tidal bench``: benchmarks that print a Rich table, or JSON on stdout with ``--json``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Benchmarks (side by side, --json).", no_args_is_help=True, add_completion=False)


@app.callback()
def _group() -> None:
    """Benchmarks (side by side, --json)."""


@app.command("ckpt")
def ckpt(
    size_gb: float = typer.Option(
        1.0,
        "--size-gb",
        min=0.0001,
        help="State size in GB (1e9 bytes): parameters + Adam exp_avg + exp_avg_sq, fp32.",
    ),
    repeat: int = typer.Option(5, "--repeat", min=1, help="Timed repeats; medians are reported."),
    json_out: bool = typer.Option(
        False, "--json", help="Print a JSON object on stdout (the table goes to stderr)."
    ),
    directory: Path | None = typer.Option(
        None,
        "--dir",
        help="Make the scratch directory under DIR (default: the system temp directory); removed at the end.",
    ),
) -> None:
    """Checkpoint stall, commit and load: Tidal vs memcpy, torch.save and DCP, on one state."""
    from rich.console import Console
    from rich.markup import escape

    from tidal.bench.ckpt import render, run

    err = Console(stderr=True)
    out = err if json_out else Console()

    def log(s: str) -> None:
        err.print(f"[dim]{escape(s)}[/]", highlight=False)

    result = run(size_gb, repeat, directory, log=log)
    render(result, out)
    if json_out:
        print(json.dumps(result, indent=2))


@app.command("tiers")
def tiers(
    size_mb: float = typer.Option(512.0, "--size-mb", min=1.0, help="State size for persist and load, MiB."),
    repeat: int = typer.Option(
        5, "--repeat", min=1, help="Timed repeats of persist and load; medians reported."
    ),
    train_s: float = typer.Option(
        60.0, "--train-s", min=0.0, help="Seconds per training run (0: skip the training-overhead part)."
    ),
    interval_s: float = typer.Option(
        10.0, "--interval-s", min=0.1, help="Checkpoint interval while training, s."
    ),
    model_mb: float = typer.Option(
        32.0,
        "--model-mb",
        min=0.1,
        help="Parameters of the training MLP, MiB (the checkpoint is 3x: parameters + Adam's two moments).",
    ),
    batch: int = typer.Option(64, "--batch", min=1, help="Training batch size."),
    rounds: int = typer.Option(
        3,
        "--rounds",
        min=1,
        help="Interleaved rounds the training time of each mode "
        "is split into (overheads also reported paired per round, median).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON object on stdout (tables to stderr)."),
    directory: Path | None = typer.Option(
        None,
        "--dir",
        help="Make the scratch directory (disk tier, SeaweedFS data) under DIR; removed at the end.",
    ),
) -> None:
    """Each checkpoint tier vs the raw device (disk, S3, peer), loads per tier, and training overhead of
    checkpointing every 10 s through all tiers vs none vs DCP async_save to S3."""
    from rich.console import Console
    from rich.markup import escape

    from tidal.bench.tiers import render, run

    err = Console(stderr=True)
    out = err if json_out else Console()
    result = run(size_mb, repeat, train_s, interval_s, model_mb, batch, directory,
                 log=lambda s: err.print(f"[dim]{escape(s)}[/]", highlight=False), rounds=rounds)
    render(result, out)
    if json_out:
        print(json.dumps(result, indent=2))

"""``tidal bench``: benchmarks that print a Rich table, or JSON on stdout with ``--json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

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
    peers: bool = typer.Option(
        True,
        "--peers/--no-peers",
        help="Also run the peer engines installed by "
        "benchmarks/peers/setup.sh (ByteCheckpoint, DLRover, nvidia-resiliency-ext), "
        "each in its venv, on the same state; the others are listed as not installed.",
    ),
) -> None:
    """Checkpoint stall, commit and load: Tidal vs memcpy, torch.save, DCP and the peers, on one state."""
    from rich.console import Console
    from rich.markup import escape

    from tidal.bench.ckpt import render, run

    err = Console(stderr=True)
    out = err if json_out else Console()

    def log(s: str) -> None:
        err.print(f"[dim]{escape(s)}[/]", highlight=False)

    result = run(size_gb, repeat, directory, log=log)
    if peers:
        from tidal.bench.peers.runner import find_peers, run_peers

        found, missing = find_peers()
        run_peers(result, peers=found, missing=missing, directory=directory, log=log)
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


@app.command("forecast")
def forecast(
    traces: list[Path] = typer.Argument(
        None,
        help="Serving traces (CSV: time, load). Default: "
        "../shared/traces/servegen-*.csv next to the repository.",
    ),
    serving_gpus: int = typer.Option(128, "--serving-gpus", min=1, help="GPUs that serve the trace's peak."),
    budget: list[float] = typer.Option(
        [0.001, 0.005],
        "--budget",
        help="Shortfall budgets (fraction of demanded serving GPU-hours); repeatable.",
    ),
    quantile: list[float] = typer.Option([0.95, 0.99], "--quantile", help="Forecast quantiles; repeatable."),
    lead_s: float = typer.Option(1200.0, "--lead-s", help="Reclaim lead time in seconds."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON object on stdout (tables to stderr)."),
    libraries: bool = typer.Option(
        True,
        "--libraries/--no-libraries",
        help="Forecasting libraries as competitors "
        "(statsforecast, LightGBM: the forecast-bench extra; ~2 min a trace).",
    ),
) -> None:
    """Serving-demand forecast and loan policies on real traces: Tidal vs baselines vs oracle."""
    from tidal.bench.forecast import run

    run(_traces(traces), serving_gpus=serving_gpus, budgets=tuple(budget), quantiles=tuple(quantile),
        lead_s=lead_s, as_json=json_out, libraries=libraries)


def _traces(traces: list[Path] | None) -> list[Path]:
    """The traces given, or the ServeGen traces next to the repository."""
    from tidal.bench.forecast import DEFAULT_TRACES_DIR, default_traces

    found = list(traces) if traces else default_traces()
    if not found:
        raise typer.BadParameter(
            f"no traces given and none found in {DEFAULT_TRACES_DIR}", param_hint="TRACES"
        )
    missing = [str(p) for p in found if not Path(p).is_file()]
    if missing:
        raise typer.BadParameter(f"no such trace file: {', '.join(missing)}", param_hint="TRACES")
    return found


Traces = Annotated[
    list[Path] | None,
    typer.Argument(
        help="Serving traces (CSV: time, load). Default: "
        "../shared/traces/servegen-*.csv next to the repository."
    ),
]
ServingGpus = Annotated[int, typer.Option("--serving-gpus", min=1, help="GPUs that serve the trace's peak.")]
Budgets = Annotated[list[float], typer.Option("--budget", help="Shortfall budgets; repeatable.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print a JSON object on stdout (the table to stderr).")]
BUDGETS = [0.001, 0.002, 0.005]


@app.command("forecast-bound")
def forecast_bound(
    traces: Traces = None,
    serving_gpus: ServingGpus = 128,
    budget: Budgets = BUDGETS,  # noqa: B006 (typer reads it)
    tod_buckets: Annotated[
        int, typer.Option("--tod-buckets", min=1, help="Time-of-day buckets of the contexts.")
    ] = 6,
    target: Annotated[float, typer.Option("--target", min=0.0, max=1.0, help=(
        "Harvest x the oracle for the last row: how much smaller the forecast's errors must be."))] = 0.85,
    json_out: JsonOut = False,
) -> None:
    """How far a margin over Tidal's forecast could go if tuned with hindsight (the forecast's shape)."""
    from tidal.bench.forecast_bound import run

    run(_traces(traces), serving_gpus=serving_gpus, budgets=tuple(budget), tod_buckets=tod_buckets,
        target=target, as_json=json_out)


@app.command("forecast-rotate")
def forecast_rotate(
    traces: Traces = None, serving_gpus: ServingGpus = 128, budget: Budgets = BUDGETS,  # noqa: B006 (typer reads it)
    rotations: Annotated[str, typer.Option("--rotations", help="Comma-separated day offsets (default: every "
                                                               "day).")] = "",
    json_out: JsonOut = False,
) -> None:
    """Tidal's shortfall and harvest on every whole-day rotation of each trace (where the bursts fall)."""
    from tidal.bench.forecast_rotate import run

    traces = _traces(traces)
    try:
        rots = [int(x) for x in rotations.split(",")] if rotations.strip() else None
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated whole days, got {rotations!r}",
                                 param_hint="--rotations") from None
    run(traces, serving_gpus=serving_gpus, budgets=tuple(budget), rotations=rots, as_json=json_out)


@app.command("generalize")
def generalize(
    traces: Traces = None,
    serving_gpus: ServingGpus = 128,
    budget: Budgets = [0.005, 0.01],  # noqa: B006 (typer reads it)
    lead_s: Annotated[float, typer.Option("--lead-s", help="Reclaim lead time in seconds.")] = 1200.0,
    warmup_days: Annotated[
        float, typer.Option("--warmup-days", min=0.0, help="Days before scoring starts.")
    ] = 2.0,
    rotations: Annotated[
        bool,
        typer.Option(
            "--rotations/--no-rotations",
            help="Every whole-day rotation of each held-out trace (or only as recorded).",
        ),
    ] = True,
    stress: Annotated[
        str,
        typer.Option(
            "--stress",
            help="Comma-separated synthetic stress traces "
            "(burst, level-shift, holiday-week, multi-model; '' = none).",
        ),
    ] = "burst,level-shift,holiday-week,multi-model",
    stress_rotation_step: Annotated[
        int, typer.Option("--stress-rotation-step", min=1, help="Days between the stress traces' rotations.")
    ] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the stress traces.")] = 0,
    tidal: Annotated[
        list[str],
        typer.Option("--tidal", help="KEY=NUMBER: a TidalConfig setting for every trace; repeatable."),
    ] = [],  # noqa: B006
    workers: Annotated[int, typer.Option("--workers", min=0, help="Processes (0: up to 2).")] = 0,
    json_out: JsonOut = False,
) -> None:
    """Leave-one-trace-out, every rotation, stress traces: Tidal vs baselines tuned on another trace."""
    from rich.console import Console
    from rich.markup import escape

    from tidal.bench.generalize import parse_overrides, run

    names = tuple(x.strip() for x in stress.split(",") if x.strip())
    try:
        overrides = parse_overrides(tidal)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--tidal") from None
    err = Console(stderr=True)
    run(
        _traces(traces),
        serving_gpus=serving_gpus,
        budgets=tuple(budget),
        lead_s=lead_s,
        warmup_days=warmup_days,
        rotations=rotations,
        stress=names,
        stress_rotation_step=stress_rotation_step,
        seed=seed,
        tidal=overrides,
        workers=workers or None,
        as_json=json_out,
        log=lambda s: err.print(f"[dim]{escape(s)}[/]", highlight=False),
    )


def main() -> None:
    """Run ``ckpt`` as a program of its own (``python benchmarks/ckpt.py --size-gb 1``)."""
    typer.run(ckpt)

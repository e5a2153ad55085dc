"""``python -m lab``: the experiments that chose Tidal's designs (lab/README.md lists each with its result).

Run from the repository root. ``tidal bench`` is the operator's face (checkpoint, tiers, resume); these
commands are the team's: the forecast and loan-policy studies on the serving traces, and the checkpoint
benchmark with the peer engines beside Tidal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Tidal's lab: the experiments behind its designs (side by side, --json).",
                  no_args_is_help=True, add_completion=False)


@app.callback()
def _group() -> None:
    """Tidal's lab: the experiments behind its designs (side by side, --json)."""


@app.command("ckpt-peers")
def ckpt_peers(
    size_gb: Annotated[float, typer.Option(
        "--size-gb", min=0.0001,
        help="State size in GB (1e9 bytes): parameters + Adam exp_avg + exp_avg_sq, fp32.")] = 1.0,
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Timed repeats; medians are reported.")] = 5,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print a JSON object on stdout (the tables go to stderr).")] = False,
    directory: Annotated[Path | None, typer.Option(
        "--dir",
        help="Make the scratch directory under DIR (default: the system temp directory); removed at the end.",
    )] = None,
) -> None:
    """The checkpoint benchmark of tidal bench ckpt, then the peer engines installed by lab/peers/setup.sh
    (ByteCheckpoint, DLRover, nvidia-resiliency-ext), each in its venv, on the same state."""
    from rich.console import Console
    from rich.markup import escape

    from lab.peers.runner import find_peers, render_peers, run_peers
    from tidal.bench.ckpt import render, run

    err = Console(stderr=True)
    out = err if json_out else Console()

    def log(s: str) -> None:
        err.print(f"[dim]{escape(s)}[/]", highlight=False)

    result = run(size_gb, repeat, directory, log=log)
    found, missing = find_peers()
    run_peers(result, peers=found, missing=missing, directory=directory, log=log)
    render(result, out)
    render_peers(result, out)
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
        "(statsforecast, LightGBM: lab/requirements.txt; ~2 min a trace).",
    ),
) -> None:
    """Serving-demand forecast and loan policies on real traces: Tidal vs baselines vs oracle."""
    from lab.forecast.study import run

    run(_traces(traces), serving_gpus=serving_gpus, budgets=tuple(budget), quantiles=tuple(quantile),
        lead_s=lead_s, as_json=json_out, libraries=libraries)


def _traces(traces: list[Path] | None) -> list[Path]:
    """The traces given, or the ServeGen traces next to the repository."""
    from lab.forecast.study import DEFAULT_TRACES_DIR, default_traces

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
    from lab.forecast.bound import run

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
    from lab.forecast.rotate import run

    traces = _traces(traces)
    try:
        rots = [int(x) for x in rotations.split(",")] if rotations.strip() else None
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated whole days, got {rotations!r}",
                                 param_hint="--rotations") from None
    run(traces, serving_gpus=serving_gpus, budgets=tuple(budget), rotations=rots, as_json=json_out)


@app.command("clients")
def clients(
    traces: Annotated[list[Path] | None, typer.Argument(
        help="Per-client traces (seconds, client, requests_per_second). Default: "
        "../shared/traces/servegen-*-clients.csv.gz next to the repository.")] = None,
    serving_gpus: Annotated[list[int], typer.Option("--serving-gpus", min=1, help=(
        "GPUs that serve the trace's peak; repeatable."))] = [128, 2048],  # noqa: B006 (typer reads it)
    budget: Budgets = [0.002, 0.005, 0.01],  # noqa: B006 (typer reads it)
    rotations: Annotated[str, typer.Option("--rotations", help="Comma-separated day offsets (default: every "
                                                               "day).")] = "",
    variants: Annotated[str, typer.Option("--variants", help=(
        "Comma-separated policy variants: before, tighten, week, clients, loosen, floor "
        "(lab/forecast/clients.py)."))]
        = "before,tighten,clients",
    shift: Annotated[str, typer.Option("--shift", help=(
        "A regime shift from --shift-day on: none, double-client, peak-3h, no-weekend."))] = "none",
    shift_day: Annotated[int, typer.Option("--shift-day", min=1)] = 7,
    days: Annotated[int | None, typer.Option("--days", min=3, help="Keep the first days only.")] = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Processes (one rotation each).")] = 1,
    mix: Annotated[list[int], typer.Option("--mix", help=(
        "Also a recomposed service drawn by this seed from the shared traces' clients; repeatable "
        "(lab/forecast/clients.py)."))] = [],  # noqa: B006 (typer reads it)
    json_out: JsonOut = False,
) -> None:
    """The ceilings of the client-level and the aggregate forecast, and the policy's variants, on every
    rotation, pool size and budget."""
    from lab.forecast.clients import default_traces, run

    def days_of(text: str, hint: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"expected comma-separated whole days, got {text!r}",
                                     param_hint=hint) from None

    try:
        from lab.forecast.clients import MIX

        mixes = [Path(f"{MIX}{seed}") for seed in mix]
        run([*(traces or ([] if mixes else default_traces())), *mixes], serving_gpus=tuple(serving_gpus),
            budgets=tuple(budget),
            rotations=days_of(rotations, "--rotations") or None,
            variants=tuple(v.strip() for v in variants.split(",") if v.strip()), shift=shift,
            shift_day=shift_day, days=days, workers=workers, as_json=json_out)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


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

    from lab.forecast.generalize import parse_overrides, run

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

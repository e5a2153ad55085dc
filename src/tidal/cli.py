"""The ``tidal`` command line.

Subcommands live next to the code they drive and are registered lazily: ``tidal jobs`` imports only
the control-plane client, not torch, so client commands start fast. ``tidal --help`` registers all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated

import typer

app = typer.Typer(help="Tidal: train on a shared GPU pool.", no_args_is_help=True)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("tidal")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        print(f"tidal {v}")
        raise typer.Exit()


@app.callback()
def _group(_: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                           help="print the version and exit")] = False) -> None:
    """Tidal: train on a shared GPU pool."""  # keeps `tidal NAME` a subcommand when only NAME is registered


def _ckpt() -> None:
    from tidal.ckpt.cli import app as ckpt_app

    app.add_typer(ckpt_app, name="ckpt", help="Inspect, verify and export checkpoints.")


def _bench() -> None:
    from tidal.bench.cli import app as bench_app
    from tidal.demo.plane_bench import plane_command

    bench_app.command("plane")(plane_command)  # drives the plane and the simulator: a face, not tidal.bench
    app.add_typer(bench_app, name="bench", help="Benchmarks (side by side, --json).")


def _verify() -> None:
    from tidal.bench.cli import verify_resume

    app.command("verify-resume")(verify_resume)


def _sim() -> None:
    from tidal.sim.cli import plan_command, sim_command

    app.command("sim")(sim_command)
    app.command("plan")(plan_command)


_CONTROL = ("up", "submit", "jobs", "status", "logs", "cancel", "pool", "events")


def _control() -> None:
    from tidal.control import cli as control

    for name in _CONTROL:
        app.command(name)(getattr(control, name))
    app.add_typer(control.tenants_app, name="tenants", help="Tenants (admin): create, list.")


def _serving() -> None:
    from tidal.serving.cli import app as serving_app

    app.add_typer(serving_app, name="serving",
                  help="Serving side: the live loan plan from a trace or Prometheus; load on an endpoint.")


def _demo() -> None:
    from tidal.demo.cycle import cycle
    from tidal.demo.on_ray import demo_ray
    from tidal.demo.single import demo

    demo_app = typer.Typer(
        invoke_without_command=True, no_args_is_help=False,
        help="End-to-end demos on this machine (no subcommand: a job loses a rank and recovers)."
    )
    demo_app.callback()(demo)
    demo_app.command("cycle")(cycle)
    demo_app.command("ray")(demo_ray)
    app.add_typer(demo_app, name="demo")


_COMMANDS: dict[str, Callable[[], None]] = {
    "ckpt": _ckpt,
    "bench": _bench,
    "verify-resume": _verify,
    "sim": _sim,
    "plan": _sim,
    "demo": _demo,
    "serving": _serving,
    **{n: _control for n in (*_CONTROL, "tenants")},
}


def _register(argv: list[str] | None = None) -> None:
    """Register the subcommand named in ``argv`` (all of them when none or an unknown one is named)."""
    args = sys.argv[1:] if argv is None else argv
    name = next((a for a in args if not a.startswith("-")), None)
    wanted = [_COMMANDS[name]] if name in _COMMANDS else list(dict.fromkeys(_COMMANDS.values()))
    for register in wanted:
        register()


def main() -> None:
    _register()
    app()

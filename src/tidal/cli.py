"""The ``tidal`` command line.

Subcommands live next to the code they drive and are registered lazily: ``tidal jobs`` imports only
the control-plane client, not torch, so client commands start fast. ``tidal --help`` registers all.
"""

from __future__ import annotations

import importlib
import sys
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


_CONTROL = ("up", "submit", "jobs", "status", "logs", "cancel", "pool", "events")
# name -> (module, attribute, help): a group of subcommands when ``help`` is given, else one command
_COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "ckpt": ("tidal.ckpt.cli", "app", "Inspect, verify and export checkpoints."),
    "bench": ("tidal.demo.plane_bench", "bench_app", "Benchmarks (side by side, --json)."),
    "verify-resume": ("tidal.bench.cli", "verify_resume", None),
    "sim": ("tidal.sim.cli", "sim_command", None),
    "plan": ("tidal.sim.cli", "plan_command", None),
    "demo": ("tidal.demo.cli", "app",
             "End-to-end demos on this machine (no subcommand: a job loses a rank and recovers)."),
    "serving": ("tidal.serving.cli", "app",
                "Serving side: the live loan plan from a trace or Prometheus; load on an endpoint."),
    **{n: ("tidal.control.cli", n, None) for n in _CONTROL},
    "tenants": ("tidal.control.cli", "tenants_app", "Tenants (admin): create, list."),
}


def _register(argv: list[str] | None = None) -> None:
    """Register the subcommand named in ``argv`` (all of them when none or an unknown one is named)."""
    args = sys.argv[1:] if argv is None else argv
    name = next((a for a in args if not a.startswith("-")), None)
    for n in [name] if name in _COMMANDS else _COMMANDS:
        module, attribute, help_ = _COMMANDS[n]
        target = getattr(importlib.import_module(module), attribute)
        if help_ is None:
            app.command(n)(target)
        else:
            app.add_typer(target, name=n, help=help_)


def main() -> None:
    _register()
    app()

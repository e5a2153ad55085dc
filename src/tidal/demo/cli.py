"""``tidal demo`` and its subcommands (registered lazily by :mod:`tidal.cli`)."""

from __future__ import annotations

import typer

from tidal.demo.engine_cycle import cycle
from tidal.demo.on_ray import demo_ray
from tidal.demo.single import demo

app = typer.Typer(invoke_without_command=True, no_args_is_help=False)
app.callback()(demo)
app.command("cycle")(cycle)
app.command("ray")(demo_ray)

"""The ``tidal`` command line."""

from __future__ import annotations

import typer

app = typer.Typer(help="Tidal: train on a shared GPU pool.", no_args_is_help=True, add_completion=False)


def _register() -> None:
    from tidal.bench.cli import app as bench_app
    from tidal.ckpt.cli import app as ckpt_app
    from tidal.train.cli import bench_resume, verify_resume

    app.add_typer(ckpt_app, name="ckpt", help="Inspect, verify and export checkpoints.")
    app.add_typer(bench_app, name="bench", help="Benchmarks (side by side, --json).")
    app.command("verify-resume")(verify_resume)
    bench_app.command("resume")(bench_resume)


def main() -> None:
    _register()
    app()

"""``python -m lab <command>`` from the repository root (``python -m lab --help``)."""

from lab.cli import app

app(prog_name="python -m lab")

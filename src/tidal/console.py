"""The Rich console every ``tidal`` command prints through (one place: width and colours)."""

from __future__ import annotations

import os
import sys

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """A terminal gets its width and colours; piped output is not cut at 80 columns (unless COLUMNS says)."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    width = None if tty or "COLUMNS" in os.environ else 200
    return Console(stderr=stderr, width=width, highlight=False)

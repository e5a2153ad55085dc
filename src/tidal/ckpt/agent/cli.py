"""``tidal ckpt agent``: becomes ``python -m tidal.ckpt.agent`` (same pid; no torch), whose ``server.main``
defines the options: every argument, ``--help`` too, is handed over as is."""

from __future__ import annotations

import os
import sys

import typer

SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def agent_cmd(ctx: typer.Context) -> None:
    """Run this node's checkpoint agent (the peer-memory tier) in the foreground until SIGTERM.

    Options: ``tidal ckpt agent --help`` (those of ``python -m tidal.ckpt.agent``, which it becomes).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tidal.ckpt.agent", *ctx.args])

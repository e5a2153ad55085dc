"""``tidal ckpt agent``: run this node's checkpoint agent (the peer-memory tier) in the foreground.

Registered on ``tidal ckpt``'s app by :mod:`tidal.ckpt.cli`; the command replaces itself with
``python -m tidal.ckpt.agent`` (same pid), which does not load torch. Its options are that module's
(``server.main``, the one place they are defined): every argument, ``--help`` too, is handed over as is.
"""

from __future__ import annotations

import os
import sys

import typer

SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def agent_cmd(ctx: typer.Context) -> None:
    """Run this node's checkpoint agent (the peer-memory tier) in the foreground until SIGTERM.

    It holds the steps this node's ranks hand it (peer tier) in its memory directory and pushes each
    to its buddy; ``GET /status`` on it says which steps it holds and from which node. Options:
    ``tidal ckpt agent --help`` (those of ``python -m tidal.ckpt.agent``, which it becomes, same pid).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tidal.ckpt.agent", *ctx.args])

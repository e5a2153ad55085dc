"""``tidal ckpt agent``: run this node's checkpoint agent (the peer-memory tier) in the foreground.

Registered on ``tidal ckpt``'s app by :mod:`tidal.ckpt.cli`; the command replaces itself with
``python -m tidal.ckpt.agent`` (same pid), which does not load torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer


def agent_cmd(
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to serve on (0.0.0.0:7070 for every "
                                        "interface; port 0: any free port).", show_default=False)],
    mem_dir: Annotated[Path, typer.Option("--mem-dir", help="Memory directory that holds the steps, e.g. "
                                          "/dev/shm/tidal-agent (taken up again after a restart).",
                                          show_default=False)],
    buddy: Annotated[str | None, typer.Option("--buddy", help="HOST:PORT of the agent on another node that "
                                              "keeps a copy of every step handed to this one.")] = None,
    node: Annotated[str | None, typer.Option("--node", help="This node's name in its buddy's replica tree "
                                             "(default: the listen address).")] = None,
    allow_copy_from: Annotated[list[str] | None, typer.Option(
        "--allow-copy-from", help="Directory staging slots may be copied from; repeatable (default "
                                  "$TIDAL_SHM_DIR/tidal or /dev/shm/tidal).")] = None,
    resync_s: Annotated[float, typer.Option("--resync-s", help="Seconds between checks that the buddy holds "
                                            "every committed step.")] = 2.0,
    log_level: Annotated[str, typer.Option("--log-level")] = "INFO",
) -> None:
    """Run this node's checkpoint agent (the peer-memory tier) in the foreground until SIGTERM.

    It holds the steps this node's ranks hand it (peer tier) in MEM_DIR and pushes each to BUDDY;
    ``GET /status`` on it says which steps it holds and from which node. The process replaces
    itself with ``python -m tidal.ckpt.agent`` (same pid), which does not load torch.
    """
    args = [
        "--listen",
        listen,
        "--mem-dir",
        str(mem_dir),
        "--resync-s",
        str(resync_s),
        "--log-level",
        log_level,
    ]
    args += ["--buddy", buddy] if buddy else []
    args += ["--node", node] if node else []
    for d in allow_copy_from or []:
        args += ["--allow-copy-from", d]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tidal.ckpt.agent", *args])

"""The per-rank shim: start one rank, wait for it, record its exit code. Standard library only.

    python -I shim.py EXIT_FILE PID_FILE -- PROGRAM ARG...

The local executor starts one shim per rank, in a new session (its own process group), with the
rank's environment, working directory and log file. Two things make a control-plane crash safe:

* **Two-phase start.** The shim first reads one line from stdin and starts the rank only on
  ``go``. The executor sends it after it has recorded every rank's pid durably, so if the control
  plane dies in between, the pipe closes, the shim reads EOF and exits, and nothing runs
  unrecorded (never twice).
* **Exit code on disk.** When the rank exits, the shim writes ``{"code", "time"}`` to EXIT_FILE
  (atomically), so a control plane that restarted, and is no longer the shim's parent, still learns
  how the rank ended. A negative code means the rank was killed by that signal.

Signals reach the rank directly (the executor signals the whole process group); the shim ignores
SIGTERM and SIGINT itself (with a no-op handler, which the rank does not inherit), so it outlives
the rank to record its code. SIGKILL of the group ends both: then there is no exit file, and the
control plane knows it killed them. The shim exits with the rank's code (128 + n for signal n).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: shim.py EXIT_FILE PID_FILE -- PROGRAM ARG...", file=sys.stderr)
        return 2
    exit_file, pid_file, cmd = argv[0], argv[1], argv[3:]
    if sys.stdin.readline().strip() != "go":
        return 0  # the control plane went away before recording this launch: run nothing
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    except OSError as e:
        print(f"tidal: cannot start {cmd[0]!r} in {os.getcwd()}: {e}", file=sys.stderr, flush=True)
        _write(exit_file, {"code": 127, "time": time.time(), "error": str(e)})
        return 127
    _write(pid_file, {"pid": proc.pid, "time": time.time()})
    code = proc.wait()
    _write(exit_file, {"code": code, "time": time.time()})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

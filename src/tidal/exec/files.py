"""Small files an executor keeps per attempt (``launch.json``, ``control.json``): written atomically."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def write_json(path: Path, doc: dict, owner: tuple[int, int] | None = None) -> None:
    """Atomically, mode 0600; with ``owner`` (a job's uid and gid: a file the job reads) 0640 in that
    gid, still this process's: the job reads it and cannot change it (a job that could would hand the
    plane, which reads it back, whatever it wrote: a file of any size)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as f:
        if owner is not None:
            os.fchown(f.fileno(), -1, owner[1])
            os.fchmod(f.fileno(), 0o640)
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None

"""Small files an executor keeps per attempt (``launch.json``, ``control.json``): written atomically."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.files import write_atomic


def write_json(path: Path, doc: dict, owner: tuple[int, int] | None = None) -> None:
    """Atomically, mode 0600 (:func:`tidal.files.write_atomic`); with ``owner`` (a job's uid and gid: a
    file the job reads) 0640 in that gid, still this process's: the job reads it and cannot change it (a
    job that could would hand the plane, which reads it back, whatever it wrote: a file of any size)."""
    write_atomic(path, json.dumps(doc), group=None if owner is None else owner[1])


def read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None

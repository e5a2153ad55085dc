"""Small files an executor keeps per attempt (``launch.json``, ``control.json``): written atomically."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.files import read_plain, write_atomic


def write_json(path: Path, doc: dict, owner: tuple[int, int] | None = None) -> None:
    """Atomically, mode 0600 (:func:`tidal.files.write_atomic`); with ``owner`` (a job's uid and gid: a
    file the job reads) 0640 in that gid, still this process's: the job reads it and cannot change it (a
    job that could would hand the plane, which reads it back, whatever it wrote: a file of any size)."""
    write_atomic(path, json.dumps(doc), group=None if owner is None else owner[1])


MAX_JSON_BYTES = 16 << 20  # launch.json of the largest job is well under this


def read_json(path: Path, owner: int | None = None) -> dict | None:
    """The JSON object in ``path``, read as :func:`tidal.files.read_plain` reads a file a job may control
    (``owner``: the job's uid); ``None`` when it is missing, refused or not a JSON object."""
    try:
        doc = json.loads(read_plain(path, MAX_JSON_BYTES, owner=owner))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None

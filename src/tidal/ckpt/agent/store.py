"""What a checkpoint agent holds: steps of jobs, in a memory directory, by origin node.

    <mem>/own/<job>/step_000000000120/<name>               # handed over by this node's ranks
    <mem>/replica/<origin>/<job>/step_000000000120/<name>  # pushed by the agent of node <origin>

A job's view of a step is the union over the trees (own first). Writes go to a hidden temporary name
(``.<name>.part-<random>``) renamed into place; hidden names are not listed and are removed when an
agent starts again. No networking; concurrent writers of one name race, the last rename wins."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Literal

from tidal.ckpt.format.manifest import MANIFEST, step_dirname
from tidal.ckpt.format.manifest import parse_step_dirname as parse_step
from tidal.files import owned_dir, private_dirs

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,200}$")


def check_name(value: str, what: str) -> str:
    """``value`` when it is a safe single path segment (letters, digits, ``._-``, not hidden)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} {value!r} is not a valid name (letters, digits, '.', '_', '-'; not "
                         "starting with '.')")
    return value


def _listdir(p: Path) -> list[str]:
    try:
        return os.listdir(p)
    except (FileNotFoundError, NotADirectoryError):
        return []


class Store:
    """The trees of one memory directory. ``origin=None`` means this node's own tree."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.own = self.root / "own"
        self.replicas = self.root / "replica"

    def open(self) -> int:
        """Create the directory (or take up an existing one); remove torn writes. Returns steps found."""
        owned_dir(self.root)
        private_dirs(self.own)
        private_dirs(self.replicas)
        found = 0
        for _, tree in self.trees():
            found += sum(1 for _ in tree.glob("*/*"))
            for torn in tree.glob("*/*/.*"):
                with contextlib.suppress(OSError):
                    torn.unlink()
        return found

    # -- paths -------------------------------------------------------------------------------------
    def tree(self, origin: str | None) -> Path:
        return self.own if origin is None else self.replicas / check_name(origin, "origin")

    def trees(self) -> list[tuple[str | None, Path]]:
        """Own tree first, then each origin's replica tree (sorted)."""
        return [(None, self.own)] + [(o, self.replicas / o) for o in sorted(_listdir(self.replicas))
                                     if not o.startswith(".")]

    def step_dir(self, origin: str | None, job: str, step: int) -> Path:
        return self.tree(origin) / check_name(job, "job") / step_dirname(step)

    def temp_path(self, origin: str | None, job: str, step: int, name: str) -> tuple[Path, Path]:
        """(a fresh hidden temporary path, the final path) for writing ``name``; creates the step dir."""
        d = self.step_dir(origin, job, step)
        private_dirs(d)
        check_name(name, "object")
        return d / f".{name}.part-{uuid.uuid4().hex[:8]}", d / name

    def locate(self, job: str, step: int, name: str) -> Path | None:
        """The path of ``name`` in the first tree that holds it (own first), or None."""
        check_name(name, "object")
        for origin, _ in self.trees():
            p = self.step_dir(origin, job, step) / name
            if p.is_file():
                return p
        return None

    # -- listing -----------------------------------------------------------------------------------
    def step_files(self, origin: str | None, job: str, step: int) -> dict[str, int]:
        """Visible objects of one step in one tree: name -> size in bytes."""
        d = self.step_dir(origin, job, step)
        out = {}
        for n in _listdir(d):
            if not n.startswith("."):
                with contextlib.suppress(OSError):
                    out[n] = os.stat(d / n).st_size
        return out

    def step_info(self, job: str, step: int) -> dict | None:
        """Union over trees: {"files": {name: size}, "committed_unix_s": manifest mtime or None}, or None."""
        files: dict[str, int] = {}
        committed = None
        seen = False
        for origin, _ in self.trees():
            d = self.step_dir(origin, job, step)
            if not d.is_dir():
                continue
            seen = True
            for n, size in self.step_files(origin, job, step).items():
                files.setdefault(n, size)
            if committed is None:
                with contextlib.suppress(OSError):
                    committed = os.stat(d / MANIFEST).st_mtime
        # A step directory with nothing visible in it (a write that failed, a client gone mid-upload) is
        # no step: listing it would read as a save under way.
        return {"files": files, "committed_unix_s": committed} if seen and files else None

    def job_index(self, job: str) -> dict[int, dict]:
        """Every step of ``job`` held in any tree (committed or not) with its ``step_info``."""
        check_name(job, "job")
        steps = {s for _, t in self.trees() for d in _listdir(t / job) if (s := parse_step(d)) is not None}
        return {s: info for s in sorted(steps) if (info := self.step_info(job, s)) is not None}

    def tree_index(self, origin: str | None) -> dict[str, dict[int, dict[str, int]]]:
        """One tree: job -> step -> {name: size} (steps with a visible object)."""
        tree = self.tree(origin)
        out: dict[str, dict[int, dict[str, int]]] = {}
        for job in _listdir(tree):
            if job.startswith("."):
                continue
            for d in _listdir(tree / job):
                s = parse_step(d)
                if s is not None and (files := self.step_files(origin, job, s)):
                    out.setdefault(job, {})[s] = files
        return out

    def summary(self) -> list[dict]:
        """One row per (job, step, tree) for the status endpoint."""
        rows = []
        for origin, _ in self.trees():
            for job, steps in sorted(self.tree_index(origin).items()):
                for s, files in sorted(steps.items()):
                    rows.append({"job": job, "step": s, "origin": origin, "committed": MANIFEST in files,
                                 "files": len(files), "bytes": sum(files.values())})
        return rows

    # -- removal -----------------------------------------------------------------------------------
    def _origins(self, origin: str | None | Literal[False]) -> list[str | None]:
        """The trees ``origin`` names: every tree (False), own (None) or one origin's replica."""
        return [o for o, _ in self.trees()] if origin is False else [origin]

    def remove(self, job: str, step: int, name: str | None = None,
               origin: str | None | Literal[False] = False) -> bool:
        """Remove object ``name`` of a step, or (None) the whole step, manifests first so that it is never
        seen half-removed, from every tree (``origin`` False) or one; whether anything was removed."""
        dirs = [self.step_dir(o, job, step) for o in self._origins(origin)]
        removed = False
        for d in dirs:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(d / (MANIFEST if name is None else check_name(name, "object")))
                removed = True
        for d in dirs if name is None else []:
            removed = removed or d.is_dir()
            shutil.rmtree(d, ignore_errors=True)
        return removed

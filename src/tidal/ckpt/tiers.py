"""Storage tiers: where committed steps live. A tier is a directory tree (see ``manifest``).

* ``DirTier("disk", path)`` — a local or shared directory; data and manifests are fsynced.
* ``DirTier("shm", /dev/shm/tidal/<name>-<hash>)`` — node shared memory: survives the training
  process but not the node. Its data files are hard links to the staging slots, so staging a step
  *is* writing it to this tier (no second copy).

Commit protocol (same in every tier): every rank writes its data file and then a sidecar JSON
with its checksums (``r<rank>-<save_id>.json``, by rename); rank 0 waits for all sidecars, merges
them into ``manifest.json`` (written to a temporary name, fsynced, renamed). A step directory
without a manifest is invisible and is removed by a later save.

Thread-safety: a tier object holds no mutable state; concurrent readers are fine. Writers are the
checkpointer's single background thread per rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tidal.ckpt import manifest as mf
from tidal.ckpt.errors import ManifestError, SaveError

log = logging.getLogger(__name__)

SHM_BASE_ENV = "TIDAL_SHM_DIR"


class DirTier:
    def __init__(self, name: str, root: str | os.PathLike, *, fsync: bool) -> None:
        self.name = name
        self.root = Path(root)
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"DirTier({self.name!r}, {str(self.root)!r})"

    # -- reading -------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / mf.step_dirname(step)

    def committed_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            s = mf.parse_step_dirname(n)
            if s is not None and (self.root / n / mf.MANIFEST).exists():
                out.append(s)
        return sorted(out)

    def uncommitted_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            s = mf.parse_step_dirname(n)
            if s is not None and not (self.root / n / mf.MANIFEST).exists():
                out.append(s)
        return sorted(out)

    def read_manifest(self, step: int) -> mf.Manifest:
        return mf.read(self.step_dir(step))

    # -- writing (background thread) -----------------------------------------------------------
    def prepare_step(self, step: int) -> Path:
        d = self.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def write_file(self, step: int, name: str, data: memoryview) -> None:
        path = self.prepare_step(step) / name
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def link_file(self, step: int, name: str, source: Path) -> None:
        """Make ``source`` (a staging slot) appear as data file ``name`` of ``step``."""
        path = self.prepare_step(step) / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.link(source, path)

    def write_json(self, step: int, name: str, doc: dict) -> None:
        d = self.prepare_step(step)
        tmp = d / f".{name}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, d / name)
        if self.fsync:
            _fsync_dir(d)

    def wait_sidecars(self, step: int, save_id: str, world: int, timeout_s: float) -> list[dict]:
        """Rank 0: wait until every rank's sidecar for this save exists; return them by rank."""
        d = self.step_dir(step)
        deadline = time.monotonic() + timeout_s
        docs: dict[int, dict] = {}
        delay = 0.001
        while True:
            for r in range(world):
                if r in docs:
                    continue
                p = d / sidecar_name(r, save_id)
                try:
                    doc = json.loads(p.read_bytes())
                except FileNotFoundError:
                    continue
                if doc.get("error"):
                    raise SaveError(f"step {step}: rank {r} failed to persist to tier '{self.name}': {doc['error']}")
                docs[r] = doc
            if len(docs) == world:
                return [docs[r] for r in range(world)]
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in docs]
                raise SaveError(f"step {step}: ranks {missing} did not finish writing to tier '{self.name}' "
                                f"within {timeout_s:.0f} s; the step stays uncommitted")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def wait_committed(self, step: int, save_id: str, timeout_s: float) -> None:
        """Ranks other than 0: wait until rank 0 committed this save (or reported failure)."""
        path = self.step_dir(step) / mf.MANIFEST
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                doc = json.loads(path.read_bytes())
                if doc.get("save_id") == save_id:
                    return
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            failed = self.step_dir(step) / failure_name(save_id)
            if failed.exists():
                raise SaveError(f"step {step}: commit to tier '{self.name}' failed: {failed.read_text()}")
            if time.monotonic() > deadline:
                raise SaveError(f"step {step}: not committed to tier '{self.name}' within {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def commit(self, step: int, doc: dict) -> None:
        """Rank 0: make the step visible by writing its manifest last, atomically."""
        self.write_json(step, mf.MANIFEST, doc)

    def mark_failed(self, step: int, save_id: str, why: str) -> None:
        with contextlib.suppress(OSError):
            d = self.prepare_step(step)
            (d / failure_name(save_id)).write_text(why)

    def uncommit(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.step_dir(step) / mf.MANIFEST).unlink()

    def cleanup(self, keep: int, committed_step: int, busy: Callable[[int], bool] = lambda s: False,
                lock: threading.Lock | None = None) -> list[int]:
        """Rank 0, after committing ``committed_step``: drop torn steps, superseded steps, old steps
        past ``keep``, and stray files. Returns the steps removed.

        * torn: a step directory without a manifest (a crash mid-save, or a failed save);
        * superseded: a committed step *newer* than the one just committed, left by a run that this
          job abandoned when it resumed from an older step — kept, it would hijack the next restore;
        * retention: of the steps up to ``committed_step``, the newest ``keep`` stay (0 keeps all);
          the step just committed always stays.

        Steps for which ``busy(step)`` is true (this job is still writing them) are never touched; the
        check and the removal happen under ``lock``, the lock under which ``save`` registers a step
        before any rank may start writing it.
        """
        removed = []
        lock = lock or threading.Lock()

        def remove(s: int) -> None:
            with lock:
                if busy(s):
                    return
                self.uncommit(s)
                shutil.rmtree(self.step_dir(s), ignore_errors=True)
            removed.append(s)

        for s in self.uncommitted_steps():
            remove(s)
        committed = self.committed_steps()
        for s in committed:
            if s > committed_step:
                log.warning("removing step %d from tier '%s': superseded by step %d of the resumed run",
                            s, self.name, committed_step)
                remove(s)
        older = [s for s in committed if s <= committed_step]
        if keep > 0:
            for s in older[:-keep]:
                if s != committed_step:
                    remove(s)
        for s in self.committed_steps():
            with lock:
                if busy(s):
                    continue
            d = self.step_dir(s)
            try:
                doc = json.loads((d / mf.MANIFEST).read_bytes())
                keep_files = {f["name"] for f in doc.get("files", [])} | {mf.MANIFEST}
            except (OSError, ValueError, TypeError, KeyError):
                continue  # a damaged manifest is left for a person to look at
            for n in os.listdir(d):
                if n not in keep_files:
                    with contextlib.suppress(OSError):
                        os.unlink(d / n)
        return removed


def sidecar_name(rank: int, save_id: str) -> str:
    return f"r{rank:05d}-{save_id}.json"


def data_name(rank: int, save_id: str) -> str:
    return f"r{rank:05d}-{save_id}.safetensors"


def failure_name(save_id: str) -> str:
    return f"failed-{save_id}.txt"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- resolving a location ----------------------------------------------------------------------

def local_path(url: str | os.PathLike) -> Path:
    """The directory behind ``url`` (a path or ``file://`` URL); other schemes are an error."""
    s = os.fspath(url)
    if s.startswith("file://"):
        s = s[len("file://"):]
    elif "://" in s:
        scheme = s.split("://", 1)[0]
        raise ValueError(f"checkpoint url {s!r}: scheme '{scheme}://' is not supported yet; "
                         "expected a directory path or file:// URL")
    return Path(s).expanduser().absolute()


def shm_root_for(url: str | os.PathLike) -> Path:
    """The node-shared-memory directory that mirrors checkpoint location ``url`` on this node."""
    base = Path(os.environ.get(SHM_BASE_ENV, "/dev/shm"))
    p = local_path(url)
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:12]
    return base / "tidal" / f"{p.name or 'root'}-{digest}"


def tiers_for(url: str | os.PathLike, *, shm: bool = True) -> list[DirTier]:
    """Tiers to read ``url`` from, fastest first."""
    out = []
    if shm:
        root = shm_root_for(url)
        if root.exists():
            out.append(DirTier("shm", root, fsync=False))
    out.append(DirTier("disk", local_path(url), fsync=True))
    return out


def newest_manifest(tiers: list[DirTier], step: int) -> tuple[DirTier, mf.Manifest]:
    """The manifest of ``step`` from the fastest tier whose copy parses; else ManifestError."""
    errors = []
    for t in tiers:
        if step in t.committed_steps():
            try:
                return t, t.read_manifest(step)
            except ManifestError as e:
                errors.append(str(e))
    raise ManifestError("; ".join(errors) or f"step {step}: no manifest in any tier")

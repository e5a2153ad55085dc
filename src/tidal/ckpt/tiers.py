"""Directory tiers and resolving a checkpoint location to its tiers, fastest first.

* ``DirTier("disk", path)`` - a local or shared directory; data and manifests are fsynced.
* ``DirTier("shm", /dev/shm/tidal/<name>-<hash>)`` - node shared memory: survives the training
  process but not the node. Its data files are hard links to the staging slots, so staging a step
  *is* writing it to this tier (no second copy).
* ``s3.S3Tier`` - S3-compatible object storage (``s3://bucket/prefix``).
* ``peer.PeerTier`` - other nodes' memory, through checkpoint agents (``peer://<namespace>``).

Every tier implements ``protocol.Tier``; the commit protocol, cleanup and retention that run on
top of it are in ``commit``. Thread-safety: a tier object holds no mutable state; concurrent
readers are fine. Writers are the checkpointer's background threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.ckpt import manifest as mf
from tidal.ckpt.errors import ManifestError, TierError
from tidal.ckpt.protocol import Tier, TruncatedRead
from tidal.contract import ENV_SHM_DIR

SHM_BASE_ENV = ENV_SHM_DIR


class DirTier:
    """A tier that is a directory tree. ``kind`` is "shm" for the node-shared-memory tier."""

    poll_s = (0.001, 0.05)

    def __init__(self, name: str, root: str | os.PathLike, *, fsync: bool, kind: str | None = None) -> None:
        self.name = name
        self.root = Path(root)
        self.fsync = fsync
        self.kind = kind or ("shm" if name == "shm" else "dir")
        self.durable = self.kind != "shm"
        self.location = str(self.root)

    def __repr__(self) -> str:
        return f"DirTier({self.name!r}, {str(self.root)!r})"

    def step_dir(self, step: int) -> Path:
        return self.root / mf.step_dirname(step)

    def where(self, step: int, name: str | None = None) -> str:
        d = self.step_dir(step)
        return str(d / name) if name else str(d)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierError(f"tier '{self.name}' ({self.root}): cannot create the directory: {e.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise TierError(f"tier '{self.name}' ({self.root}): the directory is not writable")

    # -- listing -----------------------------------------------------------------------------------
    def _step_names(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [(s, n) for n in names if (s := mf.parse_step_dirname(n)) is not None]

    def step_files(self) -> dict[int, set[str]]:
        out = {}
        for s, n in self._step_names():
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                out[s] = set(os.listdir(self.root / n))
        return out

    def committed(self) -> dict[int, float]:
        out = {}
        for s, n in self._step_names():
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                out[s] = os.stat(self.root / n / mf.MANIFEST).st_mtime
        return out

    def committed_steps(self) -> list[int]:
        return sorted(s for s, n in self._step_names() if (self.root / n / mf.MANIFEST).exists())

    def uncommitted_steps(self) -> list[int]:
        return sorted(s for s, n in self._step_names() if not (self.root / n / mf.MANIFEST).exists())

    def list_files(self, step: int) -> set[str]:
        try:
            return set(os.listdir(self.step_dir(step)))
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def file_sizes(self, step: int) -> dict[str, int]:
        """Object name -> size in bytes, for one step directory (empty when it does not exist)."""
        out = {}
        for n in self.list_files(step):
            with contextlib.suppress(FileNotFoundError):
                out[n] = os.stat(self.step_dir(step) / n).st_size
        return out

    # -- small objects -----------------------------------------------------------------------------
    def read_bytes(self, step: int, name: str) -> bytes:
        return (self.step_dir(step) / name).read_bytes()

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        d = self.prepare_step(step)
        tmp = d / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, d / name)
        if self.fsync:
            _fsync_dir(d)

    def write_json(self, step: int, name: str, doc: dict) -> None:
        self.write_bytes(step, name, json.dumps(doc, separators=(",", ":")).encode())

    def read_manifest(self, step: int) -> mf.Manifest:
        return mf.read(self.step_dir(step))

    # -- data --------------------------------------------------------------------------------------
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

    def open_file(self, step: int, name: str) -> _FileReader:
        return _FileReader(os.open(self.step_dir(step) / name, os.O_RDONLY))

    # -- removal -----------------------------------------------------------------------------------
    def remove_file(self, step: int, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.step_dir(step) / name)

    def remove_step(self, step: int) -> None:
        self.remove_file(step, mf.MANIFEST)
        shutil.rmtree(self.step_dir(step), ignore_errors=True)


class _FileReader:
    """Ranged reads of one open file with ``preadv`` straight into the caller's buffer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read_ranges(self, ranges: Sequence[tuple[int, int]], out: memoryview) -> None:
        pos = 0
        for offset, length in ranges:
            got = 0
            while got < length:
                n = os.preadv(self.fd, [out[pos + got : pos + length]], offset + got)
                if n <= 0:
                    raise TruncatedRead(offset, length, got)
                got += n
            pos += length

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


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

def is_s3_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith("s3://")


def is_peer_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith("peer://")


def peer_job(home: str | os.PathLike) -> str:
    """The namespace of job ``home`` in the checkpoint agents: the name of a ``peer://NAME`` home, else
    the same ``<name>-<hash>`` as its shared-memory directory."""
    if is_peer_url(home):
        return str(home)[len("peer://"):]
    return shm_root_for(home).name


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
    if is_s3_url(url) or is_peer_url(url):
        key = str(url).rstrip("/")
        name = key.rsplit("/", 1)[-1] or "root"
    else:
        p = local_path(url)
        key, name = str(p), p.name or "root"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return base / "tidal" / f"{name}-{digest}"


def tiers_for(url: str | os.PathLike, *, shm: bool = True) -> list[Tier]:
    """Tiers to read location ``url`` (a directory, ``s3://`` or ``peer://`` URL) from, fastest first."""
    out: list[Tier] = []
    if shm:
        root = shm_root_for(url)
        if root.exists():
            out.append(DirTier("shm", root, fsync=False))
    if is_s3_url(url):
        from tidal.ckpt.s3 import S3Tier

        out.append(S3Tier(str(url)))
    elif is_peer_url(url):
        from tidal.ckpt.peer import PeerTier

        out.append(PeerTier(peer_job(url)))
    else:
        out.append(DirTier("disk", local_path(url), fsync=True))
    return out


def newest_manifest(tiers: Sequence[Tier], step: int) -> tuple[Tier, mf.Manifest]:
    """The manifest of ``step`` from the fastest tier whose copy parses; else ManifestError."""
    errors = []
    for t in tiers:
        try:
            return t, t.read_manifest(step)
        except ManifestError as e:
            errors.append(str(e))
        except OSError as e:
            errors.append(f"tier '{t.name}': {e}")
    raise ManifestError("; ".join(errors) or f"step {step}: no manifest in any tier")

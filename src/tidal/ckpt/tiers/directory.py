"""Directory tiers (``"disk"``: a directory, fsynced; ``"shm"``: node shared memory, whose data files are
hard links to the staging slots) and resolving a checkpoint location to its tiers, fastest first.

What a directory tier creates is private to this user; the shm tier's folders must be this user's
(``files.owned_dir``); reads never follow a link out of the tier (``UnsafeFileError``, an ``OSError``,
so a load falls back). Why: docs/checkpoint.md, "Integrity". A tier object holds no mutable state."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tidal.ckpt.errors import ManifestError, TierError, UnsafeFileError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.protocol import Tier, TruncatedRead
from tidal.contract import ENV_SHM_DIR
from tidal.files import NotOwned, owned_dir, private_dirs, write_atomic

log = logging.getLogger(__name__)
SHM_BASE_ENV = ENV_SHM_DIR  # (the name bench, lab and the control plane import)


class DirTier:
    """A tier that is a directory tree. ``kind`` is "shm" for the node-shared-memory tier."""

    poll_s = (0.001, 0.05)

    def __init__(self, name: str, root: str | os.PathLike, *, fsync: bool, kind: str | None = None) -> None:
        self.name = name
        self.root = Path(root)
        self.fsync = fsync
        self.kind = kind or ("shm" if name == "shm" else "dir")
        self.durable = self.kind != "shm"
        self.fast = True
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
            if self.kind == "shm":
                self.check_owned(create=True)
            else:
                private_dirs(self.root)
        except NotOwned as e:
            raise TierError(f"tier '{self.name}': {e}") from None
        except OSError as e:
            raise TierError(f"tier '{self.name}' ({self.root}): cannot create the directory: "
                            f"{e.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise TierError(f"tier '{self.name}' ({self.root}): the directory is not writable")

    def check_owned(self, create: bool = False) -> None:
        """NotOwned (an OSError naming the directory and its owner) unless this shm tier's directory and
        its parent (``<shm>/tidal``) are this user's (or root's) and nobody else may write in them."""
        try:
            owned_dir(self.root.parent, create=create)
            owned_dir(self.root, create=create)
        except NotOwned as e:
            raise NotOwned(e.errno, f"{e.strerror}; point ${SHM_BASE_ENV} at a directory of your own",
                           e.filename) from None

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

    def list_files(self, step: int) -> set[str]:
        try:
            return set(os.listdir(self.step_dir(step)))
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def file_sizes(self, step: int) -> dict[str, int]:
        out = {}
        for n in self.list_files(step):
            with contextlib.suppress(FileNotFoundError):
                out[n] = os.stat(self.step_dir(step) / n).st_size
        return out

    # -- opening without following links ------------------------------------------------------------
    def _open_safe(self, step: int, name: str) -> int:
        """An fd of file ``name`` of ``step``, opened without following a symlink (of the step folder
        or the file) and refused when it is not a plain file or is hard-linked from elsewhere."""
        d, dfd = self.step_dir(step), self._dir_fd(step)
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafeFileError(f"{d / name}: is a symlink (refused: it may point out of "
                                          f"tier '{self.name}')") from None
                raise
        finally:
            os.close(dfd)
        try:
            self._check_plain(fd, d / name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_plain(self, fd: int, path: Path) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path}: is not a plain file (refused)")
        if st.st_nlink <= 1:
            return
        if self.kind == "shm" and st.st_uid == os.geteuid() and self._own_links(st) == st.st_nlink:
            return  # this tier's own commit: a staging slot hard-linked into its step folders
        raise UnsafeFileError(f"{path}: has {st.st_nlink} hard links (refused: a file of tier '{self.name}' "
                              "may not be linked from outside it)")

    def _own_links(self, st: os.stat_result) -> int:
        """How many names inside this tier (staging slots, step folders) the inode of ``st`` has; 0
        unless one of them is a staging slot."""
        names = [self.root / "slots"] + [self.root / n for _, n in self._step_names()]
        count, slot = 0, False
        for i, d in enumerate(names):
            with contextlib.suppress(OSError):
                if os.path.islink(d):
                    continue
                for n in os.listdir(d):
                    with contextlib.suppress(OSError):
                        s = os.lstat(d / n)
                        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino) and stat.S_ISREG(s.st_mode):
                            count += 1
                            slot = slot or i == 0
        return count if slot else 0

    # -- small objects -----------------------------------------------------------------------------
    def read_bytes(self, step: int, name: str) -> bytes:
        with os.fdopen(self._open_safe(step, name), "rb") as f:
            return f.read()

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self.write_file(step, name, memoryview(data))

    def read_manifest(self, step: int) -> mf.Manifest:
        return mf.read_object(lambda: self.read_bytes(step, mf.MANIFEST), self.where(step, mf.MANIFEST), step)

    # -- data --------------------------------------------------------------------------------------
    def prepare_step(self, step: int) -> Path:
        return private_dirs(self.step_dir(step))

    def _dir_fd(self, step: int) -> int:
        """The step folder opened without following a link (``UnsafeFileError`` when it is one)."""
        d = self.step_dir(step)
        try:
            return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and os.path.islink(d)):
                raise UnsafeFileError(f"{d}: the step folder is a symlink (refused: it may point out of "
                                      f"tier '{self.name}')") from None
            raise

    @contextlib.contextmanager
    def _step_fd(self, step: int) -> Iterator[int]:
        """The step folder, created 0700 and opened without following a link: what is written goes in it."""
        self.prepare_step(step)
        fd = self._dir_fd(step)
        try:
            yield fd
        finally:
            os.close(fd)

    def write_file(self, step: int, name: str, data: memoryview) -> None:
        with self._step_fd(step) as fd:
            write_atomic(name, data, durable=self.fsync, dir_fd=fd)

    def link_file(self, step: int, name: str, source: Path) -> None:
        """Make ``source`` (a staging slot) appear as data file ``name`` of ``step``."""
        with self._step_fd(step) as fd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
            os.link(source, name, dst_dir_fd=fd, follow_symlinks=False)

    def open_file(self, step: int, name: str) -> _FileReader:
        return _FileReader(self._open_safe(step, name))

    # -- removal -----------------------------------------------------------------------------------
    def remove_file(self, step: int, name: str) -> None:
        if os.path.islink(self.step_dir(step)):
            return  # a linked step folder: what it points at is not this tier's to remove
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.step_dir(step) / name)

    def remove_step(self, step: int) -> None:
        d = self.step_dir(step)
        if os.path.islink(d):  # never reach through a linked step folder into what it points at
            with contextlib.suppress(FileNotFoundError):
                os.unlink(d)
            return
        self.remove_file(step, mf.MANIFEST)
        failed: list[str] = []

        def note(_func: Any, path: str, exc: Any) -> None:
            err = exc[1] if isinstance(exc, tuple) else exc
            if not isinstance(err, FileNotFoundError):  # gone meanwhile: what was asked
                failed.append(f"{path}: {err}")

        if sys.version_info >= (3, 12):
            shutil.rmtree(d, onexc=note)
        else:
            shutil.rmtree(d, onerror=note)
        if failed:  # the step is invisible (no manifest); the next commit's cleanup tries again
            log.warning("tier '%s': step %d could not be removed whole (%d left; first: %s); its manifest is "
                        "gone, so it is never loaded, and the next cleanup tries again", self.name, step,
                        len(failed), failed[0])


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


SHM_DIGEST_HEX = 32  # hex digits of the location's digest in its shared-memory directory's name
SHM_NAME_CHARS = 64  # at most this much of the location's own name before it (a name is <= 255 bytes)


def shm_root_for(url: str | os.PathLike) -> Path:
    """The node-shared-memory directory that mirrors checkpoint location ``url`` on this node."""
    base = Path(os.environ.get(ENV_SHM_DIR, "/dev/shm"))
    if is_s3_url(url) or is_peer_url(url):
        key = str(url).rstrip("/")
        name = key.rsplit("/", 1)[-1] or "root"
    else:
        p = local_path(url)
        key, name = str(p), p.name or "root"
    # 128 bits: the name is also the job's namespace in the agents, which its agent token is made for.
    digest = hashlib.sha256(key.encode()).hexdigest()[:SHM_DIGEST_HEX]
    return base / "tidal" / f"{name[:SHM_NAME_CHARS]}-{digest}"


def shm_tier_to_read(url: str | os.PathLike, name: str = "shm") -> DirTier | None:
    """This node's shm tier of location ``url`` to read from: None when there is none, or (with a
    warning) when another user could have changed it (``DirTier.check_owned``)."""
    root = shm_root_for(url)
    if not root.exists():
        return None
    tier = DirTier(name, root, fsync=False, kind="shm")
    try:
        tier.check_owned()
    except NotOwned as e:
        log.warning("tier '%s' not read: %s", name, e)
        return None
    return tier


def tiers_for(url: str | os.PathLike, *, shm: bool = True) -> list[Tier]:
    """Tiers to read location ``url`` (a directory, ``s3://`` or ``peer://`` URL) from, fastest first."""
    out: list[Tier] = []
    if shm and (tier := shm_tier_to_read(url)) is not None:
        out.append(tier)
    if is_s3_url(url):
        from tidal.ckpt.tiers.s3 import S3Tier

        out.append(S3Tier(str(url)))
    elif is_peer_url(url):
        from tidal.ckpt.tiers.peer import PeerTier

        out.append(PeerTier(peer_job(url)))
    else:
        out.append(DirTier("disk", local_path(url), fsync=True))
    return out


def newest_manifest(tiers: Sequence[Tier], step: int, key: bytes | None = None) -> tuple[Tier, mf.Manifest]:
    """The manifest of ``step`` from the fastest tier whose copy parses (and carries the MAC of ``key``,
    when given); else ManifestError."""
    errors = []
    for t in tiers:
        try:
            man = t.read_manifest(step)
            mf.check_mac(man.raw, key, t.where(step, mf.MANIFEST))
            return t, man
        except ManifestError as e:
            errors.append(str(e))
        except OSError as e:
            errors.append(f"tier '{t.name}': {e}")
    raise ManifestError("; ".join(errors) or f"step {step}: no manifest in any tier")

"""Atomic file writes (a reader sees the old file or the whole new one), private and owned directories, and
:func:`open_plain`/:func:`read_plain`, the one way to read a file a job controls. Standard library only
(the shim loads it by path)."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

PRIVATE = 0o600
AS_OPEN = 0o666
"""The mode ``open(path, "w")`` creates with: 0666 less the process's umask."""


def _fsync_dir(path: str | os.PathLike | None, dir_fd: int | None) -> None:
    """Make a rename in this directory durable; a filesystem that cannot fsync a directory (EINVAL)
    leaves it to itself."""
    fd = dir_fd if dir_fd is not None else os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        if dir_fd is None:
            os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, *, mode: int = PRIVATE, group: int | None = None,
                  durable: bool = True, exclusive: bool = False, dir_fd: int | None = None,
                  text: bool = False) -> Iterator[IO[Any]]:
    """An open file (binary, or ``text``) whose content replaces ``path`` when the block ends without an
    exception: written under a fresh ``O_EXCL | O_NOFOLLOW`` name beside it, fsynced, renamed, the
    directory fsynced (``durable=False``: no fsync). Mode 0600 (:data:`AS_OPEN`: as ``open()``;
    ``group``: 0640 in it); ``exclusive``: ``FileExistsError`` if ``path`` exists; ``dir_fd``: ``path``
    is a name in it."""
    target = os.fspath(path)
    if dir_fd is not None and os.sep in target:
        raise ValueError(f"{target!r}: with dir_fd, a plain name inside that directory")
    parent, name = os.path.split(target)
    tmp = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w" if text else "wb") as f:
            if group is not None:
                os.fchown(f.fileno(), -1, group)
                os.fchmod(f.fileno(), 0o640 if mode == PRIVATE else mode)
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.unlink(tmp, dir_fd=dir_fd)
        else:
            os.replace(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        _fsync_dir(parent, dir_fd)


def write_atomic(path: str | os.PathLike, data: bytes | bytearray | memoryview | str, *,
                 mode: int = PRIVATE, group: int | None = None, durable: bool = True,
                 exclusive: bool = False, dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) atomically; mode 0600 unless told
    otherwise (:func:`atomic_writer`)."""
    with atomic_writer(path, mode=mode, group=group, durable=durable, exclusive=exclusive,
                       dir_fd=dir_fd) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int = PRIVATE, durable: bool = True) -> Iterator[Path]:
    """A temporary path beside ``path`` (created empty, 0600 unless told otherwise) for a writer that
    takes a name, not a file (a library's ``save_file``); renamed over ``path`` when the block ends
    without an exception, removed otherwise."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode))
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(target.parent, None)


def drop_torn(path: str | os.PathLike) -> None:
    """Remove what writers of ``path`` killed mid-write left beside it (the temporary names of
    :func:`atomic_writer` and :func:`atomic_path`); for a single writer, before it writes again."""
    target = Path(path)
    for p in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()


class NotOwned(OSError):
    """:func:`owned_dir` found a directory another user could change (or a link, or not a directory)."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def private_dirs(path: str | os.PathLike, mode: int = 0o700) -> Path:
    """``path`` made a directory if it is not one, each missing component created ``mode`` (never
    more, whatever the umask); existing components are left as they are."""
    p = Path(path)
    missing = []
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, mode)
            os.chmod(d, mode, follow_symlinks=False)
    return Path(path)


def owned_dir(path: str | os.PathLike, *, create: bool = True, mode: int = 0o700) -> Path:
    """``path``, a directory this user can trust: created ``mode`` when missing (``create``), and
    :class:`NotOwned`, naming it and its owner, when it is a symbolic link or not a directory, belongs
    to a user other than this process's or root, or others or its group may write in it. One this user
    owns is narrowed to ``mode`` (a directory left readable by an older version)."""
    if create:
        private_dirs(Path(path).parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotOwned(e.errno, "a symbolic link or not a directory (refused)", os.fspath(path)) from None
        raise
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (me, 0) or (st.st_uid != me and st.st_mode & 0o022):
            raise NotOwned(errno.EPERM, f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, "
                           f"so a user other than this one (uid {me}) can change what is in it (refused)",
                           os.fspath(path))
        if st.st_uid == me and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return Path(path)


class NotPlainFile(OSError):
    """What :func:`open_plain` found is not a regular file (a FIFO, a device, a directory), is owned by
    a uid it did not expect, or is larger than the caller reads."""


def open_plain(path: str | os.PathLike, *, owner: int | None = None,
               max_bytes: int | None = None) -> IO[bytes]:
    """``path`` opened for reading (binary) if it is a regular file: never through a link at its last
    component (``ELOOP``), never blocking on a FIFO, never a device (:class:`NotPlainFile`); ``owner``: the
    job's uid (a file owned by neither it nor us is refused); ``max_bytes``: a larger file is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPlainFile(errno.EINVAL, "not a regular file", os.fspath(path))
        if owner is not None and st.st_uid not in (owner, os.geteuid()):
            raise NotPlainFile(errno.EPERM, f"owned by uid {st.st_uid}, not by the job's uid {owner}",
                               os.fspath(path))
        if max_bytes is not None and st.st_size > max_bytes:
            raise NotPlainFile(errno.EFBIG, f"{st.st_size} bytes, over the limit of {max_bytes}",
                               os.fspath(path))
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_plain(path: str | os.PathLike, max_bytes: int, *, owner: int | None = None) -> bytes:
    """The whole of a file someone else controls, as :func:`open_plain` opens it, at most ``max_bytes``
    (:class:`NotPlainFile` when it holds more, also when it grew after it was opened)."""
    with open_plain(path, owner=owner, max_bytes=max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise NotPlainFile(errno.EFBIG, f"over the limit of {max_bytes} bytes", os.fspath(path))
    return data


def open_real(path: str | os.PathLike) -> int | None:
    """An ``O_PATH`` descriptor of what ``path`` resolves to now, opened one component at a time without
    following a link (a link swapped in meanwhile: None), so what is done through it (a sandbox's bind, a
    directory made in it) happens where it was checked: ``/proc/self/fd/N`` names it."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in Path(os.path.realpath(path)).parts[1:]:
            nxt = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if not stat.S_ISLNK(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None

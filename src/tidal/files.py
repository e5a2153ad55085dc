"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one; and
:func:`open_plain`, the one way to read a file a job controls. Standard library only (the shim loads it
by path).

Each write goes to a fresh hidden temporary name beside the target, created with ``O_CREAT | O_EXCL |
O_NOFOLLOW``, mode 0600 unless told otherwise (:data:`AS_OPEN`: as ``open()``; ``group``: 0640 in that
group); written, fsynced, renamed over the target and the directory fsynced (``durable=False`` skips
both fsyncs). ``exclusive=True`` publishes only if the target does not exist (the others get
``FileExistsError``); ``dir_fd`` makes ``path`` a plain name in that open directory. A failed write
leaves no temporary file.
"""

from __future__ import annotations

import contextlib
import errno
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
    """An open file (binary, or text with ``text=True``) whose content replaces ``path`` when the
    block ends without an exception; see the module's docstring for the options."""
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


class NotPlainFile(OSError):
    """What :func:`open_plain` found is not a regular file (a FIFO, a device, a directory)."""


def open_plain(path: str | os.PathLike) -> IO[bytes]:
    """``path`` opened for reading (binary) when it is a regular file: never through a symbolic link at
    its last component (``ELOOP``), never blocking on a FIFO, never a device or directory
    (:class:`NotPlainFile`). For files in a directory a job owns: the job may have swapped its file for a
    link to the state dir, a FIFO or ``/dev/zero``, and the reader must neither read elsewhere nor hang."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotPlainFile(errno.EINVAL, "not a regular file", os.fspath(path))
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise

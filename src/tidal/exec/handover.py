"""Handing a checkpoint location over to the uid of the job that takes it over (``resume_from`` with
``isolation: {uid_base, per: job}``; docs/control.md says what moves and what never does)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tidal.contract import FENCE_FILE

MAX_DEPTH = 8
MAX_ENTRIES = 100_000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = getattr(os, "O_PATH", 0) | os.O_NOFOLLOW | os.O_CLOEXEC  # Linux (checked before use)


class HandOverError(OSError):
    """The location cannot be handed over; the message names the file or process (one line)."""


@dataclass
class HandOver:
    """What :func:`hand_over` did: entries whose owner it changed, and those it left (path: why)."""

    moved: int = 0
    skipped: list[str] = field(default_factory=list)


def uid_processes(uids: Iterable[int]) -> list[tuple[int, int]]:
    """(pid, uid) of each live process with a real, effective, saved or filesystem uid in ``uids``."""
    want = set(uids)
    out = []
    for name in os.listdir("/proc") if want and os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
            continue
        hit = want.intersection(int(u) for u in fields.get("Uid", "").split() if u.isdigit())
        if hit:
            out.append((int(name), min(hit)))
    return out


def hand_over(root: Path, from_uids: Iterable[int], owner: tuple[int, int], *, max_depth: int = MAX_DEPTH,
              max_entries: int = MAX_ENTRIES) -> HandOver:
    """Give what ``from_uids`` own under directory ``root`` (itself included) to ``owner`` (uid, gid); see
    the module docstring. A missing ``root`` is nothing to hand over; :class:`HandOverError` when
    ``root`` is a link or no directory, when an earlier uid runs a process, or when the tree is too deep
    or large (found by a first walk that changes nothing: no owner has changed then)."""
    src = set(from_uids) - {owner[0]}
    done = HandOver()
    if not src:
        return done
    if not hasattr(os, "O_PATH") or not os.path.isdir("/proc/self/fd"):
        raise HandOverError("handing a checkpoint location over to another uid needs Linux (O_PATH, /proc)")
    running = uid_processes(src)
    if running:
        pid, uid = running[0]
        raise HandOverError(f"checkpoint location {_shown(root)}: process {pid} of uid {uid} (the job whose "
                            "location this job takes over) still runs; not handing it over")
    try:
        fd = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return done
    except OSError as e:
        raise HandOverError(f"checkpoint location {_shown(root)}: not a directory (or a symbolic link): "
                            f"{e.strerror}") from None
    try:
        walk = _Walk(src, owner, max_depth, max_entries)
        walk.walk_dir(fd, root, 0)  # counts and checks only
        walk.act, walk.seen = True, 0
        walk.walk_dir(fd, root, 0)
        return walk.done
    finally:
        os.close(fd)


@dataclass
class _Walk:
    src: set[int]
    owner: tuple[int, int]
    max_depth: int
    max_entries: int
    act: bool = False  # False: a first walk that only checks depth and size
    seen: int = 0
    done: HandOver = field(default_factory=HandOver)

    def walk_dir(self, dfd: int, path: Path, depth: int) -> None:
        """Directory ``dfd`` (at ``path``): its own owner, then its entries (``lstat`` through ``dfd``; one
        to move or walk is opened without following links and checked again on its descriptor)."""
        st = os.fstat(dfd)
        if st.st_uid in self.src:
            self._chown(lambda: os.fchown(dfd, *self.owner))
        elif st.st_uid != self.owner[0]:
            self._skip(path, f"owned by uid {st.st_uid}")
        with os.scandir(dfd) as it:
            entries = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        for name, est in entries:
            p = path / name
            self.seen += 1
            if self.seen > self.max_entries:
                raise _unlike(f"more than {self.max_entries} entries (at {_shown(p)})")
            if est.st_uid == self.owner[0] and not stat.S_ISDIR(est.st_mode):
                continue  # the job's already (an earlier attempt's): nothing to say
            if depth == 0 and name == FENCE_FILE and est.st_uid == os.geteuid() and stat.S_ISREG(est.st_mode):
                continue  # the plane's own fence (tidal.ckpt.fence): the new job's replaces it, not its uid
            why = _why_not(est, st, self.src)
            if why is not None:
                self._skip(p, why)
            elif stat.S_ISDIR(est.st_mode):
                if depth + 1 >= self.max_depth:
                    raise _unlike(f"{_shown(p)} is more than {self.max_depth} directories deep")
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)  # a link or FIFO swapped in: refused, unopened
                try:
                    _same(os.fstat(sub), est, p)
                    self.walk_dir(sub, p, depth + 1)
                finally:
                    os.close(sub)
            elif self.act:
                efd = os.open(name, _PATH_FLAGS, dir_fd=dfd)  # pinned: the inode checked is the one changed
                try:
                    now = os.fstat(efd)
                    _same(now, est, p)
                    if _why_not(now, st, self.src) is None:
                        self._chown(lambda efd=efd, mode=now.st_mode: self._file(efd, mode))
                finally:
                    os.close(efd)

    def _file(self, efd: int, mode: int) -> None:
        """The owner of the pinned inode itself (through its descriptor), without set-id bits."""
        os.chown(f"/proc/self/fd/{efd}", *self.owner)
        if mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(f"/proc/self/fd/{efd}", stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID))

    def _chown(self, do) -> None:
        if self.act:
            do()
            self.done.moved += 1

    def _skip(self, path: Path, why: str) -> None:
        if self.act:
            self.done.skipped.append(f"{_shown(path)}: {why}")


def _same(now: os.stat_result, then: os.stat_result, p: Path) -> None:
    if (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
        raise HandOverError(f"checkpoint location: {_shown(p)} changed during the hand-over; not handing it "
                            "over")


def _unlike(what: str) -> HandOverError:
    return HandOverError(f"checkpoint location: {what}; not a checkpoint location's layout, not handing it "
                         "over")


def _shown(p: Path) -> str:
    """``p`` on one line: a name the earlier job chose may hold a newline or bytes that are no UTF-8."""
    return repr(str(p))[1:-1]


def _why_not(st: os.stat_result, parent: os.stat_result, src: set[int]) -> str | None:
    """Why an entry keeps its owner (None: it moves, or, a directory, is walked)."""
    if st.st_dev != parent.st_dev:
        return "another filesystem (not crossed)"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link (not followed)"
    if stat.S_ISDIR(st.st_mode):
        return None  # walked: its entries are checked one by one (it moves only if src owns it)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file or directory"
    if st.st_uid not in src:
        return f"owned by uid {st.st_uid}"
    if st.st_nlink > 1:
        return f"{st.st_nlink} hard links (also outside the location)"
    return None

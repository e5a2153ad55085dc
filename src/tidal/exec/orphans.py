"""Orphans of a rank whose shim is gone: found by the attempt's :class:`Marks`, and killed (docs/control.md,
The local executor: why no job can make this kill another job's processes)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from tidal import contract as c
from tidal.exec import procs


@dataclass(frozen=True)
class Marks:
    """What marks the processes of one attempt's ranks (the module docstring says what each is worth)."""

    sessions: frozenset[tuple[int, int]]  # (pid, when seen ended) of its shims that were children
    ranks: frozenset[tuple[int, int]]  # (pid, start time) of its ranks, as their shims recorded them
    uid: int | None  # the ranks' own uid (isolation.uid_base), None when they run as the plane's user
    marker: str  # TIDAL_PROGRESS_DIR as the executor set it for this attempt

    def carried_by(self, pid: int, p: procs.Proc) -> bool:
        if (pid, p.started) in self.ranks or any(p.session == sid and p.started <= ended
                                                  for sid, ended in self.sessions):
            return True
        if self.uid is not None and procs.real_uid(pid) == self.uid:
            return True
        return procs.environ_value(pid, c.ENV_PROGRESS_DIR) == self.marker


def find(marks: Marks, keep: Iterable[int] = ()) -> list[int]:
    """The orphans that carry ``marks``: running processes whose parent is this process, one of its
    ancestors or init, other than those ancestors and ``keep`` (the live shims of tracked attempts)."""
    tab = procs.table()
    above = set(procs.ancestors(os.getpid(), tab)) | {1}
    skip = above | set(keep)
    return sorted(pid for pid, p in tab.items()
                  if p.ppid in above and pid not in skip and p.state not in ("Z", "X")
                  and marks.carried_by(pid, p))


def kill(marks: Marks, keep: Iterable[int] = (), wait_s: float = 2.0) -> list[int]:
    """Stop and kill the whole tree of each orphan carrying ``marks``, twice (one may re-parent meanwhile).
    Returns every process killed."""
    keep, killed = set(keep), []
    for _ in range(2):
        found = find(marks, keep)
        if not found:
            break
        stopped = procs.freeze(found, wait_s)
        procs.kill_all(stopped, wait_s)
        killed += stopped
    return killed

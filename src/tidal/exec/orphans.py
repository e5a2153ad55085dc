"""Orphans of a rank whose shim is gone: found, told apart from everything else, and killed.

A shim SIGKILLed by another than the executor (the OOM killer, ``kill -9``) leaves its rank and what
the rank detached to the nearest subreaper: ``tidal up`` (:func:`tidal.exec.procs.become_subreaper`)
or init. On ``observe``/``kill``/``release`` of such an attempt the local executor kills the whole tree
of each process whose parent is itself, an ancestor or init and that carries one of the attempt's
:class:`Marks`. Why no job can make this kill another job's processes:

* Only orphans are looked at: a process below a live shim never has such a parent, and the live shims
  of every tracked attempt are kept.
* ``uid``: with ``isolation.uid_base`` only a privileged process can change it.
* ``sessions``: a process can leave its shim's session, never join one, and no new process gets its id
  while a member lives; it counts only for a shim that was the executor's child and a process started
  before the shim was seen ended (never for an adopted attempt).
* ``ranks``: the rank's pid and start time, written by its shim where the job cannot write.
* ``marker``: ``TIDAL_PROGRESS_DIR`` as the executor set it. A forged marker gets only the forger's
  processes killed; a removed one lets a detached process escape, which guards against accidents
  without uids (ranks could end the plane anyway) and cannot happen with uids or memory cgroups.

The executor's other children carry no mark and are never killed, nor reaped.
"""

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

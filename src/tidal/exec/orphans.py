"""Orphans of a rank whose shim is gone: found, told apart from everything else, and killed.

The shim of each rank (:mod:`tidal.exec.shim`) is a child subreaper and kills what its rank left when
the rank ends. When the shim itself was SIGKILLed by someone other than the executor (the kernel's OOM
killer, an operator's ``kill -9``), its rank and what the rank detached re-parent to the nearest
subreaper above it: ``tidal up`` (which is one, :func:`tidal.exec.procs.become_subreaper`), or init
(pid 1) for an attempt adopted after a restart (its shims re-parented to init when the old plane ended).
On ``observe``/``kill``/``release`` of such an attempt the local executor looks, among the processes
whose parent is itself, one of its ancestors or init, for those that carry one of the attempt's marks
(:class:`Marks`), and stops and kills each one's whole tree (:func:`tidal.exec.procs.kill_tree`).

What can be trusted, and why no job can make this kill another job's processes:

* Only *orphans* are looked at: a process still below a live shim (its parent is that shim, or below
  it) never has a parent in that set, and the live shims of every tracked attempt (adopted ones, whose
  parent is init, too) are kept. So a running job is never touched, whatever it carries.
* ``uid``: with ``isolation.uid_base`` a rank runs as the job's uid, which only a privileged process can
  change: an orphan of that uid is the job's (or, with ``per: tenant``, an orphan of another attempt of
  the same tenant whose shim is gone: to be killed as well).
* ``sessions``: the shim starts in a session of its own and the rank inherits it; a process can only
  leave it (``setsid``), never join another, and the kernel gives no new process the session's id while
  the shim or a member of it lives. Once all are gone the id may be reused, by a session that began
  later: so this mark counts only for a shim that was the executor's child, and only for a process
  that started before its shim was seen ended (within one observe). For an adopted attempt, whose
  shim may have ended long before the plane restarted, it does not count.
* ``ranks``: the rank's own pid and start time, as its shim wrote them (the job cannot write there).
* ``marker``: ``TIDAL_PROGRESS_DIR`` as the executor set it (one per attempt) in the environment the
  process started with: what a rank detaches inherits it, but a process can rewrite its own. A forged
  marker only gets the forger's processes killed; a removed one lets a detached process (``setsid``, no
  uid of its own) escape. Without uids ranks run as the plane's own user and could end the plane itself
  anyway: there the marks guard against accidents (an OOM kill, a ``kill -9`` of a shim), not a hostile
  rank; with uids (or memory cgroups, :mod:`tidal.exec.cgroups`) nothing escapes.

The executor's own other children (a serving hook's command, in its session; one started in a session
of its own) carry no mark and are never killed, nor their exit status taken: the zombies collected
are those killed here and orphans taken in (:func:`tidal.exec.procs.reap_zombies`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from tidal import contract as c
from tidal.exec import procs


@dataclass(frozen=True)
class Marks:
    """What marks the processes of one attempt's ranks (see the module's docstring for what each is
    worth)."""

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
    """Stop and kill the whole tree of each orphan that carries ``marks`` (as
    :func:`tidal.exec.procs.kill_tree`; a second pass for one that re-parented meanwhile). Returns every
    process killed."""
    keep, killed = set(keep), []
    for _ in range(2):
        found = find(marks, keep)
        if not found:
            break
        stopped = procs.freeze(found, wait_s)
        procs.kill_all(stopped, wait_s)
        killed += stopped
    return killed

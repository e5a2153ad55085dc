"""Processes by pid *and* start time (a pid can be reused), and process trees stopped and killed at one
instant. Standard library only: the shim (``python -I``) loads this file by path."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable
from typing import NamedTuple


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # fields from 3 (state) on; comm may hold spaces


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone
    or not on Linux."""
    st = _stat(pid)
    return int(st[19]) if st else None


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that :func:`start_time` counts in (0 without ``/proc``)."""
    try:
        with open("/proc/uptime") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")) + 1
    except (OSError, ValueError, IndexError):
        return 0


def alive(pid: int, started: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when ``started`` is given, is the same process."""
    st = _stat(pid)
    if st is None:
        if os.path.exists("/proc/self/stat"):
            return False
        try:  # no /proc (not Linux): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if st[0] in ("Z", "X"):
        return False
    return started is None or int(st[19]) == started


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a rank's shim and the rank)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_group(pid: int) -> None:
    signal_group(pid, signal.SIGKILL)


class Proc(NamedTuple):
    ppid: int
    state: str  # the state letter (``Z``: ended, not reaped yet)
    session: int  # its session id: a session's id stays in use (no new process gets it) while it has members
    started: int  # start time, clock ticks since boot


def table() -> dict[int, Proc]:
    """Every process with its parent, state, session and start time, from ``/proc`` (empty without)."""
    out = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit() and (st := _stat(int(name))) is not None:
            out[int(name)] = Proc(int(st[1]), st[0], int(st[3]), int(st[19]))
    return out


def ancestors(pid: int, tab: dict[int, Proc] | None = None) -> list[int]:
    """``pid``, its parent, the parent's parent, ... up to init (pid 1)."""
    tab = table() if tab is None else tab
    out = [pid]
    while (p := tab.get(out[-1])) is not None and p.ppid > 0 and p.ppid not in out:
        out.append(p.ppid)
    return out


def real_uid(pid: int) -> int | None:
    """The process's real uid (``/proc/PID/status``; only a privileged process can change it), None if
    gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def environ_value(pid: int, name: str, limit: int = 1 << 20) -> str | None:
    """The value of ``name`` in the environment the process was started with (``/proc/PID/environ``;
    only its first ``limit`` bytes are read), None if not there, unreadable (another user's, without
    privilege) or gone. The process may have rewritten it since: a hint, never proof."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(limit)
    except OSError:
        return None
    key = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key):].decode(errors="replace")
    return None


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` that still run and every process below them (children, their children, ...); zombies
    (ended, not reaped yet) left out."""
    tab = table()
    below: dict[int, list[int]] = {}
    for pid, proc in tab.items():
        below.setdefault(proc.ppid, []).append(pid)
    found, todo = set(), [p for p in roots if p in tab]
    while todo:
        p = todo.pop()
        if p not in found and tab[p].state not in ("Z", "X"):
            found.add(p)
            todo += below.get(p, [])
    return found


# Stopped, gone, or in uninterruptible sleep ("D"): such a process runs no code of its own again before
# the SIGSTOP takes effect, and may stay in "D" as long as another lets it (a shell that vforked).
_STOPPED = (None, "T", "t", "Z", "X", "D")


def state(pid: int) -> str | None:
    """The process's state letter (``R`` running, ``S`` sleeping, ``T`` stopped, ``Z`` zombie, ...); None if
    gone."""
    st = _stat(pid)
    return st[0] if st else None


def freeze(roots: Iterable[int], timeout_s: float = 10.0) -> list[int]:
    """SIGSTOP the trees under ``roots`` and wait until each is stopped, pass after pass until a pass
    finds nothing new (one may fork before it stops). Returns the pids stopped, for :func:`thaw` or
    :func:`kill_all`."""
    roots = list(roots)
    stopped: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while new := descendants(roots) - stopped:
        for p in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        stopped |= new
        while any(state(p) not in _STOPPED for p in stopped) and time.monotonic() < deadline:
            time.sleep(0.001)
    return sorted(p for p in stopped if alive(p))  # not those that ended on their own meanwhile


def thaw(pids: Iterable[int]) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGCONT)


def kill_all(pids: Iterable[int], wait_s: float = 10.0) -> list[int]:
    """SIGKILL each of ``pids`` and wait up to ``wait_s`` until none runs. Returns those still there."""
    pids = list(pids)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``): an orphaned descendant (a
    daemon that double-forked, ``setsid``) re-parents here, not to init. False where the kernel has none;
    ``on=False``: no longer one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` and that still run (zombies left out)."""
    return sorted(p for p, q in table().items() if q.ppid == pid and q.state not in ("Z", "X"))


def kill_tree(roots: Iterable[int], wait_s: float = 2.0) -> list[int]:
    """End ``roots`` and every process below them, whatever session each is in: stop the whole tree first
    (:func:`freeze`: none escapes between the listing and the kill), then SIGKILL it. Waits at most
    ``wait_s`` for each; returns those still there (e.g. in a GPU driver call)."""
    return kill_all(freeze(roots, timeout_s=wait_s), wait_s)


def reap_zombies(keep: Iterable[int] = (), killed: Iterable[int] = ()) -> list[int]:
    """In a subreaper: collect the zombie children it took in as orphans: those in ``killed``, and those
    in another session that do not lead it (a child started here is in its session or leads one: its
    ``Popen`` collects its exit code). Never those in ``keep``. Returns the pids reaped."""
    me, mine, keep, killed, out = os.getpid(), os.getsid(0), set(keep), set(killed), []
    for pid, p in table().items():
        if p.ppid != me or p.state != "Z" or pid in keep:
            continue
        if pid in killed or p.session not in (mine, pid):
            with contextlib.suppress(ChildProcessError, OSError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    out.append(pid)
    return out


def reap_orphans(keep: Iterable[int] = (), wait_s: float = 10.0) -> list[int]:
    """In a subreaper: kill every process below this one except ``keep`` (and their trees), until none is
    left (one may re-parent here while the others end), and reap them. Returns the pids killed."""
    me, keep, killed = os.getpid(), set(keep), []
    for _ in range(100):
        left = [p for p in children(me) if p not in keep]
        if not left:
            break
        killed += left
        kill_tree(left, wait_s)
        for p in left:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p, os.WNOHANG)
    with contextlib.suppress(ChildProcessError, OSError):  # the zombies of the others killed below
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    return killed

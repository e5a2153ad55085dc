"""The sandbox every rank runs in (``isolation.mode: sandbox``, the default), on either executor.

Each rank's shim (on Ray: its rank actor, on its node) starts ``bwrap`` (Debian's ``bubblewrap``) instead
of the rank itself; bwrap gives the rank its own mount, PID and IPC namespaces and then runs :data:`ENTER`
(the starter's interpreter), which drops to the job's uid when there is one and execs the command (a rank
left root holds no capability). The plane decides the binds (:class:`Binds`), :func:`command` makes the
command where it runs. What the rank sees read-only and read-write, and what is never bound (the state
dir, other jobs' shared memory, a path that resolves into them: covered by an empty tmpfs): docs/control.md,
Isolation.

Signals: the shim starts bwrap with SIGTERM and SIGINT blocked (bwrap's processes forward nothing and
must outlive a notice) and :data:`ENTER` restores and unblocks them for the rank, which gets them straight
from the executor's signal to the shim's process group; one sent while the sandbox was being made stays
pending until then, so a notice at launch ends the rank at once rather than at its kill deadline. bwrap
reports a rank killed by signal ``n`` as exit code ``128 + n``; the shim records it as ``-n``, as for an
unsandboxed rank (:mod:`tidal.exec.shim`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tidal import contract as c
from tidal.files import open_real

PACKAGE = "bubblewrap"
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/sys")
ENTER = """import os, signal, sys
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))
uid, gid, cmd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
if uid >= 0:
    os.setgroups([]); os.setgid(gid); os.setuid(uid)
try:
    os.execvp(cmd[0], cmd)
except OSError as e:
    print(f"tidal: cannot start {cmd[0]!r} in {os.getcwd()}: {e}", file=sys.stderr, flush=True)
    sys.exit(127)
"""
"""Run as ``python -I -S -c ENTER UID GID PROGRAM ARG...`` inside the sandbox (UID -1: keep the user)."""


def find_bwrap() -> str:
    """The ``bwrap`` to use, checked to work here; ``ValueError`` in one line naming the package when it is
    missing or cannot make namespaces (e.g. unprivileged user namespaces turned off)."""
    exe = shutil.which("bwrap")
    if exe is None:
        raise ValueError(f"isolation: the sandbox needs bwrap (apt-get install -y {PACKAGE}); or set "
                         "isolation: {mode: none} to run jobs unsandboxed (docs/control.md, Isolation)")
    probe = [exe, *_namespaces(), "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    got = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if got.returncode != 0:
        why = got.stderr.strip().splitlines()[-1:] or [f"exit {got.returncode}"]
        raise ValueError(f"isolation: {exe} cannot make a sandbox here ({why[0]}); as a normal user it "
                         "needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
                         "or run tidal up as root, or set isolation: {mode: none}")
    return exe


def _namespaces() -> list[str]:
    """As root bwrap needs no user namespace (and the rank drops to its uid); as another user it does."""
    out = ["--die-with-parent", "--unshare-pid", "--unshare-ipc"]
    return out if os.geteuid() == 0 else [*out, "--unshare-user", "--disable-userns"]


def ckpt_dirs(env: Mapping[str, str], cwd: str) -> list[str]:
    """The directory tiers of a launch's checkpoint variables (``TIDAL_CKPT_TIERS``, else
    ``TIDAL_CKPT_URL``), relative ones from ``cwd``; none when they are malformed (the runtime says so)."""
    from tidal.ckpt.errors import CheckpointError
    from tidal.ckpt.fence import tier_specs
    from tidal.ckpt.tiers.config import kind_of, resolve

    try:
        if env.get(c.ENV_CKPT_TIERS):
            specs = tier_specs(env)
            locs = [t.location for t in resolve(specs, default_keep=0)[1] if t.kind == "dir"] if specs else []
        else:
            url = env.get(c.ENV_CKPT_URL) or ""
            locs = [url] if url and kind_of(url, "checkpoint url") == "dir" else []
    except (CheckpointError, ValueError, TypeError):
        return []
    return [os.path.join(cwd, p.removeprefix("file://")) for p in locs]


def code_paths(env: Mapping[str, str], command: Sequence[str], python: str,
               extra: Iterable[str] = ()) -> list[str]:
    """What a rank reads its code from: the interpreters' prefixes, the ``tidal`` package's directory, the
    entries of ``PYTHONPATH``, ``VIRTUAL_ENV``, the venvs on ``PATH`` (directories with ``pyvenv.cfg``
    above a ``bin``), the program (and its venv), the directory of each file its arguments name by an
    absolute path (its script), and ``extra``."""
    import tidal

    out = [sys.prefix, sys.base_prefix, str(Path(tidal.__file__).resolve().parents[1]), *extra]
    out += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    out += [env["VIRTUAL_ENV"]] if env.get("VIRTUAL_ENV") else []
    out += [str(Path(a).parent) for a in command[1:] if os.path.isabs(a) and os.path.isfile(a)]  # its script
    program = shutil.which(command[0], path=env.get("PATH")) if command else None
    bins = [str(d) for exe in (python, program) if exe
            for d in (Path(exe).parent, Path(exe).resolve().parent)]
    out += bins
    for d in [*env.get("PATH", "").split(os.pathsep), *bins]:
        if d and Path(d).name == "bin" and (Path(d).parent / "pyvenv.cfg").is_file():
            out.append(str(Path(d).parent))
    return out


FD_FLAGS = ("--bind-fd", "--ro-bind-fd")
KERNEL_FS = frozenset(("proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                       "bpf", "securityfs", "configfs", "mqueue", "efivarfs", "binfmt_misc", "nsfs"))


def mounts() -> list[tuple[str, str]]:
    """This machine's mount points and their filesystem types, in mount order (``/proc/self/mountinfo``)."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    return [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), r[4]), r[r.index("-") + 1]) for r in rows]


def kernel_fs(real: str, table: Sequence[tuple[str, str]] | None = None) -> str | None:
    """``"TYPE at MOUNT"`` when the resolved path ``real`` lies on or holds a kernel filesystem (``/proc``,
    ``/sys``, ``/dev``, ``/`` ...: the host's processes, devices, cgroups), which no sandbox binds; else None.
    ``table``: :func:`mounts`."""
    on, held = ("/", ""), None
    for mnt, fs in mounts() if table is None else table:
        if Path(real).is_relative_to(mnt) and len(mnt) >= len(on[0]):
            on = (mnt, fs)
        elif Path(mnt).is_relative_to(real) and fs in KERNEL_FS:
            held = held or f"{fs} at {mnt}"
    return f"{on[1]} at {on[0]}" if on[1] in KERNEL_FS else held


def _binds(flag: str, paths: Iterable[str], hidden: Iterable[str] = (), nested: bool = True) -> list[str]:
    """``flag-fd FD DEST`` for each existing absolute path, parents before children, each once, FD the
    directory it resolves to, opened here (:func:`tidal.files.open_real`; :func:`close_fds` closes it once
    bwrap started); its parents made first, 0711 (bwrap would make them 0700: a job's uid could not pass
    through them). A path that resolves into ``hidden`` is left out (a link a job planted would bind what
    the cover misses), as is one on a kernel filesystem (:func:`kernel_fs`) or that changed while opened.
    ``nested=False``: a path below another one is left out (for the read-write binds of what a job names:
    bwrap would make its mount point on the host, through a link the job may have swapped in)."""
    hid = [Path(os.path.realpath(h)) for h in hidden]
    found: dict[str, int] = {}
    table = mounts()
    for p in {os.path.normpath(p) for p in paths if os.path.isabs(p) and os.path.exists(p)}:
        fd = open_real(p)
        if fd is None:
            continue
        real = os.readlink(f"/proc/self/fd/{fd}")
        top = "/" + Path(p).parts[1] if p != "/" else p
        dest = real if top in SYSTEM and os.path.islink(top) else p  # /bin/x: the sandbox's /bin is a link
        if dest in found or any(Path(real).is_relative_to(h) for h in hid) or kernel_fs(real, table):
            os.close(fd)
        else:
            found[dest] = fd
    if not nested:  # seen through the one above it; bwrap would make its mount point through that bind
        for dest in [d for d in found if any(Path(d).is_relative_to(o) and d != o for o in found)]:
            os.close(found.pop(dest))
    out: list[str] = []
    made: set[str] = set()
    for dest in sorted(found, key=lambda p: (p.count("/"), p)):
        for d in reversed(Path(dest).parents[:-1]):
            if str(d) not in made:
                made.add(str(d))
                out += ["--perms", "0711", "--dir", str(d)]
        out += [f"{flag}-fd", str(found[dest]), dest]
    return out


def bind_fds(argv: Sequence[str]) -> list[int]:
    """The descriptors a sandbox command binds (:func:`command`): to pass to bwrap (``pass_fds``)."""
    end = argv.index("--") if "--" in argv else len(argv)
    return [int(argv[i + 1]) for i in range(end - 1) if argv[i] in FD_FLAGS]


def close_fds(argv: Sequence[str]) -> None:
    """Close what :func:`command` opened for ``argv`` (after bwrap started, or when it could not)."""
    for fd in bind_fds(argv):
        with contextlib.suppress(OSError):
            os.close(fd)


def _system() -> list[str]:
    out = []
    for p in SYSTEM:
        if os.path.islink(p):
            out += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            out += ["--ro-bind", p, p]
    resolv = os.path.realpath("/etc/resolv.conf")  # often a link into /run (systemd-resolved)
    if not resolv.startswith("/etc/") and os.path.isfile(resolv):
        out += ["--ro-bind", resolv, resolv]
    return out


@dataclass(frozen=True)
class Binds:
    """What a rank's sandbox binds besides the system and its code, as the plane decides it (plain data: the
    Ray executor hands it to the rank actor, which makes the command on its node). ``named``: the paths the
    job named (:func:`named`), read-write; ``hidden``: what is covered after them (the state dir, the
    plane's shared-memory root); ``attempt`` (read-only, its progress directory read-write) and ``own``
    (read-write) are bound on top; ``shm``: the job's shared-memory directory, also its ``/dev/shm``;
    ``read_only``: ``isolation.read_only``; ``gpu``: the node's NVIDIA devices too."""

    named: tuple[str, ...]
    hidden: tuple[str, ...]
    attempt: str
    own: tuple[str, ...]
    shm: str | None
    read_only: tuple[str, ...] = ()
    gpu: bool = False


def named(env: Mapping[str, str], cwd: str, hidden: Iterable[str]) -> tuple[str, ...]:
    """The directories a rank names, read-write in its sandbox: its working directory, checkpoint
    directories and ``TIDAL_SHM_DIR``, except under ``hidden`` (there it has only its own)."""
    hidden = [os.path.realpath(h) for h in hidden]
    out = [cwd, *ckpt_dirs(env, cwd), env.get(c.ENV_SHM_DIR, "")]
    return tuple(p for p in out if p and not any(Path(p).resolve().is_relative_to(h) for h in hidden))


def command(bwrap: str, program: Sequence[str], binds: Binds, *, env: Mapping[str, str], python: str,
            owner: Sequence[int] | None, cwd: str) -> list[str]:
    """The command that runs ``program`` (environment ``env``, in ``cwd``) in its sandbox, built where it
    runs (the code paths are this machine's: :func:`code_paths`): bwrap with the binds above, then
    :data:`ENTER` run by ``python``, which drops to ``owner`` (uid, gid) when given. It holds descriptors
    (:func:`bind_fds`): pass them to bwrap and :func:`close_fds` after."""
    b = binds
    out = [bwrap, *_namespaces(), *_system(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if b.gpu:
        out += [x for d in sorted(glob.glob("/dev/nvidia*")) for x in ("--dev-bind", d, d)]
    out += _binds("--ro-bind", code_paths(env, program, python, b.read_only), b.hidden)
    out += _binds("--bind", b.named, b.hidden, nested=False)
    out += [x for h in b.hidden if os.path.isdir(h) for x in ("--perms", "0711", "--tmpfs", h)]
    out += _binds("--ro-bind", [b.attempt])
    out += _binds("--bind", [os.path.join(b.attempt, c.PROGRESS_DIRNAME), *b.own])
    if b.shm is not None and os.path.isdir(b.shm):  # its parents made in it, 0711 (from the second bind on)
        fd = open_real(b.shm)
        out += [*(["--bind-fd", str(fd), "/dev/shm"] if fd is not None else []), *_binds("--bind", [b.shm])]
    uid, gid = (int(owner[0]), int(owner[1])) if owner is not None else (-1, -1)
    if owner is None and os.geteuid() == 0:  # a rank left root (an operator's own run: run_as_self): no caps
        out += ["--cap-drop", "ALL"]
    return [*out, "--chdir", cwd, "--", python, "-I", "-S", "-c", ENTER, str(uid), str(gid), *program]

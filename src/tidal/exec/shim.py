"""The per-rank shim: start one rank on a ``go`` line, wait for it, record its exit code; standard library
only (docs/control.md, The local executor).

    python -I shim.py EXIT_FILE PID_FILE [--uid U --gid G] [--rlimit NAME=N ...] [--sandbox]
                      [--cgroup DIR --cgroup-version 1|2 --memory BYTES] -- PROGRAM ARG...
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time


@functools.cache
def _load(name: str, path: str):
    """A standard-library-only module of ours, loaded once by its path (``python -I``: no package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(
        __file__)), path))
    assert spec is not None and spec.loader is not None  # a .py file path always has a spec and a loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _procs():
    """:mod:`tidal.exec.procs`, from beside this file."""
    return _load("_tidal_procs", "procs.py")


def _write(path: str, doc: dict) -> None:
    """Atomically (:func:`tidal.files.write_atomic`, from the package's root), as ``open`` would."""
    files = _load("_tidal_files", os.path.join(os.pardir, "files.py"))
    files.write_atomic(path, json.dumps(doc), mode=files.AS_OPEN)


RLIMITS = {"core": "RLIMIT_CORE", "fsize": "RLIMIT_FSIZE", "nproc": "RLIMIT_NPROC", "nofile": "RLIMIT_NOFILE"}
USAGE = ("shim.py EXIT_FILE PID_FILE [--uid U --gid G] [--rlimit NAME=N ...] [--sandbox [--pass-fd FD ...]] "
         "[--cgroup DIR --cgroup-version 1|2 --memory BYTES] -- PROGRAM ARG...")
LIMIT_FILE = {1: "memory.limit_in_bytes", 2: "memory.max"}


def _rlimit(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if name not in RLIMITS:
        raise ValueError(name)
    return name, int(value)


def _options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options and the rank's command (after ``--``); the usage and exit code 2 when they are wrong."""
    p = argparse.ArgumentParser(prog="shim.py", usage=USAGE)
    for name in ("exit_file", "pid_file", "--cgroup"):
        p.add_argument(name)
    for name in ("--uid", "--gid", "--memory"):
        p.add_argument(name, type=int)
    p.add_argument("--cgroup-version", type=int, choices=sorted(LIMIT_FILE))
    p.add_argument("--rlimit", type=_rlimit, action="append", default=[])
    p.add_argument("--pass-fd", type=int, action="append", default=[])  # the sandbox's binds, to bwrap
    p.add_argument("--sandbox", action="store_true")
    i = argv.index("--") if "--" in argv else len(argv)
    o = p.parse_args(argv[:i])
    if not argv[i + 1:] or (o.cgroup is None) != (o.memory is None) or (o.cgroup and not o.cgroup_version):
        p.error("a command after --; --cgroup with --memory and --cgroup-version")
    return o, argv[i + 1:]


def _join_cgroup(opts: argparse.Namespace) -> None:
    """Create the rank's memory cgroup, set its limit and move this shim into it (the rank inherits it)."""
    d = opts.cgroup
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, LIMIT_FILE[opts.cgroup_version]), "w") as f:
        f.write(str(opts.memory))
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def _oom_kills(opts: argparse.Namespace) -> int:
    """How many processes the kernel killed in the rank's cgroup for memory (v2: memory.events; v1:
    memory.oom_control's oom_kill, else whether the limit was hit at all: memory.failcnt)."""
    d = opts.cgroup
    name = "memory.events" if opts.cgroup_version == 2 else "memory.oom_control"
    try:
        with open(os.path.join(d, name)) as f:
            fields = dict(line.split() for line in f if len(line.split()) == 2)
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
        with open(os.path.join(d, "memory.failcnt")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _leave_cgroup(opts: argparse.Namespace) -> None:
    """Back to the parent's parent (the plane's own cgroup), then remove the rank's cgroup."""
    d = opts.cgroup
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(d)), "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(d)
    except OSError:
        pass  # the plane removes empty rank cgroups at start


def set_limits(rlimits: dict, sandbox: bool = False) -> None:
    """In the child before exec: lower the limits (never raised); for a sandbox, block SIGTERM and SIGINT
    (bwrap's processes must outlive a notice; the rank inside unblocks them, and one sent while the sandbox
    was being made is then delivered, not lost). Imports nothing: the child may already run as a uid that
    cannot read the Python installation."""
    if sandbox:
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))
    for name, value in rlimits.items():
        res = getattr(resource, RLIMITS[name], None)
        if res is None:
            continue
        _, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))


def main(argv: list[str]) -> int:
    opts, cmd = _options(argv)
    exit_file, pid_file = opts.exit_file, opts.pid_file
    os.umask(0o077)
    if sys.stdin.readline().strip() != "go":
        return 0  # the control plane went away before recording this launch: run nothing
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    procs = _procs()
    procs.become_subreaper()
    try:
        if opts.cgroup:
            _join_cgroup(opts)
        kw: dict = {}
        if opts.uid is not None:
            kw.update(user=opts.uid, group=opts.uid if opts.gid is None else opts.gid, extra_groups=[])
        rlimits, sandbox = dict(opts.rlimit), opts.sandbox
        setup = (lambda: set_limits(rlimits, sandbox)) if rlimits or sandbox else None
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, umask=0o077, close_fds=True, preexec_fn=setup,
                                pass_fds=opts.pass_fd, **kw)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"tidal: cannot start {cmd[0]!r} in {os.getcwd()}: {e}", file=sys.stderr, flush=True)
        _write(exit_file, {"code": 127, "time": time.time(), "error": str(e)})
        return 127
    _write(pid_file, {"pid": proc.pid, "time": time.time(), "started": procs.start_time(proc.pid)})
    code = proc.wait()
    if opts.sandbox and 128 < code < 160:  # bwrap's report of a rank killed by a signal
        code = 128 - code
    procs.reap_orphans()  # what the rank left running (a daemon, a setsid'd helper) ends with it
    doc: dict = {"code": code, "time": time.time()}
    if opts.cgroup:
        if code < 0 and _oom_kills(opts):
            doc["error"] = f"killed for memory: over isolation.max_memory_bytes ({opts.memory} bytes)"
            print(f"tidal: the rank was {doc['error']}", file=sys.stderr, flush=True)
        _leave_cgroup(opts)
    _write(exit_file, doc)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

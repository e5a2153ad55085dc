"""One rank of a job on a Ray node: a detached, named actor that runs the user's command as a process.

:meth:`RankActor.start` runs the command once (a second call returns the first pid) as a child in its own
session, with ``PR_SET_PDEATHSIG`` = SIGKILL, as ``owner``'s uid and in the sandbox of ``binds`` when given
(:func:`tidal.exec.sandbox.command`, made on this node; Ray's own directory hidden: :func:`ray_dirs`). The
worker is a child subreaper: what the rank leaves is killed when it ends. The actor keeps the exit code for
a plane that finds it by name (docs/control.md, The Ray executor).

Imported by every Ray worker that hosts a rank: standard library, ``ray`` and small parts of ours (no torch).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tidal.exec import procs, sandbox
from tidal.exec.isolation import private_dir
from tidal.exec.ray_auth import token_file
from tidal.exec.shim import set_limits
from tidal.files import AS_OPEN, write_atomic
from tidal.net import free_port

PR_SET_PDEATHSIG = 1
_PRCTL: Callable[..., int] | None
try:  # resolved before any fork: the child only calls it
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _child_setup(parent: int, rlimits: Mapping[str, int] | None = None, sandboxed: bool = False) -> None:
    """In the child before exec (after ``Popen`` switched to the rank's uid: a change of uid clears the
    parent-death signal): die with the actor's worker, no core dumps, the rank's ``rlimits``; for a
    sandbox, SIGTERM and SIGINT blocked (:func:`tidal.exec.shim.set_limits`)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the actor died between fork and prctl
        os._exit(137)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    set_limits(dict(rlimits or {}), sandboxed)


_bwrap = functools.cache(sandbox.find_bwrap)  # checked once per worker


def _node_shm_dir(shm_dir: str, owner: tuple[int, int] | None) -> None:
    """On the node: the job's node-memory directory ``<base>/<node>/<job>`` 0700, owned by its uid (if
    any), below 0711 directories."""
    d = Path(shm_dir)
    private_dir(d.parent.parent, 0o711)
    private_dir(d.parent, 0o711)
    private_dir(d, 0o700, owner)


def ray_dirs() -> list[str]:
    """What of Ray's no rank's sandbox shows on this node: its directory (``/tmp/ray``: sockets, ports files
    and logs, in directories every user may write; the node's and Ray's default) and the directory of the
    token file this worker reads (the workers' user's, so readable by ranks that run as that user)."""
    out = [os.path.join(tempfile.gettempdir(), "ray")]
    with contextlib.suppress(Exception):  # Ray's private API: the worker's node
        from ray._private.worker import global_worker

        if global_worker.node is not None:
            out.insert(0, global_worker.node.get_temp_dir_path())
    token = token_file()
    if token is not None and str(token.parent) not in ("/", *sandbox.SYSTEM):
        out.append(str(token.parent))
    return list(dict.fromkeys(out))


class RankActor:
    """See the module docstring. Methods are quick (never wait on the rank): called from the reconcile
    step."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self.error: str | None = None
        self.sandboxed = False

    def info(self) -> dict:
        """Where this rank runs: Ray node id, the node's address, the GPUs Ray gave it, the actor's pid."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self) -> int:
        """A free TCP port on this node (rank 0's: the rendezvous, ``MASTER_PORT``)."""
        return free_port("")

    def start(self, command: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str, header: str,
              pid_path: str | None = None, owner: Sequence[int] | None = None,
              rlimits: Mapping[str, int] | None = None, shm_dir: str | None = None,
              binds: sandbox.Binds | None = None) -> int | None:
        """Run ``command`` (once); its pid, or None if it could not start (the reason is in the log and
        :meth:`poll`). ``owner``: the uid and gid to run it as (no supplementary groups; the worker must
        be root); the job's node-memory directory ``shm_dir`` is made here first; ``rlimits``: see
        :func:`tidal.exec.isolation.rank_rlimits`; ``binds``: run it in its sandbox."""
        if self.proc is not None or self.error is not None:
            return self.proc.pid if self.proc is not None else None
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with open(fd, "ab") as out:
            out.write(header.encode())
            out.flush()
            parent = os.getpid()
            kw: dict = {}
            cmd = list(command)
            try:
                own = (int(owner[0]), int(owner[1])) if owner is not None else None
                if own is not None and os.geteuid() != 0:
                    raise PermissionError(f"the Ray worker on this node runs as uid {os.geteuid()}, not "
                                          f"root: it cannot run the rank as uid {own[0]} (uid_base)")
                if shm_dir is not None and (own is not None or binds is not None):
                    _node_shm_dir(shm_dir, own)
                if binds is not None:  # the uid is dropped inside the sandbox (sandbox.ENTER)
                    binds = dataclasses.replace(binds, hidden=(*binds.hidden, *ray_dirs()))
                    cmd = sandbox.command(_bwrap(), command, binds, env=env, python=sys.executable, owner=own,
                                          cwd=cwd)
                    self.sandboxed = True
                elif own is not None:
                    kw = {"user": own[0], "group": own[1], "extra_groups": []}
                boxed = binds is not None
                procs.become_subreaper()  # what the rank detaches stays below this worker
                try:
                    self.proc = subprocess.Popen(
                        cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                        env=dict(env), umask=0o077, start_new_session=True, close_fds=True,
                        pass_fds=sandbox.bind_fds(cmd) if boxed else (),
                        preexec_fn=lambda: _child_setup(parent, rlimits, boxed), **kw)
                finally:
                    if boxed:
                        sandbox.close_fds(cmd)
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                self.error, self.code = f"cannot start {command[0]!r} in {cwd}: {e}", 127
                out.write(f"tidal: {self.error}\n".encode())
                return None
        if pid_path is not None:
            with contextlib.suppress(OSError):
                write_atomic(pid_path, json.dumps({"pid": self.proc.pid, "time": time.time()}), mode=AS_OPEN)
        return self.proc.pid

    def poll(self) -> dict:
        """``{"started", "pid", "code", "error"}``: ``code`` None while the rank runs (negative: killed by
        that signal)."""
        if self.proc is not None and self.code is None:
            self.code = self.proc.poll()
            if self.sandboxed and self.code is not None and 128 < self.code < 160:  # bwrap's "killed by n"
                self.code = 128 - self.code
            if self.code is not None:
                procs.reap_orphans()  # the rank ended: what it left running (a setsid'd daemon) too
        return {"started": self.proc is not None or self.error is not None, "code": self.code,
                "pid": self.proc.pid if self.proc is not None else None, "error": self.error}

    def end(self) -> None:
        """Kill the rank and every process below this actor (however it detached), and reap them: the
        executor calls it before it kills the actor (whose death would leave them to init)."""
        if self.proc is not None:
            procs.kill_tree([self.proc.pid, *procs.children(os.getpid())])
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.poll()
        procs.reap_orphans()

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the rank's process group while it runs (SIGKILL: :meth:`end`); True if sent."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        if sig == signal.SIGKILL:
            self.end()
            return True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
            return True
        return False

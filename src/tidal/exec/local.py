"""The local executor: every rank of a job is a process on this machine, under a shim, on ``slots`` CPU slots
(gloo) or the NVIDIA GPUs in ``gpu_ids`` (docs/control.md, The local executor: environment, files per
attempt, isolation, orphans). Not thread-safe: one reconcile loop drives it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from tidal import contract as c
from tidal.contract import one_node_env, torchrun_env
from tidal.exec import cgroups, orphans, procs, sandbox, shim
from tidal.exec.files import Attempt, AttemptDirs, read_json, write_json
from tidal.exec.isolation import (
    AUTO,
    IsolationConfig,
    Uids,
    auto_memory_bytes,
    check_reachable,
    clean_env,
    default_shm_dir,
    prepare_attempt,
    private_dir,
    rank_rlimits,
    recorded_owner,
    require_root,
)
from tidal.exec.protocol import LaunchError, LaunchRequest, Observation
from tidal.model import Node, PoolName
from tidal.net import free_port

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 10.0
"""As a subreaper, how often ``observe`` collects what re-parented here and ended on its own (a daemon a
serving hook started, a helper a rank detached): without it each stays a zombie until the plane exits."""


def detect_gpus() -> list[int]:
    """Indices of the NVIDIA GPUs ``nvidia-smi`` sees (none without the tool or a GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
            check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in out.split() if x.strip().isdigit()]


@dataclass
class _Rank:
    rank: int
    pid: int
    started: int | None
    popen: subprocess.Popen | None = None  # None when adopted after a restart


def _go_pipe(k: _Rank) -> IO[bytes]:
    """The pipe a rank this executor spawned waits on: its shim runs the rank on "go", exits on EOF."""
    assert k.popen is not None and k.popen.stdin is not None  # spawned with stdin=PIPE
    return k.popen.stdin


@dataclass
class _Tracked(Attempt):
    # lost: ranks whose shim ended and recorded nothing (killed)
    devices: list[int] = field(default_factory=list)
    shim_ended: dict[int, int] = field(default_factory=dict)  # rank -> when its shim, a child, was seen ended


class LocalExecutor(AttemptDirs):
    """Runs ranks as local processes. ``slots`` CPU slots, or the GPUs in ``gpu_ids``."""

    isolation: IsolationConfig

    def __init__(self, root: str | os.PathLike, *, slots: int | None = None, gpu_ids: list[int] | None = None,
                 node: str = "local", python: str = sys.executable,
                 serving_nodes: Mapping[str, int] | None = None, isolation: IsolationConfig | None = None,
                 subreaper: bool = False, hidden: Collection[str | os.PathLike] = (),
                 run_as_self: bool = False) -> None:
        if (slots is None) == (gpu_ids is None):
            raise ValueError("give exactly one of slots (CPU) or gpu_ids")
        iso = isolation or IsolationConfig()
        require_root(iso)
        self.bwrap = sandbox.find_bwrap() if iso.sandboxed else None
        self.root = Path(root)
        self.hidden = [str(Path(p).resolve()) for p in (root, *hidden)]  # no rank sees them (but its own)
        # 0711 with unsandboxed uids: a job's uid may pass through to its own directories, never list others'
        private_dir(self.root, 0o711 if iso.uid_base is not None and not iso.sandboxed else 0o700)
        # run_as_self: an operator's own runs (benchmarks, verify-resume), sandboxed but as this user
        self.isolation = iso = iso.resolved(self.root, uids=not run_as_self)
        self.uids = Uids(self.root / ".uids.json", iso.uid_base) if iso.uid_base is not None else None
        shm = iso.shm_dir if iso.shm_dir is not None else default_shm_dir(self.root)
        self.shm_root = Path(shm) if shm else None
        if self.uids is not None and not iso.sandboxed:
            check_reachable(self.root.resolve(), *([Path(shm).absolute()] if shm else []))
        self.cgroups = None
        if iso.max_memory_bytes is not None:  # refuse to start rather than drop a limit asked for
            try:
                self.cgroups = cgroups.find(self.root)
            except ValueError as e:
                if iso.max_memory_bytes != AUTO:
                    raise
                log.info("isolation.max_memory_bytes: auto: no memory limit per rank (%s)", e)
            memory = auto_memory_bytes() if iso.max_memory_bytes == AUTO else iso.max_memory_bytes
            self.isolation = iso = replace(iso, max_memory_bytes=memory if self.cgroups else None)
            if self.cgroups is not None:
                cgroups.remove_empty(self.cgroups)
        self.gpu = gpu_ids is not None
        devices = list(gpu_ids) if gpu_ids is not None else list(range(slots or 0))
        serving = dict(serving_nodes or {})
        if node in serving:
            raise ValueError(f"serving node {node!r} has the training node's name")
        if self.gpu:  # serving nodes take the last GPUs, training keeps the first
            n_serving = sum(serving.values())
            if n_serving >= len(devices):
                raise ValueError(f"serving nodes need {n_serving} of the {len(devices)} GPUs; training needs "
                                 ">= 1")
            serving_devices = devices[len(devices) - n_serving:]
            devices = devices[: len(devices) - n_serving]
        else:  # virtual serving nodes: more CPU slots, numbered after the training ones
            serving_devices = list(range(len(devices), len(devices) + sum(serving.values())))
        if not devices:
            raise ValueError("no GPUs or slots to run on")
        self.node = node
        self.python = python
        # node -> (pool, its devices); devices are unique across nodes (CUDA_VISIBLE_DEVICES indices)
        self.node_devices: dict[str, list[int]] = {node: devices}
        self.pools: dict[str, PoolName] = {node: "training"}
        for name, g in serving.items():
            self.node_devices[name], serving_devices = serving_devices[:g], serving_devices[g:]
            self.pools[name] = "serving"
        self.devices = [d for ds in self.node_devices.values() for d in ds]
        self._free: dict[str, list[int]] = {n: list(ds) for n, ds in self.node_devices.items()}
        self._jobs: dict[str, _Tracked] = {}
        # what a shim killed by another left re-parents here, not to init (``tidal up``: the process that
        # owns the shims; off by default: it changes the whole process, see close())
        self.subreaper = subreaper and procs.become_subreaper()
        self._reap_at_s = -math.inf

    def close(self) -> None:
        """No longer a subreaper (the running shims and ranks go on: a restarted plane adopts them)."""
        if self.subreaper:
            procs.become_subreaper(False)
            self.subreaper = False

    def nodes(self) -> list[Node]:
        return [Node(n, len(ds), self.pools[n]) for n, ds in self.node_devices.items()]

    def used(self) -> dict[str, int]:
        """Node -> devices held by tracked jobs (launched and not yet released)."""
        return {n: len(ds) - len(self._free[n]) for n, ds in self.node_devices.items()}

    def placements(self) -> dict[str, dict[str, int]]:
        """Job -> node -> devices it holds there (running, or not yet released)."""
        return {job: dict(Counter(self._node_of(d) for d in t.devices)) for job, t in self._jobs.items()}

    def _node_of(self, device: int) -> str:
        for n, ds in self.node_devices.items():
            if device in ds:
                return n
        return self.node

    def launch(self, req: LaunchRequest, now_s: float) -> dict:
        if req.job_id in self._jobs:
            raise LaunchError(f"job {req.job_id}: attempt {self._jobs[req.job_id].attempt} is still tracked")
        n = req.world_size
        unknown = set(req.placement) - set(self.node_devices)
        if unknown:
            raise LaunchError(f"job {req.job_id}: placement {dict(req.placement)} names unknown nodes "
                              f"{sorted(unknown)} (have {sorted(self.node_devices)})")
        for node, k in req.placement.items():
            if k > len(self._free[node]):
                raise LaunchError(
                    f"job {req.job_id}: needs {k} devices on {node}, {len(self._free[node])} free"
                )
        if req.workdir is not None and not Path(req.workdir).is_dir():
            raise LaunchError(f"job {req.job_id}: workdir {req.workdir} is not a directory")
        devices = []
        for node, k in req.placement.items():
            devices += self._free[node][:k]
            self._free[node] = self._free[node][k:]
        adir = self.attempt_dir(req.job_id, req.attempt)
        try:
            owner = self._owner(req)
            self._make_dirs(req, adir, owner)
        except (OSError, RuntimeError) as e:
            self._give_back(devices)
            raise LaunchError(f"job {req.job_id}: cannot prepare its directories: {e}") from e
        port = free_port()
        ranks: list[_Rank] = []
        try:
            for r in range(n):
                ranks.append(self._spawn(req, r, devices, port, adir, owner))
            doc = {"job_id": req.job_id, "attempt": req.attempt, "world_size": n, "devices": devices,
                   "gpu": self.gpu, "master_port": port, "launched_s": now_s,
                   "owner": list(owner) if owner else None,
                   "ranks": [{"rank": k.rank, "pid": k.pid, "started": k.started} for k in ranks]}
            write_json(adir / c.LAUNCH_FILE, doc)
            for rk in ranks:  # the second phase: recorded, now run
                go = _go_pipe(rk)
                go.write(b"go\n")
                go.close()
        except BaseException:
            for rk in ranks:
                with contextlib.suppress(OSError):
                    _go_pipe(rk).close()  # EOF: the shim exits, runs nothing
                procs.kill_group(rk.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    assert rk.popen is not None  # spawned here
                    rk.popen.wait(timeout=5)
            self._give_back(devices)
            raise
        self._jobs[req.job_id] = _Tracked(req.job_id, req.attempt, now_s, adir, ranks, owner, devices=devices)
        return {"node": self.node, "placement": dict(req.placement), "devices": devices, "master_port": port,
                "dir": str(adir), **({"uid": owner[0]} if owner else {}),
                "ranks": [{"rank": k.rank, "pid": k.pid} for k in ranks]}

    def shm_dir(self, job_id: str) -> Path | None:
        """The job's shared-memory directory (``TIDAL_SHM_DIR`` unless its spec sets one)."""
        return self.shm_root / job_id if self.shm_root is not None else None

    def _owner(self, req: LaunchRequest) -> tuple[int, int] | None:
        return self.uids.owner(self.isolation.per, req.job_id, req.tenant) if self.uids is not None else None

    def _make_dirs(self, req: LaunchRequest, adir: Path, owner: tuple[int, int] | None) -> None:
        """The job's directories and checkpoint fence (:func:`prepare_attempt`), and its shm directory."""
        sandboxed = self.bwrap is not None
        prepare_attempt(self.root, self.job_dir, adir, self.home_dir(req.job_id), req, owner, self.uids,
                        self.hidden if sandboxed else None)
        shm = self.shm_dir(req.job_id)
        if shm is not None and (c.ENV_SHM_DIR not in req.env or sandboxed):  # sandboxed: also its /dev/shm
            private_dir(shm.parent, 0o711 if owner and not sandboxed else 0o700)
            private_dir(shm, 0o700, owner)

    def job_env(self, req: LaunchRequest, r: int, devices: list[int], port: int,
                adir: Path) -> dict[str, str]:
        """Rank ``r``'s whole environment (:func:`~tidal.exec.isolation.clean_env`)."""
        base = one_node_env()
        shm = self.shm_dir(req.job_id)
        if shm is not None:
            base[c.ENV_SHM_DIR] = str(shm)
        platform = {**torchrun_env(r, req.world_size, port), **self.attempt_env(req, adir),
                    c.ENV_CUDA_VISIBLE_DEVICES: ",".join(map(str, devices)) if self.gpu else ""}
        return clean_env(self.isolation, self.home_dir(req.job_id), req.env, platform,
                         omp_threads=(os.cpu_count() or 1) // len(self.devices), base=base)

    def _shim_options(self, owner: tuple[int, int] | None, req: LaunchRequest, rank: int) -> list[str]:
        iso = self.isolation
        out = [x for k, v in rank_rlimits(iso, owner).items() for x in ("--rlimit", f"{k}={v}")]
        if self.cgroups is not None and iso.max_memory_bytes is not None:
            out += ["--cgroup", str(self.cgroups.rank_dir(req.job_id, req.attempt, rank)),
                    "--cgroup-version", str(self.cgroups.version), "--memory", str(iso.max_memory_bytes)]
        if self.bwrap is not None:
            out.append("--sandbox")  # the rank's uid is set inside the sandbox (sandbox.ENTER)
        elif owner is not None:
            out += ["--uid", str(owner[0]), "--gid", str(owner[1])]
        return out

    def shm_jobs(self) -> list[str]:
        """Jobs that have a shared-memory directory here."""
        if self.shm_root is None:
            return []
        try:
            return sorted(p.name for p in self.shm_root.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            return []

    def free_shm(self, job_id: str) -> bool:
        """Remove the job's shared-memory directory (its node-memory tier); True if it was there."""
        d = self.shm_dir(job_id)
        if d is None or job_id in self._jobs or not d.is_dir() or d.is_symlink():
            return False
        shutil.rmtree(d, ignore_errors=True)
        return True

    def _spawn(self, req: LaunchRequest, r: int, devices: list[int], port: int, adir: Path,
               owner: tuple[int, int] | None = None) -> _Rank:
        n = req.world_size
        env = self.job_env(req, r, devices, port, adir)
        log = Path(self.log_path(req.job_id, r))
        try:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise LaunchError(f"job {req.job_id}: cannot open its log {log}: {e}") from e
        with open(fd, "ab") as out:
            out.write(f"=== tidal: {req.job_id} attempt {req.attempt}, rank {r} of {n}, "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            out.flush()
            cwd = req.workdir or str(self.home_dir(req.job_id))
            shm = str(self.shm_dir(req.job_id) or "") or None
            cmd = list(req.command) if self.bwrap is None else sandbox.command(
                self.bwrap, req.command, self.binds(req, adir, env, cwd, shm, self.gpu), env=env,
                python=self.python, owner=owner, cwd=cwd)
            fds = sandbox.bind_fds(cmd) if self.bwrap is not None else []
            try:
                p = subprocess.Popen([self.python, "-I", shim.__file__, str(adir / c.exit_file(r)),
                                      str(adir / c.pid_file(r)), *self._shim_options(owner, req, r),
                                      *(x for fd in fds for x in ("--pass-fd", str(fd))), "--", *cmd],
                                     stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                     cwd=cwd, env=env, start_new_session=True, pass_fds=fds)
            except OSError as e:
                raise LaunchError(f"job {req.job_id}: cannot start rank {r}: {e}") from e
            finally:
                sandbox.close_fds(cmd)
        return _Rank(r, p.pid, procs.start_time(p.pid), p)

    def _send(self, t: _Tracked, ranks: list[_Rank], sig: int) -> None:
        for k in ranks:
            if self._alive(k):
                if sig == signal.SIGKILL:  # the shim's whole tree: what the rank detached is in it too
                    procs.kill_tree([k.pid])
                procs.signal_group(k.pid, sig)
        if sig == signal.SIGKILL:
            self._kill_left(t)

    def _kill_left(self, t: _Tracked) -> None:
        """What killed shims left: with memory cgroups, what is still in a rank's cgroup (a job's uid cannot
        leave it; the backstop where the orphans went to init), then the orphans."""
        if self.cgroups is not None:
            for k in t.ranks:
                d = self.cgroups.rank_dir(t.job_id, t.attempt, k.rank)
                procs.kill_tree(cgroups.members(d))
                with contextlib.suppress(OSError):  # gone, or a shim still in it (it removes it)
                    os.rmdir(d)
        if any(self._shim_lost(t, k) for k in t.ranks):
            self._kill_orphans(t)

    def release_unadopted(self) -> list[str]:
        """After a restart's adoptions: what is left of attempts not tracked (an end a plane killed before its
        release had stored): with memory cgroups, each such rank cgroup's processes killed and the cgroup
        removed. (A rank's processes end with it otherwise: its shim reaps what it left.)"""
        if self.cgroups is None:
            return []
        keep = {self.cgroups.rank_dir(t.job_id, t.attempt, k.rank)
                for t in self._jobs.values() for k in t.ranks}
        try:
            left = sorted(p for p in self.cgroups.root.iterdir() if p.is_dir() and p not in keep)
        except OSError:  # (the plane's cgroup gone: nothing of it is left)
            return []
        out = []
        for d in left:
            if members := cgroups.members(d):
                procs.kill_tree(members)
                out.append(f"rank cgroup {d.name}: pids {sorted(members)}")
            with contextlib.suppress(OSError):
                os.rmdir(d)
        for what in out:
            log.warning("killed the leftover %s", what)
        return out

    def _shim_lost(self, t: _Tracked, k: _Rank) -> bool:
        """The rank's shim ended without recording its exit (killed: what it had below is orphaned)."""
        if k.rank in t.lost:
            return True
        if k.rank in t.codes or self._alive(k):
            return False
        if k.popen is not None:
            t.shim_ended.setdefault(k.rank, procs.boot_ticks())
        doc = read_json(t.dir / c.exit_file(k.rank))
        return not (doc is not None and isinstance(doc.get("code"), int))

    def _marks(self, t: _Tracked) -> orphans.Marks:
        ranks = set()
        for k in t.ranks:
            doc = read_json(t.dir / c.pid_file(k.rank))
            if doc and isinstance(doc.get("pid"), int) and isinstance(doc.get("started"), int):
                ranks.add((doc["pid"], doc["started"]))
        sessions = frozenset((k.pid, t.shim_ended[k.rank]) for k in t.ranks if k.rank in t.shim_ended)
        return orphans.Marks(sessions, frozenset(ranks),
                             t.owner[0] if t.owner else None, str(t.dir / c.PROGRESS_DIRNAME))

    def _kill_orphans(self, t: _Tracked) -> list[int]:
        """Kill what the attempt's killed shims left (:mod:`tidal.exec.orphans`), sparing the live shims
        of every attempt; as a subreaper, collect the zombies taken in."""
        tracked = [k for u in (*self._jobs.values(), t) for k in u.ranks]
        killed = orphans.kill(self._marks(t), keep=[k.pid for k in tracked if self._alive(k)])
        if self.subreaper:
            procs.reap_zombies(keep=[k.pid for k in tracked if k.popen is not None], killed=killed)
        return killed

    def release(self, job_id: str) -> None:
        t = self._jobs.pop(job_id, None)
        if t is None:
            return
        for k in t.ranks:
            if self._alive(k):  # released while it runs: nothing of it outlives the release
                procs.kill_tree([k.pid])
            if k.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    k.popen.wait(timeout=5)
        self._kill_left(t)
        self._give_back(t.devices)

    def _give_back(self, devices: list[int]) -> None:
        for d in devices:
            n = self._node_of(d)
            if d in self.node_devices.get(n, ()) and d not in self._free[n]:
                self._free[n].append(d)

    def observe(self, now_s: float) -> dict[str, Observation]:
        if self.subreaper and now_s >= self._reap_at_s:  # what re-parented here and ended since
            self._reap_at_s = now_s + REAP_INTERVAL_S
            shims = [k.pid for u in self._jobs.values() for k in u.ranks if k.popen is not None]
            procs.reap_zombies(keep=shims)
        return {job_id: self._observe(t) for job_id, t in self._jobs.items()}

    def _observe(self, t: _Tracked) -> Observation:
        lost = len(t.lost)
        for k in t.ranks:
            if k.rank not in t.codes and k.rank not in t.vanished:
                self._poll_rank(t, k)
        if len(t.lost) > lost:  # a shim killed by another (OOM, kill -9): what it left ends now
            self._kill_orphans(t)
        self.cap_logs(t, self.isolation.max_log_bytes)
        return t.observation()

    def _poll_rank(self, t: _Tracked, k: _Rank) -> None:
        if k.popen is not None:
            code = k.popen.poll()
            if code is None:
                return
            t.shim_ended.setdefault(k.rank, procs.boot_ticks())
        elif self._alive(k):
            return
        else:
            code = None
        doc = read_json(t.dir / c.exit_file(k.rank))
        if doc is not None and isinstance(doc.get("code"), int):
            t.codes[k.rank] = doc["code"]  # the rank's own code, as its shim saw it
        elif code is not None and code < 0:
            t.codes[k.rank] = code  # shim and rank killed together (SIGKILL of the group)
            t.lost.add(k.rank)
        else:
            t.vanished.add(k.rank)  # gone, and nobody recorded how
            t.lost.add(k.rank)

    def _alive(self, k: _Rank) -> bool:
        if k.popen is not None:
            return k.popen.poll() is None
        return procs.alive(k.pid, k.started)

    def worker_pids(self, job_id: str) -> dict[int, int]:
        """rank -> the rank's own pid (under its shim), for those that started."""
        t = self._jobs.get(job_id)
        docs = [read_json(t.dir / c.pid_file(k.rank)) for k in t.ranks] if t is not None else []
        return {r: d["pid"] for r, d in enumerate(docs) if d and isinstance(d.get("pid"), int)}

    def adopt(self, job_id: str, attempt: int, now_s: float) -> bool:
        """Track an attempt again from its ``launch.json``; False without one (no rank of it ever started)."""
        adir = self.attempt_dir(job_id, attempt)
        doc = read_json(adir / c.LAUNCH_FILE)
        if doc is None:
            return False
        devices = list(doc["devices"])  # held by the workers whatever this executor was told at start
        taken = set(devices)
        self._free = {n: [d for d in free if d not in taken] for n, free in self._free.items()}
        ranks = [_Rank(r["rank"], r["pid"], r.get("started")) for r in doc["ranks"]]
        self._jobs[job_id] = _Tracked(job_id, attempt, float(doc["launched_s"]), adir, ranks,
                                      recorded_owner(doc), devices=devices)
        return True

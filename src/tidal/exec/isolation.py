"""How the executors isolate a job from the control plane and from other jobs: the ``isolation:`` block of
``tidal up --config`` (:class:`IsolationConfig`; ``isolation: none`` is ``{mode: none}``), the rank's clean
environment and its directories (0600/0700, owned by the job's uid with ``uid_base``; what it takes over:
:mod:`tidal.exec.handover`). The sandbox itself: :mod:`tidal.exec.sandbox`; every setting and what it
guards against: docs/control.md, Isolation.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.contract import LAUNCH_FILE, PROGRESS_DIRNAME, RAY_AUTH_TOKEN_ENV, attempt_dirname
from tidal.exec.cgroups import MIN_MEMORY_BYTES
from tidal.exec.files import read_json
from tidal.exec.sandbox import kernel_fs, named
from tidal.files import open_real, write_atomic

if TYPE_CHECKING:
    from tidal.exec.protocol import LaunchRequest

DEFAULT_PASS_ENV = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
)
log = logging.getLogger(__name__)
UID_SPAN = 1 << 16  # uids uid_base .. uid_base + UID_SPAN - 1
DEFAULT_UID_BASE = 200000  # a sandboxing plane run as root runs jobs as uids from here unless told
PLANE_RANGES = 4096  # ... in one of this many ranges of UID_SPAN uids, chosen by its jobs dir
AUTO = "auto"
MODES = ("sandbox", "none")


@dataclass(frozen=True)
class IsolationConfig:
    """See the module docstring. ``shm_dir``: where jobs' shared-memory directories go (default
    ``/dev/shm/tidal-jobs-<hash of the jobs dir>``; ``None`` when there is no ``/dev/shm``)."""

    mode: str = "sandbox"
    read_only: tuple[str, ...] = ()
    uid_base: int | None = None
    per: str = "tenant"
    pass_env: tuple[str, ...] = DEFAULT_PASS_ENV
    shm_dir: str | None = None
    shm_retention_s: float = 3600.0
    max_file_bytes: int | str | None = AUTO
    max_log_bytes: int | None = 64 << 20
    max_procs: int | None = 4096
    max_memory_bytes: int | str | None = AUTO
    ray_open_cluster: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"isolation.mode must be one of {list(MODES)}, got {self.mode!r}")
        if not all(isinstance(p, str) and os.path.isabs(p) for p in self.read_only):
            raise ValueError(f"isolation.read_only must be a list of absolute paths, got {self.read_only!r}")
        if self.uid_base is not None and (not isinstance(self.uid_base, int) or self.uid_base < 1000):
            raise ValueError(f"isolation.uid_base must be an integer >= 1000, got {self.uid_base!r}")
        if self.per not in ("tenant", "job"):
            raise ValueError(f"isolation.per must be 'tenant' or 'job', got {self.per!r}")
        if not isinstance(self.shm_retention_s, int | float) or self.shm_retention_s < 0:
            raise ValueError(f"isolation.shm_retention_s must be seconds >= 0, got {self.shm_retention_s!r}")
        for k in ("max_file_bytes", "max_log_bytes", "max_procs"):
            v = getattr(self, k)
            auto = k == "max_file_bytes" and v == AUTO
            if v is not None and not auto and (not isinstance(v, int) or v < 1):
                raise ValueError(f"isolation.{k} must be a positive integer or null, got {v!r}")
        if not isinstance(self.ray_open_cluster, bool):
            got = self.ray_open_cluster
            raise ValueError(f"isolation.ray_open_cluster must be true or false, got {got!r}")
        if RAY_AUTH_TOKEN_ENV in self.pass_env:
            raise ValueError(f"isolation.pass_env: {RAY_AUTH_TOKEN_ENV} would hand every job the Ray "
                             "cluster's token (with it a job runs code as the Ray workers' user)")
        m = self.max_memory_bytes
        if m not in (None, AUTO) and (not isinstance(m, int) or isinstance(m, bool) or m < MIN_MEMORY_BYTES):
            raise ValueError(
                f"isolation.max_memory_bytes must be an integer >= {MIN_MEMORY_BYTES} (64 MiB), auto or "
                f"null, got {m!r}"
            )

    @property
    def sandboxed(self) -> bool:
        return self.mode == "sandbox"

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str | None, where: str = "config") -> IsolationConfig:
        d = {"mode": "none"} if d == "none" else {} if d is None else d
        if not isinstance(d, dict):
            raise ValueError(f"{where}: isolation must be a mapping of settings or 'none', got {d!r}")
        d = dict(d)
        names = {f.name for f in fields(cls)}
        for k in d:
            if k not in names:
                raise ValueError(f"{where}: unknown field isolation.{k} (expected one of {sorted(names)})")
        if "pass_env" in d:
            if not isinstance(d["pass_env"], list | tuple) or not all(
                isinstance(x, str) for x in d["pass_env"]
            ):
                raise ValueError(f"{where}: isolation.pass_env must be a list of variable names")
            d["pass_env"] = tuple(d["pass_env"])
        if "read_only" in d:
            if not isinstance(d["read_only"], list | tuple):
                raise ValueError(f"{where}: isolation.read_only must be a list of absolute paths")
            d["read_only"] = tuple(d["read_only"])
        return cls(**d)

    def resolved(self, jobs_root: Path, euid: int | None = None, *, uids: bool = True) -> IsolationConfig:
        """This config with its defaults made concrete for a plane whose jobs live in ``jobs_root``: the
        uid base (sandboxed as root: one of :data:`PLANE_RANGES` ranges of :data:`UID_SPAN` uids from
        :data:`DEFAULT_UID_BASE`, chosen by the jobs dir, so two planes on one machine share no uid: a
        plane ends what a uid of its own left), ``max_file_bytes: auto`` (half the size of
        the file system of ``jobs_root``: a rank's log or a runaway file cannot fill it).
        ``max_memory_bytes: auto`` stays for the executor (it depends on the memory cgroups it finds:
        :func:`auto_memory_bytes`). ``uids=False``: no default uid base (ranks run as this user)."""
        root = (os.geteuid() if euid is None else euid) == 0
        base = self.uid_base
        if base is None and root and self.sandboxed and uids:
            n = int(hashlib.sha1(str(jobs_root.resolve()).encode()).hexdigest()[:8], 16) % PLANE_RANGES
            base = DEFAULT_UID_BASE + UID_SPAN * n
        fsize = self.max_file_bytes
        if fsize == AUTO:
            st = os.statvfs(jobs_root)
            fsize = max(1 << 30, st.f_blocks * st.f_frsize // 2)
        return replace(self, uid_base=base, max_file_bytes=fsize)


def auto_memory_bytes() -> int:
    """``max_memory_bytes: auto``: 90% of this machine's memory, so one rank cannot starve the plane."""
    return max(MIN_MEMORY_BYTES, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 9 // 10)


@dataclass
class Uids:
    """Stable uids for tenants (or jobs): ``uid_base + n``, n allocated in order and kept in ``path``
    (0600), so a tenant keeps its uid across restarts and owns its files from earlier attempts."""

    path: Path
    base: int
    _map: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
            self._map = {str(k): int(v) for k, v in doc.items()} if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            self._map = {}

    def uid(self, key: str) -> int:
        if key not in self._map:
            n = max(self._map.values(), default=-1) + 1
            if n >= UID_SPAN:
                raise RuntimeError(f"isolation: no uids left in {self.base}..{self.base + UID_SPAN - 1}")
            self._map[key] = n
            write_atomic(self.path, json.dumps(self._map))
        return self.base + self._map[key]

    def known(self, key: str) -> int | None:
        """The uid of ``key`` (a job id, or ``tenant:<name>``) if one was allocated; allocates none."""
        return self.base + self._map[key] if key in self._map else None

    def owner(self, per: str, job_id: str, tenant: str | None) -> tuple[int, int]:
        """The uid and gid a job's ranks run as: its tenant's (``per: tenant``, if it has one) or its own."""
        uid = self.uid(job_id if per == "job" or not tenant else f"tenant:{tenant}")
        return uid, uid


def ran_as(uids: Uids | None, jobs: Iterable[tuple[str, Path]]) -> tuple[int, ...]:
    """The uids ended jobs ``(job id, job directory)`` ran as: each one's own uid (``per: job``) if it was
    given one, and the owners its attempts' ``launch.json`` recorded (``per: tenant``: its tenant's)."""
    if uids is None:
        return ()
    out = set()
    for job_id, d in jobs:
        if (uid := uids.known(job_id)) is not None:
            out.add(uid)
        for launch in sorted(d.glob(f"{attempt_dirname('*')}/{LAUNCH_FILE}")):
            o = recorded_owner(read_json(launch) or {})
            if o is not None:
                out.add(o[0])
    return tuple(sorted(out))


def recorded_owner(launch: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ranks' uid and gid as an attempt's ``launch.json`` records them (``owner``), or None."""
    o = launch.get("owner")
    return (int(o[0]), int(o[1])) if isinstance(o, list) and len(o) == 2 else None


def require_root(iso: IsolationConfig) -> None:
    """``ValueError`` in one line when ``uid_base`` is set and this process, which chowns, is not root."""
    if iso.uid_base is not None and os.geteuid() != 0:
        raise ValueError(f"isolation.uid_base {iso.uid_base}: running jobs as their own uid needs root "
                         f"(tidal up runs as uid {os.geteuid()}); remove uid_base")


def check_reachable(*dirs: Path) -> None:
    """``ValueError`` in one line when a parent of one of ``dirs`` is not searchable by others: the jobs'
    uids could not reach their own directories there."""
    for d in dirs:
        closed = [p for p in d.parents if not os.stat(p).st_mode & 0o001]
        if closed:
            raise ValueError(
                f"isolation.uid_base: jobs' uids cannot reach {d}: {closed[0]} is not "
                f"searchable by others (mode {oct(os.stat(closed[0]).st_mode & 0o777)}); "
                "choose a state dir (and shm_dir) under world-searchable directories"
            )


def prepare_attempt(root: Path, job_dir: Callable[[str], Path], attempt_dir: Path, home: Path,
                    req: LaunchRequest, owner: tuple[int, int] | None, uids: Uids | None,
                    hidden: Collection[str] | None = None) -> None:
    """Before an attempt's ranks start, on either executor: sandboxed (``hidden``: what no rank sees), the
    directories the job names elsewhere (:func:`make_dirs`; ``OSError`` for one on a kernel filesystem); the
    job's directories (:func:`make_job_dirs`, with what it takes over from the ended jobs it resumes,
    :func:`ran_as`), then the fence of its checkpoint location, which is this attempt's from now on
    (:mod:`tidal.ckpt.fence`)."""
    from tidal.ckpt.fence import fence_launch

    if hidden is not None:
        cwd = req.workdir or str(home)
        dirs = named(req.env, cwd, hidden)
        for p in dirs:  # the host's /proc, /dev, /sys (or / above them) in a sandbox: its processes, devices
            if os.path.exists(p) and (k := kernel_fs(os.path.realpath(p))):
                raise OSError(f"{p} is on or holds a kernel filesystem ({k}), never bound into a sandbox")
        make_dirs([p for p in dirs if p != cwd], owner)
    make_job_dirs(root, job_dir(req.job_id), attempt_dir, home, req.own_dirs, owner, req.take_over,
                  ran_as(uids, ((j, job_dir(j)) for j in req.take_over_from)), hidden is not None)
    fence_launch(req.env, req.job_id, req.attempt, req.workdir or home)


def make_dirs(paths: Iterable[str], owner: tuple[int, int] | None) -> None:
    """Make the directories a job named that are not there yet (its checkpoint directories; one not there
    cannot be bound), 0700, owned by its uid (``owner``) like the rest of its own; ``OSError`` for a path
    whose existing part goes through a symbolic link (the plane follows none for a job)."""
    for p in paths:
        path = Path(p)
        missing = [q for q in (path, *path.parents) if not os.path.lexists(q)]
        if not missing or not path.is_absolute():
            continue
        base = missing[-1].parent
        fd = open_real(base)  # made below through descriptors: a link swapped in meanwhile changes nothing
        if fd is None or os.readlink(f"/proc/self/fd/{fd}") != str(base):
            if fd is not None:
                os.close(fd)
            raise OSError(f"{p}: {base} is reached through a symbolic link (refused)")
        try:
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d.name, 0o700, dir_fd=fd)
                nxt = os.open(d.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
                if owner is not None:
                    os.fchown(fd, *owner)
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def make_job_dirs(root: Path, job_dir: Path, attempt_dir: Path, home: Path, own_dirs: Iterable[str],
                  owner: tuple[int, int] | None, take_over: Iterable[str] = (),
                  take_over_from: Iterable[int] = (), sandboxed: bool = False) -> None:
    """A job's directories in the state dir (``root``'s parent): the plane's (job, attempt) 0711 with uids
    (passed through, never listed) else 0700, logs 0700; the job's own (``progress/``, ``home``,
    ``home/tmp``, new ``own_dirs`` in the state dir) 0700, owned by its uid. With uids, what
    ``take_over_from`` own in ``take_over`` becomes the job's (:func:`tidal.exec.handover.hand_over`;
    ``HandOverError``). ``sandboxed``: the uid reaches its directories through its sandbox's binds, so
    only the attempt directory (bound read-only, its progress directory below it) stays 0711."""
    mode = 0o711 if owner is not None and not sandboxed else 0o700
    private_dir(job_dir, mode)
    private_dir(job_dir / "logs", 0o700)
    private_dir(attempt_dir, 0o711 if owner is not None else 0o700)
    private_dir(attempt_dir / PROGRESS_DIRNAME, 0o700, owner)
    private_dir(home, 0o700, owner)
    private_dir(home / "tmp", 0o700, owner)
    state = root.resolve().parent
    for d in own_dirs:
        p = Path(d).resolve()
        if p.is_relative_to(state) and p != state and not p.exists():
            for parent in reversed([q for q in p.parents if q.is_relative_to(state) and q != state]):
                private_dir(parent, mode)  # e.g. tenants/ and tenants/<tenant>/: root's, passed through
            private_dir(p, 0o700, owner)
    if owner is not None:
        from tidal.exec.handover import hand_over

        for d in take_over:
            got = hand_over(Path(d), take_over_from, owner)
            if got.skipped:
                log.warning("checkpoint location %r handed over to uid %d (%d entries); left as they "
                            "were: %s", d, owner[0], got.moved, "; ".join(got.skipped[:5])
                            + (f"; ... ({len(got.skipped)} in all)" if len(got.skipped) > 5 else ""))


def rank_rlimits(iso: IsolationConfig, owner: tuple[int, int] | None) -> dict[str, int]:
    """The limits a rank runs under (:data:`tidal.exec.shim.RLIMITS`): no core dumps, the configured caps."""
    out = {"core": 0}
    if isinstance(iso.max_file_bytes, int):
        out["fsize"] = iso.max_file_bytes
    if owner is not None and iso.max_procs is not None:
        out["nproc"] = iso.max_procs
    return out


def clean_env(iso: IsolationConfig, home: Path, job_env: Mapping[str, str], platform: Mapping[str, str], *,
              omp_threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A rank's whole environment, later wins: the names in ``iso.pass_env`` found here, ``HOME``,
    ``TMPDIR`` (in ``home``) and ``OMP_NUM_THREADS``, ``base`` (an executor's defaults), the job's ``env``,
    ``platform``."""
    env = {k: os.environ[k] for k in iso.pass_env if k in os.environ}
    env.setdefault("PATH", os.defpath)
    env.update({"HOME": str(home), "TMPDIR": str(home / "tmp"), "USER": "tidal", "LOGNAME": "tidal",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, omp_threads))})
    env.update(base or {})
    env.update(job_env)
    env.update(platform)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def default_shm_dir(jobs_root: Path) -> str | None:
    """``/dev/shm/tidal-jobs-<12 hex of the jobs dir>`` (one per control plane), or None without /dev/shm."""
    if not Path("/dev/shm").is_dir():
        return None
    return f"/dev/shm/tidal-jobs-{hashlib.sha1(str(jobs_root.resolve()).encode()).hexdigest()[:12]}"


def private_dir(path: Path, mode: int = 0o700, owner: tuple[int, int] | None = None) -> Path:
    """Create ``path`` (and missing parents, 0700) if needed; set its mode and, as root, its owner.
    Refuses a symlink at ``path`` (a job may not redirect the plane's chown elsewhere)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:  # through one descriptor: a job swapping in a symbolic link after a check gets nothing changed
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise OSError(f"{path}: not a directory (refused)") from None
        raise
    try:
        st = os.fstat(fd)
        if owner is None and st.st_uid != os.geteuid():
            raise OSError(f"{path}: owned by uid {st.st_uid}, not by this process (refused)")
        if owner is not None and (st.st_uid, st.st_gid) != owner:
            os.fchown(fd, *owner)
        if st.st_mode & 0o7777 != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path

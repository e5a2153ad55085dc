"""``tidal up``: the API, the reconcile loop and the executor in one process.

The loop runs in a thread, calling ``Controller.step(time.time())`` every ``loop_interval_s``; the API runs
under uvicorn in the main thread. Workers outlive the plane: stopping ``tidal up`` leaves jobs running and the
next one re-adopts them. With ``serving:`` the step also plans loans: it advises without ``serving.nodes``
(:class:`~tidal.serving.watch.Advisor`) and lends with them (:mod:`tidal.control.loans`; the local executor
gets the serving nodes as virtual nodes).
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.control.api import ApiContext, create_app
from tidal.control.auth import ADMIN_TOKEN_FILE, ensure_admin
from tidal.control.client import API_URL_FILE
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.dashboard import dashboard_url
from tidal.control.limits import SubmitLimits
from tidal.control.loans import DOC_KEY as LOANS_DOC
from tidal.control.loans import LiveLoans, build_live_loans
from tidal.control.locations import TENANTS_DIRNAME, LocationPolicy
from tidal.control.serving_nodes import lent_before
from tidal.control.store import Store, sqlite_path, sqlite_url
from tidal.exec.isolation import IsolationConfig
from tidal.exec.local import LocalExecutor, detect_gpus
from tidal.files import write_atomic

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tidal.exec.ray_exec import RayExecutor
    from tidal.exec.virtual import VirtualExecutor
from tidal.serving.sources import DEMAND_WAIT_S
from tidal.serving.watch import Advisor, build_advisor

log = logging.getLogger("tidal.control")


class HeapKeeper:
    """Keeps Python's cycle collector out of the reconcile step. The plane's heap is mostly long-lived (each
    active job's row and scheduler view: ~10^6 objects at 20,000 jobs), and Python collects all of it whenever
    a quarter more has survived: ~0.3 s, in whichever step or request allocates then. Instead, between steps,
    at most every ``every_s`` (and ``min_steps`` steps): what was made since the last keep is collected and
    what survived frozen (:func:`gc.freeze`), so a step's own collections scan only what was made since; every
    ``full_every``-th keep unfreezes and collects the whole heap first, which frees garbage cycles among
    frozen objects (a job's rows after it ended). Within a step, a young collection every ``young`` net
    allocations (Python's default: 700): a step makes a few large containers (its reasons for every waiting
    job, its published view) that each young collection while they live walks again; at the target load the
    default made ~40 young collections a step. Set for the process when the keeper is made."""

    def __init__(self, every_s: float = 60.0, min_steps: int = 10, full_every: int = 10,
                 young: int = 20_000) -> None:
        self.every_s, self.min_steps, self.full_every = every_s, min_steps, full_every
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], young), *threshold[1:])
        self._last_s: float | None = None
        self._steps = 0
        self._keeps = 0
        self.pauses_s: list[float] = []  # each keep's duration (between steps)

    def after_step(self, now_s: float) -> None:
        self._steps += 1
        if self._last_s is not None and (now_s - self._last_s < self.every_s or self._steps < self.min_steps):
            return
        t = time.perf_counter()
        if self._keeps % self.full_every == 0:
            gc.unfreeze()
        gc.collect()
        gc.freeze()
        self._keeps += 1
        self.pauses_s.append(time.perf_counter() - t)
        self._last_s, self._steps = now_s, 0


class ReconcileLoop(threading.Thread):
    """Steps the controller on the wall clock until ``stop()``; an exception in a step is logged, not
    fatal. The heap is kept between steps (:class:`HeapKeeper`); after each, the parts of the API's answers
    asked for lately are built in the view it published (:meth:`tidal.control.read_view.Published.warm`)."""

    def __init__(self, controller: Controller, interval_s: float) -> None:
        super().__init__(name="tidal-reconcile", daemon=True)
        self.controller, self.interval_s = controller, interval_s
        self._stop_event = threading.Event()
        self.steps = 0
        self.heap = HeapKeeper()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.controller.step(time.time())
            except Exception:
                log.exception("reconcile step failed")
            self.steps += 1
            self.heap.after_step(time.time())
            if self.controller.published is not None:  # the parts of answers asked for lately, built now
                try:
                    self.controller.published.warm()
                except Exception:
                    log.exception("building the published view's answers failed")
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()


@dataclass
class Plane:
    """Everything ``tidal up`` runs, built but not started (tests may build one to drive it)."""

    state_dir: Path
    store: Store
    executor: LocalExecutor | RayExecutor | VirtualExecutor
    controller: Controller
    admin_token: str
    token_created: bool
    describe: str
    own_agents: bool = False  # the executor runs a checkpoint agent per node (Ray, --ckpt-agents)

    def app(self) -> FastAPI:
        ctl, cfg = self.controller, self.controller.config
        # the serving side: (its advisor when it only advises, else None; its source described)
        serving: tuple[Advisor | None, str] | None = (
            (ctl.advisor, cfg.serving.describe()) if cfg.serving is not None else None)
        policy = LocationPolicy(self.state_dir / TENANTS_DIRNAME, cfg.checkpoint_grants,
                                cfg.checkpoint_endpoints, cfg.checkpoint_max_timeout_s,
                                own_agents=self.own_agents, quota_bytes=cfg.checkpoint_quota_bytes)
        ctx = ApiContext(self.store, ctl.nodes, self.executor.log_path, time.time, ckpt_root=ctl.ckpt_root,
                         serving=serving, loans=ctl.loans, locations=policy,
                         job_dir=getattr(self.executor, "job_dir", None),
                         warning=isolation_warning(cfg, executor=self.executor),
                         shm_dir=self.executor.shm_dir if isinstance(self.executor, LocalExecutor) else None,
                         log_owner=os.geteuid() if isinstance(self.executor, LocalExecutor) else None,
                         limits=SubmitLimits(cfg.submit_rate_per_s, cfg.submit_burst, cfg.max_queued_jobs),
                         view=ctl.published)
        return create_app(ctx)


def limits_warning(config: ControlConfig) -> str | None:
    """What ``tidal up`` says when a tenant's submissions are not limited (``submit_rate_per_s`` or
    ``max_queued_jobs`` set to 0), else None."""
    off = [k for k in ("submit_rate_per_s", "max_queued_jobs") if not getattr(config, k)]
    if not off:
        return None
    said = ", ".join(f"{k}: 0" for k in off)
    return (f"warning: submission limits are off ({said}): one tenant's burst of jobs is stored whole and "
            "slows the plane for every tenant")


def isolation_warning(config: ControlConfig | None, euid: int | None = None,
                      executor: object = None) -> str | None:
    """One line when isolation is weaker than the default: jobs not sandboxed (``isolation: none``), saying
    what they can reach (as root without ``uid_base``: every file); on Ray, sandboxed jobs on a cluster
    without token authentication, or all tenants as the workers' one uid (workers not root); else None."""
    iso = config.isolation if config is not None else None
    ray = hasattr(executor, "token_auth")  # the Ray executor: whether its cluster authenticates clients
    if ray and (iso is None or iso.sandboxed) and not getattr(executor, "token_auth", True):
        from tidal.exec.ray_checks import open_cluster_warning

        return open_cluster_warning()
    if ray and getattr(executor, "uids", None) is None and (iso is None or iso.sandboxed):
        return ("warning: on Ray without uids every tenant's ranks run as the Ray workers' user (each in its "
                "sandbox); run the Ray workers and tidal up as root to run each tenant as its own uid "
                "(docs/control.md, Isolation on Ray)")
    if iso is None or iso.sandboxed:
        return None
    root = (os.geteuid() if euid is None else euid) == 0
    who = ("as their own uids" if iso.uid_base is not None else
           "as root and can read the state dir (admin token, database) and other jobs' files" if root else
           "as tidal up's user and can read the state dir (admin token, database) and other jobs' files")
    return (f"warning: isolation is off (isolation: {{mode: none}}): jobs run unsandboxed {who}, and see "
            "every process of the machine; remove it to sandbox each rank (docs/control.md, Isolation)")


def secure_state_dir(state_dir: Path, config: ControlConfig | None) -> None:
    """The state dir 0700 (0711 when jobs run unsandboxed as their own uids: they pass through to their own
    directories, never list or read anything else); its files 0600 (``tidal up`` runs with umask 077)."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    iso = config.isolation if config is not None else None
    through = iso is not None and iso.uid_base is not None and not iso.sandboxed
    os.chmod(state_dir, 0o711 if through else 0o700)
    for name in ("tidal.db", "tidal.db-journal", "tidal.db-wal", "tidal.db-shm", ADMIN_TOKEN_FILE,
                 API_URL_FILE):
        p = state_dir / name
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o600)


def build(state_dir: Path, gpus: str = "auto", db: str | None = None, config: ControlConfig | None = None, *,
          executor: str = "local", ray_address: str | None = None, ckpt_agents: bool = False) -> Plane:
    if executor not in ("local", "ray") and not executor.startswith("virtual:"):
        raise SystemExit("tidal up: --executor must be 'local', 'ray' or 'virtual:NODESxGPUS', got "
                         f"{executor!r}")
    if ray_address is not None and executor != "ray":
        raise SystemExit("tidal up: --ray-address needs --executor ray")
    if ckpt_agents and executor != "ray":
        raise SystemExit(
            "tidal up: --ckpt-agents needs --executor ray (on one machine run `tidal ckpt agent`)"
        )
    state_dir = Path(state_dir).resolve()
    secure_state_dir(state_dir, config)
    loans = None
    if config is not None and config.serving is not None and config.serving.lends:
        try:
            loans = build_live_loans(config.serving, workdir=state_dir / "engine")
        except (OSError, ValueError) as e:
            raise SystemExit(f"tidal up: serving: {e}") from None
        # nothing starts on a loan about to end: the scheduler's horizon is the plan's shortest loan
        config = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, min_loan_left_s=loans.timing.min_loan_window_s))
    store = open_checked(state_dir, db or sqlite_url(str(state_dir / "tidal.db")))
    token, created = ensure_admin(store, state_dir, time.time())
    secure_state_dir(state_dir, config)  # the database as created
    iso = config.isolation if config is not None else None
    try:  # the store closes with any refusal
        ex: LocalExecutor | RayExecutor | VirtualExecutor
        if executor == "ray":
            ex, what = _ray_executor(state_dir, gpus, store, iso, loans, ray_address, ckpt_agents)
        elif executor.startswith("virtual:"):
            ex, what = _virtual_executor(state_dir, executor, loans)
        else:
            ex, what = _local_executor(state_dir, gpus, config, loans)
        try:
            advisor, more = _serving(config, loans)
            controller = Controller(store, ex, config, ckpt_root=state_dir / "jobs", loans=loans,
                                    advisor=advisor, publish=True)
        except (ValueError, SystemExit):
            ex.close()  # the local executor is no longer the subreaper of anything (a caller may go on)
            raise
        return Plane(state_dir, store, ex, controller, token, created, what + more, own_agents=ckpt_agents)
    except (ValueError, SystemExit) as e:
        store.close()
        if isinstance(e, SystemExit):
            raise
        raise SystemExit(f"tidal up: {e}") from None


def _local_executor(state_dir: Path, gpus: str, config: ControlConfig | None,
                    loans: LiveLoans | None) -> tuple[LocalExecutor, str]:
    """The local executor on this machine's NVIDIA GPUs (``gpus="auto"``) or N CPU slots, and its line."""
    if loans is not None and config is not None and config.serving is not None \
            and config.serving.adapter == "ray-serve":
        raise SystemExit("tidal up: serving.adapter ray-serve lends the GPUs of Ray nodes: it needs "
                         "--executor ray")
    ids, n = None, None
    if gpus == "auto":
        ids = detect_gpus()
        if not ids:
            raise SystemExit("tidal up: no NVIDIA GPUs found (nvidia-smi); on a machine without GPUs declare "
                             "CPU slots with --gpus N")
        what = f"{len(ids)} GPUs ({','.join(map(str, ids))})"
    else:
        try:
            n = int(gpus)
        except ValueError:
            raise SystemExit(f"tidal up: --gpus must be 'auto' or a number of CPU slots, got {gpus!r}") \
                from None
        if n < 1:
            raise SystemExit(f"tidal up: --gpus must be >= 1, got {n}")
        what = f"{n} CPU slots"
    return LocalExecutor(state_dir / "jobs", slots=n, gpu_ids=ids,
                         serving_nodes=loans.nodes if loans is not None else {},
                         isolation=config.isolation if config is not None else None, subreaper=True,
                         hidden=[state_dir]), what


def _virtual_executor(state_dir: Path, executor: str, loans: LiveLoans | None) -> tuple[VirtualExecutor, str]:
    """Fake nodes and ranks (``virtual:NODESxGPUS``), journalled in the state dir, and their line."""
    from tidal.exec.virtual import VirtualExecutor, parse_shape

    nodes, gpus = parse_shape(executor.split(":", 1)[1])
    ex = VirtualExecutor(nodes, gpus, serving=loans.nodes if loans is not None else None,
                         journal=state_dir / "virtual.jsonl")
    return ex, f"virtual executor: {nodes} nodes x {gpus} GPUs, no process per rank"


def _serving(config: ControlConfig | None, loans: LiveLoans | None) -> tuple[Advisor | None, str]:
    """The advisor (a ``serving:`` block without nodes) and what to say of the serving side."""
    if config is None or config.serving is None:
        return None, ""
    if loans is not None:
        return None, (
            f"; lending serving nodes {', '.join(f'{k} ({g} GPUs)' for k, g in loans.nodes.items())}, "
            f"demand from {config.serving.describe()}")
    try:
        adv = build_advisor(config.serving, wait_s=DEMAND_WAIT_S)
    except (OSError, ValueError) as e:
        raise SystemExit(f"tidal up: serving: {e}") from None
    return adv, (f"; serving {config.serving.serving_gpus} GPUs, plan from {config.serving.describe()}")


def _ray_executor(state_dir: Path, gpus: str, store: Store, iso: IsolationConfig | None,
                  loans: LiveLoans | None, address: str | None, agents: bool) -> tuple[RayExecutor, str]:
    """The Ray executor on the cluster at ``address`` (None: a local Ray it starts), and its line."""
    from tidal.exec.ray_exec import RayExecutor

    num_gpus = None
    if gpus != "auto":
        try:
            num_gpus = int(gpus)
        except ValueError:
            raise SystemExit(f"tidal up: --gpus must be 'auto' or a number of GPUs, got {gpus!r}") from None
        if address is not None:
            raise SystemExit("tidal up: --gpus N declares the GPUs of a Ray that tidal up starts; with "
                             "--ray-address the cluster's nodes say how many they have")
    executor = RayExecutor(state_dir / "jobs", address=address, num_gpus=num_gpus, isolation=iso,
                           ckpt_agents=agents, serving_nodes=loans.nodes if loans is not None else None,
                           hidden=[state_dir])
    try:
        # a serving node the cluster lacks: one line now, not a loop failing later (unless the plane lent
        # before with these nodes: then it is a node lost, the loan step's to handle)
        executor.check_serving(tolerate=lent_before(store.get_doc(LOANS_DOC), loans.nodes) if loans else ())
    except ValueError:
        executor.close()
        raise
    nodes = executor.nodes()
    what = f"Ray executor on {address or 'a local Ray'}: {len(nodes)} nodes with GPUs, "
    what += f"{sum(n.gpus for n in nodes)} GPUs"
    return executor, what + (", a checkpoint agent on each" if agents else "")


def open_checked(state_dir: Path, url: str) -> Store:
    """Open the store and check it against the state dir: ``SystemExit`` naming the file when the database is
    missing, unreadable or missing jobs that ``jobs/`` holds (a fresh start would reuse their ids)."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    jobs_dir = state_dir / "jobs"
    dirs = sorted(d.name for d in jobs_dir.iterdir() if d.is_dir()) if jobs_dir.is_dir() else []
    path = sqlite_path(url)
    where = path or url.split("@")[-1]

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")

    if path is not None and not Path(path).exists() and dirs:
        raise SystemExit(
            f"tidal up: the database {path} is missing but {jobs_dir} holds jobs ({some(dirs)}): restore "
            f"the database from a backup, or move {jobs_dir} aside to start afresh")
    try:
        store = Store(url)
        if path is not None:
            with store.engine.connect() as c:
                verdict = c.execute(text("PRAGMA quick_check")).scalar()
            if verdict != "ok":
                store.close()
                raise SQLAlchemyError(f"integrity check: {verdict}")
        known = store.job_ids()
    except SQLAlchemyError as e:
        why = str(getattr(e, "orig", None) or e).splitlines()[0]
        raise SystemExit(
            f"tidal up: cannot read the database {where} ({why}): restore it from a backup, or move "
            f"it aside together with {jobs_dir} to start afresh") from None
    except ValueError as e:  # a newer schema
        raise SystemExit(f"tidal up: {e}") from None
    unknown = [d for d in dirs if d not in known]
    if unknown:
        store.close()
        raise SystemExit(
            f"tidal up: {jobs_dir} holds jobs the database {where} does not know ({some(unknown)}): it is "
            "not the database they ran with; point --db at that one, or move those directories aside")
    return store


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts: a port in use is one clear ``OSError``
    (not uvicorn's bare ``[Errno 98]`` after the plane has started)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise OSError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is already in use (another tidal up? its address is in "
                          f"<state dir>/{API_URL_FILE}); stop it, or choose --port (0: any free port)"
                          ) from None
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def serve(plane: Plane, host: str = "127.0.0.1", port: int = 8470, *, announce=print,
          sock: socket.socket | None = None) -> None:
    """Recover, start the loop, serve until interrupted. Writes ``<state dir>/api.url`` once listening.
    ``sock``: already bound by :func:`bind` (else bound here)."""
    import uvicorn

    sock = sock or bind(host, port)
    plane.controller.recover(time.time())
    loop = ReconcileLoop(plane.controller, plane.controller.config.loop_interval_s)
    server = uvicorn.Server(uvicorn.Config(plane.app(), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="off"))

    def announce_when_up() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if not server.started:
            return
        bound = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://{host}:{bound}"
        path = plane.state_dir / API_URL_FILE
        write_atomic(path, url + "\n")
        if (warning := isolation_warning(plane.controller.config, executor=plane.executor)) is not None:
            announce(warning)
        if (warning := limits_warning(plane.controller.config)) is not None:
            announce(warning)
        announce(f"tidal up: {url} ({plane.describe}); state in {plane.state_dir}")
        announce(
            f"admin token {'created in' if plane.token_created else 'in'} {plane.state_dir / 'admin.token'}"
        )
        announce(f"dashboard: {dashboard_url(url)} (sign in with a tenant's token or the admin's)")

    threading.Thread(target=announce_when_up, name="tidal-announce", daemon=True).start()
    loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
        loop.join(timeout=10)
        if plane.controller.loans is not None:  # an engine's replicas stop with the plane
            close_adapter = getattr(plane.controller.loans.adapter, "close", None)
            if callable(close_adapter):
                close_adapter()
        plane.store.close()
        close = getattr(plane.executor, "close", None)
        if callable(close):
            close()

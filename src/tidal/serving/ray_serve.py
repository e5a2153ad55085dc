"""A Ray Serve deployment as the serving side: :class:`RayServeAdapter` (``serving: {adapter: ray-serve}``;
docs/loaning.md says what it deploys and why).

One Serve application: the router (:class:`tidal.serving.ray_serve_app.Router`) in front of one copy of
the operator's model deployment per serving node, ``<deployment name>-<node>``, placed on that node by
its ``tidal.io/node`` label. Lending lowers a copy's replica count through Serve's external scaler
API after closing the node's router slots; a reclaim raises it, and the node serves again when
:meth:`~RayServeAdapter.ready` sees its replicas ``RUNNING``. No call waits for Serve: each issues
the update and later steps poll. Demand is the router's arrival rate and service time turned into
GPUs by the Erlang C model (:mod:`tidal.serving.requests`). A failed RPC, or the application gone
from ``serve.status()``, makes the next call :meth:`~RayServeAdapter.ensure` it again.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidal.contract import RAY_NODE_LABEL as NODE_LABEL
from tidal.serving.adapters import AdapterError, _Released, parse_nodes
from tidal.serving.requests import RequestModel, number_in
from tidal.serving.serve_history import MAX_HISTORY_DAYS, MeasuredHistory, forecast_history
from tidal.serving.traces import Trace

log = logging.getLogger(__name__)

ADAPTER = "ray-serve"
STATUS_TTL_S = 0.25  # serve.status() is read at most this often
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # all patterns: fullmatch (no trailing newline)
_IMPORT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", re.ASCII)
_PREFIX = re.compile(r"/|(/[A-Za-z0-9._~-]+)+")  # what Serve accepts (no trailing /, no {wildcards})
_HOST = re.compile(r"[A-Za-z0-9.:_-]{1,253}")  # a host name or an IPv4/IPv6 address


@dataclass(frozen=True)
class RayServeSettings:
    """The ``serving:`` block's fields for ``adapter: ray-serve`` (see docs/loaning.md)."""

    app: str
    deployment: str  # import path "module:attribute" of a serve.Deployment
    nodes: dict[str, int]
    latency_target_s: float
    latency_quantile: float = 0.99
    latency_of: str = "queue"
    gpus_per_replica: int = 1
    service_rate_per_replica: float | None = None  # prior for μ until measured
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    route_prefix: str = "/"
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    rate_window_s: float = 30.0
    rate_smoothing_s: float = 0.0  # EWMA time constant of λ and the service time (control-plane s; 0: none)
    min_samples: int = 20
    actions_timeout_s: float = 5.0
    min_replicas: int = 1  # demand never below this many replicas (serving is never lent away whole)
    speedup: float = 1.0  # serving seconds per control-plane second (a compressed day in a demo)
    start_s: float | None = None  # the serving clock at the first call (default: the control plane's time)
    history_days: float = 0.0  # days of the request-rate trace (serving.trace) the forecast learns first

    def __post_init__(self) -> None:
        for name, pattern, what in (
                ("app", _NAME, "must name the Serve application (letters, digits, . _ -)"),
                ("deployment", _IMPORT, "must be an import path module:attribute of a Serve deployment"),
                ("route_prefix", _PREFIX, "must be '/' or a URL path like /llm (letters, digits, . _ ~ -; no "
                                          "trailing /)"),
                ("http_host", _HOST, "must be a host name or IP address")):
            v = getattr(self, name)
            if not isinstance(v, str) or not pattern.fullmatch(v):
                raise ValueError(f"serving.{name} {what}, got {v!r}")
        for n in self.nodes:
            if not isinstance(n, str) or not _NAME.fullmatch(n):
                raise ValueError(f"serving.nodes: {n!r} is not usable as a Ray Serve deployment suffix "
                                 "(letters, digits, . _ -)")
        g = self.gpus_per_replica
        if not number_in(g, 1, whole=True):
            raise ValueError(f"serving.gpus_per_replica must be a whole number >= 1, got {g!r}")
        bad = [n for n, c in self.nodes.items() if c % g]
        if bad:
            raise ValueError(f"serving.nodes: {bad[0]} has {self.nodes[bad[0]]} GPUs, not a multiple of "
                             f"serving.gpus_per_replica ({g})")
        if not isinstance(self.init_kwargs, dict) or not all(isinstance(k, str) for k in self.init_kwargs):
            raise ValueError("serving.init_kwargs must be a mapping of the deployment's constructor "
                             "arguments")
        replicas, mu = sum(self.nodes.values()) // g, self.service_rate_per_replica
        for name, ok, what in (
                ("http_port", number_in(self.http_port, 1, 65535, whole=True), "a port number"),
                ("rate_window_s", number_in(self.rate_window_s, 1, 86400), "a number in [1, 86400]"),
                ("rate_smoothing_s", number_in(self.rate_smoothing_s, 0, 86400), "a number in [0, 86400]"),
                ("actions_timeout_s", number_in(self.actions_timeout_s, 0.1, 600), "a number in [0.1, 600]"),
                ("speedup", number_in(self.speedup, 0, 1e6) and 0 < self.speedup < 1e6, "a number > 0"),
                ("start_s", self.start_s is None or number_in(self.start_s),
                 "a number (seconds on the serving clock)"),
                ("min_replicas", number_in(self.min_replicas, 0, replicas, whole=True),
                 f"a whole number from 0 to the replicas the nodes hold ({replicas})"),
                ("history_days", number_in(self.history_days, 0, MAX_HISTORY_DAYS),
                 f"a number from 0 to {MAX_HISTORY_DAYS:g} (days of serving.trace the forecast learns "
                 "first)"),
                ("service_rate_per_replica", mu is None or number_in(mu, 0) and mu > 0,
                 "a number > 0 (requests/s one replica serves)"),
                ("min_samples", number_in(self.min_samples, 1, whole=True), "a whole number >= 1")):
            if not ok:
                raise ValueError(f"serving.{name} must be {what}, got {getattr(self, name)!r}")
        if self.latency_target_s is None:
            raise ValueError("serving.latency_target_s is required with adapter ray-serve (the SLO demand is "
                             "computed for)")
        # checks the latency settings, naming the field; without a prior, only what no service rate meets
        self.model(self.service_rate_per_replica or 1e12)

    def model(self, service_rate_per_replica: float) -> RequestModel:
        m = RequestModel.from_settings({
            "service_rate_per_replica": service_rate_per_replica, "gpus_per_replica": self.gpus_per_replica,
            "latency_target_s": self.latency_target_s, "latency_quantile": self.latency_quantile,
            "latency_of": self.latency_of})
        assert m is not None
        return m

    @classmethod
    def from_config(cls, cfg: Any) -> RayServeSettings:
        """From a :class:`~tidal.serving.watch.WatchConfig` (its fields of the same names)."""
        if cfg.nodes is None:
            raise ValueError("serving.nodes is required with adapter ray-serve (the Ray nodes, by their "
                             "tidal.io/node label, whose GPUs serve)")
        for name in ("app", "deployment"):
            if getattr(cfg, name) is None:
                raise ValueError(f"serving.{name} is required with adapter ray-serve")
        kw = {name: getattr(cfg, name) for name in (
            "latency_quantile", "latency_of", "gpus_per_replica", "service_rate_per_replica", "init_kwargs",
            "route_prefix", "http_host", "http_port", "rate_window_s", "rate_smoothing_s",
            "actions_timeout_s", "speedup", "start_s", "min_replicas", "history_days")
            if getattr(cfg, name, None) is not None}
        return cls(app=cfg.app, deployment=cfg.deployment, nodes=parse_nodes(cfg.nodes),
                   latency_target_s=cfg.latency_target_s, **kw)


class RayServeAdapter:
    """Lends the GPUs of a Ray Serve application's per-node deployments. ``address``: the Ray cluster to
    join (``None``: ``auto``); ``trace``: request rates of earlier days for :meth:`forecast_history`.
    Nothing touches Ray until the first call that needs it (building the adapter never blocks)."""

    def __init__(self, settings: RayServeSettings, *, address: str | None = None,
                 trace: Trace | None = None) -> None:
        self.s = settings
        self.trace = trace
        self.measured = MeasuredHistory()  # the demand it observed (persisted; tidal.serving.serve_history)
        self.speedup = float(settings.speedup)
        self.origin_s: float | None = None  # control-plane time of serving time start_s
        self.address = address
        self._nodes = dict(settings.nodes)
        self.state = _Released(settings.nodes)
        self.deployed = False
        self.base = ""  # the model deployment's own name (set on deploy/adopt)
        self.last_error: str | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_demand: dict[str, Any] = {}
        self.failures = 0
        self._ewma: tuple[float, float, float, float] | None = None  # serving time, λ, finished, busy s
        self._status: tuple[float, Any] = (-math.inf, None)
        self._router: Any = None
        self._controller: Any = None
        self.concurrency = 1  # the model's max_ongoing_requests: router slots per replica
        self.unsettled: dict[str, str] = {}  # node -> its deployment's status and message, when not HEALTHY

    def nodes(self) -> dict[str, int]:
        return dict(self._nodes)

    def serving_time(self, now_s: float) -> float:
        """``now_s`` in production; with ``speedup``/``start_s`` (a demo's day) the clock runs from
        ``start_s`` at ``speedup`` x from the first call."""
        if self.speedup == 1.0 and self.s.start_s is None:
            return now_s
        if self.origin_s is None:
            self.origin_s = now_s
        start = self.s.start_s if self.s.start_s is not None else self.origin_s
        return start + (now_s - self.origin_s) * self.speedup

    def target(self, node: str) -> int:
        """Replicas ``<deployment>-<node>`` should run: those its unlent GPUs hold (whole replicas)."""
        return (self._nodes[node] - self.state.released[node]) // self.s.gpus_per_replica

    def targets(self) -> dict[str, int]:
        return {n: self.target(n) for n in self._nodes}

    def slots(self, running: Mapping[str, int] | None = None) -> dict[str, int]:
        """Router slots per node: ready replicas (``running``, capped at the target) x concurrency."""
        conc = self.concurrency
        return {n: min(t, running.get(n, 0) if running is not None else t) * conc
                for n, t in self.targets().items()}

    def _ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address or "auto", log_to_driver=False)
        return ray

    def check(self) -> None:
        """``ValueError`` naming ``serving.deployment`` when it does not import as a Serve deployment (at
        ``tidal up``, not at the first loan step)."""
        try:
            self._load_deployment()
        except AdapterError as e:
            raise ValueError(str(e)) from None

    def _load_deployment(self) -> Any:
        from ray import serve

        mod, _, attr = self.s.deployment.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except Exception as e:  # noqa: BLE001 (the operator's module may raise anything at import)
            why = " ".join(str(e).split())[:300]
            raise AdapterError(f"serving.deployment {self.s.deployment!r}: {type(e).__name__}: "
                               f"{why}") from None
        if not isinstance(obj, serve.Deployment):
            raise AdapterError(f"serving.deployment {self.s.deployment!r} is a {type(obj).__name__}, not a "
                               "Serve deployment (a class decorated with @serve.deployment)")
        if obj._deployment_config.autoscaling_config is not None:
            raise AdapterError(
                f"serving.deployment {self.s.deployment!r} has an autoscaling_config: Tidal sets "
                "its replicas per node (remove autoscaling_config; demand comes from the SLO)"
            )
        return obj

    def ensure(self) -> None:
        """Serve running with the application deployed (or adopted), in a few quick RPCs; ``AdapterError``
        saying why not, never another exception (the reconcile loop calls this)."""
        if self.deployed:
            return
        try:
            self._ensure()
        except AdapterError:
            raise
        except Exception as e:  # noqa: BLE001 (Ray and Serve raise many kinds; each is one failed step)
            raise AdapterError(f"deploying Serve application {self.s.app!r}: {type(e).__name__}: "
                               f"{' '.join(str(e).split())[:300]}") from None

    def _ensure(self) -> None:
        ray = self._ray()
        from ray import serve
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        from tidal.serving.ray_serve_app import ROUTER, Router

        dep = self._load_deployment()
        self.base = dep.name
        self.concurrency = max(1, int(dep.max_ongoing_requests or 1))
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            serve.start(proxy_location="HeadOnly",
                        http_options={"host": self.s.http_host, "port": self.s.http_port})
        app = serve.status().applications.get(self.s.app)
        names = {self._dep(n) for n in self._nodes} | {ROUTER}
        if app is not None and set(app.deployments) != names:
            raise AdapterError(f"serving.app {self.s.app!r}: a Serve application of that name runs other "
                               f"deployments ({sorted(app.deployments)}); give another name or delete it")
        if app is None:
            opts = dict(dep.ray_actor_options or {})
            handles = {}
            for n in self._nodes:
                handles[n] = dep.options(
                    name=self._dep(n), num_replicas=self.target(n),
                    ray_actor_options={**opts, "num_gpus": self.s.gpus_per_replica,
                                       "label_selector": {NODE_LABEL: n}}).bind(**self.s.init_kwargs)
            on = {NODE_LABEL: f"in({','.join(sorted(self._nodes))})"}  # never on a training node that is lost
            # @serve.deployment made Router a Deployment; ray's annotations keep the class's type
            router = Router.options(  # type: ignore[attr-defined]
                ray_actor_options={"num_cpus": 0, "label_selector": on}
            ).bind(handles, self.slots(), self.s.rate_window_s)
            serve.run_many([serve.RunTarget(router, name=self.s.app, route_prefix=self.s.route_prefix,
                                            external_scaler_enabled=True)],
                           wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
            log.info("ray-serve: deployed %s (%s per node) on %s", self.s.app, self.base, sorted(self._nodes))
        self._controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        if app is not None:  # adopted after a restart: the counts this plane's loans say (until they are
            for n in self._nodes:  # set, every call tries again)
                self._scale(n, self.target(n))
        self.deployed = True

    def _dep(self, node: str) -> str:
        """The name of ``node``'s copy of the model deployment."""
        return f"{self.base}-{node}"

    def _scale(self, node: str, replicas: int) -> None:
        from ray.serve._private.common import DeploymentID

        ray = self._ray()
        ref = self._controller.update_deployment_replicas.remote(
            DeploymentID(name=self._dep(node), app_name=self.s.app), replicas)
        try:
            ray.get(ref, timeout=self.s.actions_timeout_s)
        except Exception as e:  # noqa: BLE001 (Ray raises many kinds; all mean the scale did not happen)
            self._forget()
            raise AdapterError(f"scaling {self._dep(node)} to {replicas} replicas: "
                               f"{type(e).__name__}: {str(e)[:200]}") from None

    def _sync(self, slots: Mapping[str, int] | None) -> dict[str, Any]:
        from ray import serve

        from tidal.serving.ray_serve_app import ROUTER

        try:
            if self._router is None:  # the application is deployed without waiting: it may not exist yet
                self._router = serve.get_deployment_handle(ROUTER, app_name=self.s.app)
            st = self._router.sync.remote(dict(slots) if slots is not None else None).result(
                timeout_s=self.s.actions_timeout_s)
        except Exception as e:  # noqa: BLE001
            self._forget()
            raise AdapterError(f"the router of {self.s.app}: {type(e).__name__}: {str(e)[:200]}") from None
        self.last_stats = st
        return st

    def _forget(self) -> None:
        """After a failed RPC: the next call checks the application again (:meth:`ensure`: deploys it if
        someone deleted it, refuses one replaced by other deployments, re-applies the replica counts)."""
        self.deployed = False
        self._router = None
        self._status = (-math.inf, None)

    def status(self, fresh: bool = False) -> Any:
        """``serve.status()``'s view of the application (cached for :data:`STATUS_TTL_S`); None if absent."""
        from ray import serve

        t, st = self._status
        if fresh or time.monotonic() - t > STATUS_TTL_S:
            try:
                st = serve.status().applications.get(self.s.app)
            except Exception as e:  # noqa: BLE001
                raise AdapterError(f"serve.status(): {type(e).__name__}: {str(e)[:200]}") from None
            self._status = (time.monotonic(), st)
        return st

    def running(self) -> dict[str, int]:
        """Replicas RUNNING per node (they serve, also while their deployment scales: a node partly lent
        keeps its other replicas' slots); ``unsettled`` says which nodes' deployments are not HEALTHY."""
        app = self.status()
        if app is None and self.deployed:  # deleted under us (serve delete, serve.shutdown): deploy it again
            self._forget()
        out, unsettled = {}, {}
        for n in self._nodes:
            d = app.deployments.get(self._dep(n)) if app is not None else None
            status = "MISSING" if d is None else str(getattr(d.status, "value", d.status))
            if status != "HEALTHY":
                msg = " ".join(str(getattr(d, "message", "") or "").split())[:200]
                unsettled[n] = f"{status}: {msg}" if msg else status
            out[n] = int(d.replica_states.get("RUNNING", 0)) if d is not None else 0
        self.unsettled = unsettled
        return out

    def release(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        self._move("release", node, gpus, lent_after, +1)

    def restore(self, node: str, gpus: int, lent_after: int, now_s: float) -> None:
        self._move("restore", node, gpus, lent_after, -1)

    def _move(self, action: str, node: str, gpus: int, lent_after: int, sign: int) -> None:
        """A release closes the node's router slots first (no new requests to the lent replicas); a
        restore's open in :meth:`ready`, once its replicas run."""
        before = self.state.released.get(node, 0)  # (move() refuses an unknown node)
        self.state.move(node, gpus, lent_after, sign)  # checks the node and the counts
        try:
            self.ensure()
            if action == "release":
                self._sync(self.slots(self._running_or_targets()))
            self._scale(node, self.target(node))
        except AdapterError as e:
            self.state.released[node] = before
            self._fail(f"{action} of {gpus} GPUs on {node}: {e}")
        self.last_error = None

    def ready(self, node: str) -> bool:
        """Every replica ``node`` should run is RUNNING and its deployment HEALTHY; then its router slots
        open."""
        try:
            self.ensure()
            running = self.running()
            if running.get(node, 0) < self.target(node) or node in self.unsettled:
                why = self.unsettled.get(node, "")
                if why.startswith(("UNHEALTHY", "DEPLOY_FAILED")):  # e.g. the constructor raises: say so
                    self.last_error = f"{self._dep(node)}: {why}"
                return False
            self._sync(self.slots(running))
        except AdapterError as e:
            self.failures += 1
            self.last_error = str(e)
            return False
        return True

    def _running_or_targets(self) -> dict[str, int]:
        try:
            return self.running()
        except Exception:  # noqa: BLE001 (status unknown: the targets; the router only closes slots here)
            return self.targets()

    def _fail(self, msg: str) -> None:
        self.failures += 1
        self.last_error = msg
        raise AdapterError(msg)

    def demand_gpus(self, now_s: float) -> float:
        """GPUs the latency target needs at the request rate the router saw (module docstring); NaN when
        unknown."""
        try:
            self.ensure()
            st = self._sync(self.slots(self._running_or_targets()))  # also heals a restarted router's slots
        except AdapterError as e:
            self.failures += 1
            self.last_error = str(e)
            log.warning("serving demand unknown: %s", e)
            return math.nan
        return self.demand_from(st, self.serving_time(now_s))

    def demand_from(self, st: Mapping[str, Any], serving_s: float | None = None) -> float:
        """Demand for one :meth:`Router.sync` answer (see the module docstring); a known one observed at
        serving time ``serving_s`` is kept in :attr:`measured`."""
        window = float(st.get("window_s") or 0.0)
        if window < 1.0:
            return math.nan
        raw = float(st.get("arrivals", 0)) / window
        rate, done, busy_s = self._smooth(raw, int(st.get("completed", 0)),
                                          float(st.get("service_sum_s") or 0.0), serving_s)
        if done >= self.s.min_samples and busy_s > 0:
            mu = self.concurrency * done / busy_s
            source = "measured"
        elif self.s.service_rate_per_replica:
            mu, source = float(self.s.service_rate_per_replica), "configured"
        elif raw == 0 and not st.get("queued"):  # idle (a quiet night): no replica needed, whatever μ is
            mu, source = math.nan, "idle"
        else:
            self.last_demand = {"rate": rate, "service_rate": None, "gpus": None}
            return math.nan
        try:
            gpus = 0.0 if source == "idle" else float(self.s.model(mu).gpus(rate))
        except ValueError as e:  # no number of replicas meets the target (a target below the measured service
            self.last_error = f"demand: {e}; all serving GPUs"  # time's quantile; a flood): serve with all
            gpus = float(sum(self._nodes.values()))
        gpus = max(gpus, float(self.s.min_replicas * self.s.gpus_per_replica))
        self.last_demand = {"rate": round(rate, 3), "service_rate_from": source, "gpus": gpus,
                            "service_rate": None if source == "idle" else round(mu, 3)}
        if serving_s is not None:
            self.measured.add(serving_s, rate, mu if source == "measured" else None, gpus)
        return gpus

    def _smooth(self, rate: float, done: float, busy_s: float,
                serving_s: float | None) -> tuple[float, float, float]:
        """The window's λ, finished requests and their service seconds as moving averages over the calls
        (time constant ``rate_smoothing_s`` of control-plane time): Poisson counts over a short window
        jump between replica counts, noise the policy's margin would pay for in GPUs not lent. As given
        without a smoothing time or a serving time; the first call (or a clock gone back) starts them."""
        tau = self.s.rate_smoothing_s
        if not tau or serving_s is None:
            return rate, done, busy_s
        prev = self._ewma
        if prev is None or serving_s <= prev[0]:
            now = (rate, done, busy_s)
        else:
            a = 1.0 - math.exp(-(serving_s - prev[0]) / self.speedup / tau)
            now = (prev[1] + a * (rate - prev[1]), prev[2] + a * (done - prev[2]),
                   prev[3] + a * (busy_s - prev[3]))
        self._ewma = (serving_s, *now)
        return now

    def forecast_history(self, until_s: float, step_s: float) -> list[tuple[float, float]]:
        """``(serving time, GPUs)`` before ``until_s``: what this adapter measured, else the earlier days'
        trace at the measured (or prior) service rate (:mod:`tidal.serving.serve_history`)."""
        mu = self.measured.service_rate() or self.s.service_rate_per_replica
        model = self.s.model(mu) if mu and self.trace is not None else None
        days = self.s.history_days if self.trace is not None else MAX_HISTORY_DAYS
        return forecast_history(until_s, step_s, days=days, trace=self.trace, model=model,
                                measured=self.measured, max_gpus=float(sum(self._nodes.values())))

    def released(self) -> dict[str, int]:
        return dict(self.state.released)

    def health(self) -> dict[str, Any]:
        st = self.last_stats
        return {"kind": ADAPTER, "app": self.s.app, "deployment": self.base or self.s.deployment,
                "targets": self.targets(), "released": self.released(), "demand": self.last_demand,
                "latency": {k: st.get(k) for k in ("response_p50_s", "response_p99_s", "wait_p99_s")}
                if st else {},
                "failures": self.failures, "last_error": self.last_error}

    def persist(self) -> dict[str, Any]:
        return {"released": self.released(), "origin_s": self.origin_s, "measured": self.measured.to_doc()}

    def resume(self, doc: Mapping[str, Any]) -> None:
        """Continue from :meth:`persist`'s document (``ValueError`` naming a damaged part)."""
        if "measured" in doc:
            self.measured = MeasuredHistory.from_doc(doc["measured"])
        if doc.get("origin_s") is not None:
            self.origin_s = float(doc["origin_s"])
        self.state.resume(doc)

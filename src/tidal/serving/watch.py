"""The loan plan, live, from a demand source: advice for an operator (:class:`Advisor`).

Every ``step_s`` of serving time it reads demand from a :class:`~tidal.serving.sources.DemandSource`,
calls the simulator's :class:`~tidal.policy.loan.TidalPolicy` (as if every lendable GPU were lent) and
reports the plan: GPUs lendable now, and when how many must serve again. It acts on nothing. Drivers:
a phase of ``tidal up``'s reconcile step (:meth:`Advisor.advance`), and ``tidal serving watch``
(:func:`watch`, on the ``clock``/``sleep`` it is given, so a replay runs faster than real time).
Observations fall on the grid of whole steps the forecast's time-of-day slots need; a driver more
than :data:`MAX_CATCH_UP` steps behind skips to the latest point (the skipped ones count as missing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tidal.policy.loan import LoanContext, LoanPlan, LoanTiming, TidalPolicy, TidalState
from tidal.serving.adapters import parse_nodes
from tidal.serving.requests import FIELDS as REQUEST_FIELDS
from tidal.serving.requests import RequestModel, number_in
from tidal.serving.serve_history import MAX_HISTORY_DAYS
from tidal.serving.sources import BackgroundDemand, DemandSource, TraceReplay, client_demand

ADAPTERS = (None, "replay", "hook", "ray-serve", "llama.cpp")  # serving.adapter (None: replay with a trace,
# else hook)
MAX_CATCH_UP = 64  # grid points one advance() observes one by one; beyond that it skips to the latest
RAY_SERVE_FIELDS = ("app", "deployment", "init_kwargs", "route_prefix", "http_host", "http_port",
                    "rate_window_s", "rate_smoothing_s", "min_replicas")


@dataclass(frozen=True)
class Step:
    """One observation and the plan made from it."""

    now_s: float
    demand_gpus: float
    plan: LoanPlan
    z: float
    shortfall_ratio: float

    def as_dict(self) -> dict[str, Any]:
        p = self.plan
        return {"now_s": self.now_s,
                "demand_gpus": None if math.isnan(self.demand_gpus) else round(self.demand_gpus, 3),
                "lendable_gpus": p.lendable_gpus, "reclaim_now_gpus": p.reclaim_now_gpus,
                "reclaims": [{"gpus": r.gpus, "deadline_s": r.deadline_s, "notice_s": r.notice_s}
                             for r in p.reclaims],
                "margin_gpus": round(p.margin_gpus, 3), "lead_time_s": p.lead_time_s, "z": round(self.z, 4),
                "shortfall_ratio_so_far": self.shortfall_ratio}


class Advisor:
    """The loan plan on the grid of whole steps: :meth:`tick` observes and plans when a grid point has
    come and keeps the newest :class:`Step` in ``latest`` (readable from other threads: swapped whole)."""

    def __init__(self, source: DemandSource, policy: TidalPolicy, serving_gpus: int,
                 state: TidalState | None = None, *, speedup: float = 1.0,
                 start_s: float | None = None) -> None:
        if serving_gpus < 1:
            raise ValueError(f"serving_gpus must be >= 1, got {serving_gpus}")
        self.source, self.policy, self.serving_gpus = source, policy, serving_gpus
        self.step_s = policy.config.forecast.step_s
        self.state = state if state is not None else policy.initial_state()
        self.latest: Step | None = None
        t = self.state.forecast.t_s
        self.next_s = t + self.step_s if not math.isnan(t) else math.nan
        self.speedup, self.start_s = float(speedup), start_s
        self.origin_s: float | None = None  # the wall time of the first advance()

    def serving_time(self, now_s: float) -> float:
        """The serving clock at wall time ``now_s``: a replay's time runs ``speedup`` times as fast from
        ``start_s`` at the first call; without ``start_s`` it is the wall time."""
        if self.start_s is None:
            return now_s
        if self.origin_s is None:
            self.origin_s = now_s
        return self.start_s + (now_s - self.origin_s) * self.speedup

    def advance(self, now_s: float) -> int:
        """Observe and plan at every grid point passed by wall time ``now_s`` (more than
        :data:`MAX_CATCH_UP` behind: the latest only); how many plans were made."""
        t = self.serving_time(now_s)
        n = 0
        while n < MAX_CATCH_UP and self.due_in(t) == 0:
            self.tick(self.next_s)  # each grid point at its own time
            n += 1
        if self.due_in(t) == 0:
            self.tick(t)
            n += 1
        return n

    def due_in(self, now_s: float) -> float:
        """Seconds until the next grid point (0: due now)."""
        if math.isnan(self.next_s):
            self.next_s = math.ceil(now_s / self.step_s - 1e-9) * self.step_s
        return max(0.0, self.next_s - now_s)

    def tick(self, now_s: float) -> Step | None:
        """Observe and plan if a grid point has come by ``now_s`` (the latest one, when several have)."""
        if self.due_in(now_s) > 0:
            return None
        grid = self.next_s
        if now_s >= grid + self.step_s:  # late by whole steps: the forecast counts the skipped as missing
            grid += math.floor((now_s - grid) / self.step_s) * self.step_s
        demand = self.source.demand_gpus(grid)
        lent = self.latest.plan.lendable_gpus if self.latest is not None else 0
        ctx = LoanContext(now_s=grid, serving_gpus=self.serving_gpus, demand_gpus=demand, lent_gpus=lent,
                          client_gpus=client_demand(self.source, grid))
        plan, self.state = self.policy(ctx, self.state)
        self.latest = Step(grid, demand, plan, self.state.z, self.state.shortfall_ratio)
        self.next_s = grid + self.step_s
        return self.latest


def watch(source: DemandSource, policy: TidalPolicy, *, serving_gpus: int, clock: Callable[[], float],
          sleep: Callable[[float], None], on_step: Callable[[Step], None], steps: int | None = None,
          state: TidalState | None = None) -> TidalState:
    """Observe, plan and report every ``policy.config.forecast.step_s`` until ``steps`` are done
    (``None``: forever). Returns the policy's state."""
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    adv = Advisor(source, policy, serving_gpus, state)
    done = 0
    while steps is None or done < steps:
        wait = adv.due_in(clock())
        if wait > 0:
            sleep(wait)
            continue
        step = adv.tick(clock())
        if step is not None:
            on_step(step)
            done += 1
    return adv.state


@dataclass(frozen=True)
class WatchConfig:
    """The ``serving:`` block of ``tidal up --config`` (every field in docs/loaning.md): one demand source,
    ``trace`` (a CSV replayed from ``start_s`` at ``speedup``) or ``prometheus`` + ``query`` (x
    ``gpus_per_unit``), and the loan policy's knobs. With ``nodes`` the plane lends those serving nodes'
    GPUs (``serving_gpus`` is their sum) with the timing fields in control-plane seconds; with the
    request fields (:mod:`tidal.serving.requests`) demand is the GPUs that meet the latency target at
    the request rate, not a scaled load."""

    serving_gpus: int | None = None
    trace: str | None = None
    speedup: float = 1.0
    start_s: float | None = None
    prometheus: str | None = None
    query: str | None = None
    gpus_per_unit: float = 1.0
    client_label: str | None = None
    shortfall_budget: float = 0.005
    step_s: float = 600.0
    nodes: Any = None
    actions_url: str | None = None
    actions_command: list[str] | None = None
    actions_timeout_s: float = 5.0
    grace_s: float | None = None
    final_checkpoint_s: float | None = None
    release_s: float | None = None
    warmup_s: float | None = None
    restart_cost_s: float | None = None
    history_days: float = 0.0
    service_rate_per_gpu: float | None = None
    service_rate_per_replica: float | None = None
    gpus_per_replica: int | None = None
    latency_target_s: float | None = None
    latency_quantile: float | None = None
    latency_of: str | None = None
    adapter: str | None = None
    app: str | None = None
    deployment: str | None = None
    init_kwargs: dict | None = None
    route_prefix: str | None = None
    http_host: str | None = None
    http_port: int | None = None
    rate_window_s: float | None = None
    rate_smoothing_s: float | None = None
    min_replicas: int | None = None
    engine: dict | None = None

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise ValueError(f"serving.adapter must be one of {', '.join(a for a in ADAPTERS if a)}, got "
                             f"{self.adapter!r}")
        for name in ("grace_s", "final_checkpoint_s", "release_s", "warmup_s", "restart_cost_s"):
            v = getattr(self, name)
            if v is not None and not number_in(v, 0, 1e9):
                raise ValueError(f"serving.{name} must be a number >= 0, got {v!r}")
        for name in ("speedup", "gpus_per_unit", "step_s"):
            v = getattr(self, name)
            if not number_in(v, 0, 1e9) or v == 0:
                raise ValueError(f"serving.{name} must be a number > 0, got {v!r}")
        if not number_in(self.shortfall_budget, 0, 1) or self.shortfall_budget in (0, 1):
            raise ValueError(f"serving.shortfall_budget must be in (0, 1), got {self.shortfall_budget!r}")
        if not number_in(self.history_days, 0, MAX_HISTORY_DAYS):
            raise ValueError(f"serving.history_days must be a number from 0 to {MAX_HISTORY_DAYS:g} (days "
                             f"the forecast learns before the first live step), got {self.history_days!r}")
        label = self.client_label
        if label is not None and (self.prometheus is None or not isinstance(label, str) or not label.strip()):
            raise ValueError(f"serving.client_label must be a label name (with prometheus), got {label!r}")
        if self.adapter == "ray-serve":
            self._check_ray_serve()
            return
        if self.adapter == "llama.cpp":
            self._check_engine()
            return
        if self.engine is not None:
            raise ValueError("serving.engine applies only to adapter: llama.cpp")
        given = [n for n in RAY_SERVE_FIELDS if getattr(self, n) is not None]
        if given:
            raise ValueError(f"serving.{given[0]} applies only to adapter: ray-serve")
        if self.adapter == "replay" and self.trace is None:
            raise ValueError("serving.trace is required with adapter replay")
        if self.adapter == "hook" and self.prometheus is None:
            raise ValueError("serving.prometheus (and a query) is required with adapter hook")
        if self.nodes is not None:
            self._pool_from_nodes()
            if self.prometheus is not None and (self.actions_url is None) == (self.actions_command is None):
                raise ValueError("serving: lending with prometheus needs exactly one of serving.actions_url "
                                 "or serving.actions_command (how serving releases and takes back GPUs)")
        if not number_in(self.actions_timeout_s, 0, 600) or self.actions_timeout_s == 0:
            raise ValueError(f"serving.actions_timeout_s must be in (0, 600], got {self.actions_timeout_s!r}")
        if not number_in(self.serving_gpus, 1, whole=True):
            raise ValueError(f"serving.serving_gpus must be a whole number >= 1, got {self.serving_gpus!r}")
        if (self.trace is None) == (self.prometheus is None):
            raise ValueError("give exactly one demand source (serving.trace, or serving.prometheus with a "
                             "query)")
        if self.prometheus is not None and not self.query:
            raise ValueError("serving.query is required with serving.prometheus (PromQL giving one number)")
        if self.requests() is not None and self.gpus_per_unit != 1.0:
            raise ValueError("serving.gpus_per_unit does not apply to a request-rate demand (the latency "
                             "target sets the GPUs); leave it out")

    def _check_ray_serve(self) -> None:
        """``adapter: ray-serve``: demand comes from Serve itself (no trace, no query); the adapter's
        settings are checked by building them (errors name the field)."""
        from tidal.serving.ray_serve import RayServeSettings

        for name in ("prometheus", "query", "actions_url", "actions_command", "service_rate_per_gpu"):
            if getattr(self, name) is not None:
                raise ValueError(f"serving.{name} does not apply to adapter ray-serve (demand is the request "
                                 "rate Serve sees; service rate measured, serving.service_rate_per_replica a "
                                 "prior)")
        if self.gpus_per_unit != 1.0:
            raise ValueError("serving.gpus_per_unit does not apply to adapter ray-serve (demand is the SLO's "
                             "GPUs)")
        if (self.trace is None) != (self.history_days == 0):
            raise ValueError("serving.trace and serving.history_days go together with adapter ray-serve: a "
                             "request-rate trace of earlier days and how many days of it the forecast learns "
                             f"first (got trace {self.trace!r}, history_days {self.history_days!r})")
        if self.trace is not None and self.service_rate_per_replica is None:
            raise ValueError("serving.trace with adapter ray-serve needs serving.service_rate_per_replica: "
                             "the service rate its requests/s are read at until Serve has measured one")
        RayServeSettings.from_config(self)
        self._pool_from_nodes()

    def _check_engine(self) -> None:
        """``adapter: llama.cpp``: demand comes from the engines' own metrics; their settings are checked by
        building them (errors name the field)."""
        from tidal.serving.engine_adapter import EngineSettings

        for name in ("prometheus", "query", "actions_url", "actions_command", "service_rate_per_gpu",
                     "service_rate_per_replica", "app", "deployment", "init_kwargs", "route_prefix",
                     "http_host", "http_port", "rate_smoothing_s", "client_label"):
            if getattr(self, name) is not None:
                raise ValueError(f"serving.{name} does not apply to adapter llama.cpp (demand is what the "
                                 "engines' metrics say; the service time is measured)")
        if self.gpus_per_unit != 1.0 or self.gpus_per_replica not in (None, 1):
            raise ValueError("serving.gpus_per_unit and gpus_per_replica do not apply to adapter llama.cpp "
                             "(one replica a GPU)")
        if (self.trace is None) != (self.history_days == 0):
            raise ValueError("serving.trace and serving.history_days go together with adapter llama.cpp: "
                             "earlier days' demand (scaled to the pool) and how many days of it the forecast "
                             f"learns first (got trace {self.trace!r}, history_days {self.history_days!r})")
        EngineSettings.from_config(self)
        self._pool_from_nodes()

    def _pool_from_nodes(self) -> None:
        """``serving_gpus`` set to the GPUs of ``nodes``, or checked against them."""
        try:
            total = sum(parse_nodes(self.nodes).values())
        except ValueError as e:
            raise ValueError(f"serving.nodes: {e}") from None
        if self.serving_gpus is None:
            object.__setattr__(self, "serving_gpus", total)
        elif self.serving_gpus != total:
            raise ValueError(f"serving.serving_gpus ({self.serving_gpus}) must equal the GPUs of "
                             f"serving.nodes ({total})")

    def requests(self) -> RequestModel | None:
        """The request-rate model when its settings are given (``ValueError`` naming a bad one), else None
        (also for ray-serve, whose adapter measures the service rate)."""
        if self.adapter in ("ray-serve", "llama.cpp"):
            return None
        return RequestModel.from_settings({name: getattr(self, name) for name in REQUEST_FIELDS})

    @classmethod
    def from_dict(cls, d: Any, where: str = "serving") -> WatchConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a mapping of settings, got {d!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (expected one of {sorted(names)})")
        if "serving_gpus" not in d and "nodes" not in d:
            raise ValueError(f"{where}: serving_gpus (or nodes, to lend them) is required")
        return cls(**d)

    def source(self) -> DemandSource:
        """The demand source; a replay plays on the trace's own time axis, from ``start_s`` or else from
        its first row (so the forecast's time of day is the trace's)."""
        from tidal.serving.sources import PrometheusQuery, replay_of

        if self.trace is not None:
            return replay_of(self.trace, self.pool_gpus, self.start_s, self.requests())
        return PrometheusQuery(self.prometheus or "", self.query or "", self.gpus_per_unit,
                               requests=self.requests(), client_label=self.client_label)

    @property
    def pool_gpus(self) -> int:
        """The serving GPUs (``serving_gpus``, or the sum of ``nodes``: set by the checks at creation)."""
        if self.serving_gpus is None:
            raise ValueError("serving.serving_gpus (or nodes) is required")
        return self.serving_gpus

    def policy(self) -> TidalPolicy:
        return TidalPolicy.build(self.shortfall_budget, self.step_s)

    @property
    def lends(self) -> bool:
        """The plane lends serving GPUs (not only advice)."""
        return self.nodes is not None

    def timing(self) -> LoanTiming:
        """The plane's loan timing (control-plane seconds); unset fields keep LoanTiming's defaults."""
        kw = {"notice_s": self.grace_s, "final_checkpoint_s": self.final_checkpoint_s,
              "release_s": self.release_s, "warmup_s": self.warmup_s, "restart_cost_s": self.restart_cost_s}
        return LoanTiming(**{k: float(v) for k, v in kw.items() if v is not None})

    def describe(self) -> str:
        if self.adapter == "llama.cpp":
            q = 100 * (self.latency_quantile or 0.99)
            return (f"llama.cpp replicas of {(self.engine or {}).get('model')}, one a GPU: p{q:g} wait for a "
                    f"slot <= {self.latency_target_s:g} s at the rate and service time their metrics show")
        if self.adapter == "ray-serve":
            q = 100 * (self.latency_quantile or 0.99)
            return (f"Ray Serve application {self.app} ({self.deployment} per node): p{q:g} "
                    f"{self.latency_of or 'queue'} time <= {self.latency_target_s:g} s at the request rate "
                    "Serve sees" + (f"; the forecast first learns {self.history_days:g} days of {self.trace}"
                                    if self.trace else ""))
        req = self.requests()
        if self.trace is not None:
            return f"trace {self.trace} replayed at {self.speedup:g}x" + (f"; {req.describe()}" if req
                                                                          else "")
        if req is not None:
            return f"Prometheus {self.prometheus}: {self.query} ({req.describe()})"
        return f"Prometheus {self.prometheus}: {self.query} x {self.gpus_per_unit:g} GPUs"


def start_advisor(cfg: WatchConfig) -> tuple[Advisor, Callable[[], float], float]:
    """(advisor, the clock its policy sees, speedup) for ``cfg``, starting now (a replay on its own axis at
    ``speedup``, Prometheus on Unix time)."""
    advisor = build_advisor(cfg)
    if advisor.start_s is not None:
        t0, m0, speedup = advisor.start_s, time.monotonic(), advisor.speedup

        def clock() -> float:
            return t0 + (time.monotonic() - m0) * speedup

        return advisor, clock, speedup
    return advisor, time.time, 1.0


def build_advisor(cfg: WatchConfig, *, wait_s: float | None = None) -> Advisor:
    """The advisor for ``cfg`` (a replay plays from its start at ``speedup``; Prometheus on Unix time).
    ``wait_s``: the most a call may wait on a server (asked on a thread of its own,
    :class:`~tidal.serving.sources.BackgroundDemand`: the reconcile loop never waits); None: wait for
    the answer (``tidal serving watch``). ``ValueError`` (``OSError``: unreadable trace) naming what."""
    source = cfg.source()
    if isinstance(source, TraceReplay):
        return Advisor(source, cfg.policy(), cfg.pool_gpus, speedup=cfg.speedup, start_s=source.start_s)
    if wait_s is not None:
        source = BackgroundDemand(source, wait_s=wait_s)
    return Advisor(source, cfg.policy(), cfg.pool_gpus)

"""Loan / reclaim plan: how many serving GPUs may be lent now, and when each must be back. Pure.

Every policy has the shape ``plan, state = policy(ctx, state)`` (``state = policy.initial_state()`` at
the start), called once per serving observation, in time order. A policy gives an upper bound on
demand over its horizon; :func:`plan_loans` lends what stays free through one lead time (notice +
final checkpoint + release + warm-up), gives each lent GPU the deadline where the bound needs it back
(its notice one lead time before), and makes new loans only if they can train ``min_loan_window_s``.
:class:`TidalPolicy` is the forecast plus a margin calibrated online to a shortfall budget
(docs/loaning.md); the baselines are in :mod:`tidal.policy.baselines`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from tidal.contract import DEFAULT_GRACE_S
from tidal.model import Reclaim
from tidal.policy import clients as pc
from tidal.policy.budget import ledger_update, max_lendable
from tidal.policy.budget_pacing import loosened, pace_update, promise
from tidal.policy.forecast import Forecast, ForecastConfig, ForecastState, forecast, initial_state, observe
from tidal.policy.forecast_errors import tail_reserve_gpus

EPS = 1e-9
DURATIONS = ("notice_s", "final_checkpoint_s", "release_s", "warmup_s", "restart_cost_s")  # of LoanTiming
HORIZON_S = 6 * 3600.0
"""How far a plan looks ahead by default (seconds): the forecast's default horizon."""


@dataclass(frozen=True)
class LoanTiming:
    """How long taking a loan back takes, and what an interruption costs a spot job. Seconds."""

    notice_s: float = DEFAULT_GRACE_S
    """From the reclaim notice until the spot job must stop (its grace period)."""
    final_checkpoint_s: float = 120.0
    """The job's final checkpoint after it stops stepping."""
    release_s: float = 60.0
    """Tearing the job down and handing the GPUs back."""
    warmup_s: float = 900.0
    """Serving warm-up on the returned GPUs (load weights, compile, capture graphs)."""
    restart_cost_s: float = 300.0
    """What a loan costs the spot job: restore from checkpoint and warm up on the loaned GPUs."""
    min_useful_fraction: float = 0.5
    """A new loan must spend at least this fraction of its window (now .. notice) training."""

    def __post_init__(self) -> None:
        for name in DURATIONS:
            if getattr(self, name) < 0:
                raise ValueError(f"LoanTiming.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_useful_fraction < 1:
            raise ValueError("LoanTiming.min_useful_fraction must be in [0, 1), got "
                             f"{self.min_useful_fraction}")

    @property
    def lead_time_s(self) -> float:
        """From reclaim notice until the GPUs serve again."""
        return self.notice_s + self.final_checkpoint_s + self.release_s + self.warmup_s

    @property
    def min_loan_window_s(self) -> float:
        """Shortest time from lending to notice worth a new loan: ``restart_cost / (1 - useful)``."""
        return self.restart_cost_s / (1.0 - self.min_useful_fraction)

    def horizon_s(self, step_s: float) -> float:
        """How far a plan on a ``step_s`` grid must look ahead: at least a lead time, a window and a step."""
        return max(HORIZON_S, self.lead_time_s + self.min_loan_window_s + step_s)

    def scaled(self, factor: float) -> LoanTiming:
        """Every duration times ``factor`` (a replayed trace's clock running ``factor`` times as fast)."""
        return replace(self, **{name: getattr(self, name) * factor for name in DURATIONS})


@dataclass(frozen=True, eq=False)
class LoanContext:
    """What the caller observed at ``now_s``: ``demand_gpus`` (NaN = no observation), ``lent_gpus`` of
    the pool's ``serving_gpus``; ``future_demand_gpus`` (the oracle only): demand at ``now + k * step_s``;
    ``client_gpus``: the same demand per client (:mod:`tidal.policy.clients`), when the source has it."""

    now_s: float
    serving_gpus: int
    demand_gpus: float
    lent_gpus: int = 0
    future_demand_gpus: np.ndarray | None = None
    client_gpus: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class LoanPlan:
    """The decision of one step: ``lendable_gpus`` may be on loan now; ``reclaims`` say how many of them
    must be back by when, earliest first (those not listed may stay past the horizon);
    ``reclaim_now_gpus`` are on loan beyond ``lendable_gpus``. ``times_s`` / ``upper_gpus``: the upper
    bound the plan was made from, with ``margin_gpus`` inside it at the lead time; ``bound_gpus``: what
    the bound alone would lend, before the budget ledger's cap; ``forecaster``: which made the bound."""

    now_s: float
    lendable_gpus: int
    reclaims: tuple[Reclaim, ...]
    reclaim_now_gpus: int
    times_s: np.ndarray
    upper_gpus: np.ndarray
    margin_gpus: float
    lead_time_s: float
    min_loan_window_s: float
    bound_gpus: int | None = None
    forecaster: str = "aggregate"

    @property
    def reclaim_gpus(self) -> int:
        return sum(r.gpus for r in self.reclaims)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=float).copy()
    a.flags.writeable = False
    return a


def plan_loans(*, now_s: float, serving_gpus: int, lent_gpus: int, demand_now_gpus: float,
               times_s: np.ndarray, upper_gpus: np.ndarray, timing: LoanTiming,
               margin_gpus: float = 0.0, max_lendable_gpus: int | None = None) -> LoanPlan:
    """Turn an upper bound on demand at ``times_s`` (increasing, all > ``now_s``) into a plan (the rule:
    module docstring). ``demand_now_gpus`` may be NaN; ``max_lendable_gpus``: the budget ledger's cap."""
    n = int(serving_gpus)
    if n < 0:
        raise ValueError(f"serving_gpus must be >= 0, got {serving_gpus}")
    times = np.asarray(times_s, dtype=float)
    upper = np.asarray(upper_gpus, dtype=float)
    if times.shape != upper.shape or times.ndim != 1 or times.size == 0:
        raise ValueError(f"times_s and upper_gpus must be 1-D of the same non-zero length, got "
                         f"{times.shape} and {upper.shape}")
    if not times[0] > now_s or (times.size > 1 and not (times[1:] > times[:-1]).all()):
        raise ValueError("times_s must increase and lie after now_s")
    lead = timing.lead_time_s
    bound = upper if np.isfinite(upper).all() else np.nan_to_num(upper, nan=float(n))
    free = np.minimum(np.maximum(np.floor(n - bound + EPS), 0), n).astype(int)  # np.clip, less overhead
    # The rest walks the horizon's few dozen points in plain Python (cheaper than numpy calls at this size).
    running = np.minimum.accumulate(free).tolist()
    tl = times.tolist()
    in_lead = max(bisect.bisect_right(tl, now_s + lead + EPS), 1)
    safe = running[in_lead - 1]
    if not math.isnan(demand_now_gpus):
        safe = min(safe, max(0, int(math.floor(n - demand_now_gpus + EPS))))

    # running is non-increasing: the k-th GPU is due back at the first s with running(s) < k, and is
    # worth a new loan if k <= running at every grid time before now + lead + min window.
    kept = min(max(lent_gpus, 0), safe)
    window = timing.min_loan_window_s - EPS
    early = next((i for i, t in enumerate(tl) if t - lead - now_s >= window), len(tl))  # first late enough
    worthwhile = running[early - 1] if early > 0 else safe
    lendable = by_bound = max(kept, min(safe, worthwhile))
    if max_lendable_gpus is not None:
        lendable = min(lendable, max(0, int(max_lendable_gpus)))
    # GPUs k in (running(s), min(running(s-), lendable)] are due back at s, where running drops.
    after_notice = timing.notice_s + timing.final_checkpoint_s  # from the notice until the jobs are off
    reclaims = tuple(
        Reclaim(gpus=min(a, lendable) - b, by_s=(t - lead) + after_notice, notice_s=t - lead, deadline_s=t)
        for a, b, t in zip(running[:-1], running[1:], tl[1:], strict=True)
        if min(a, lendable) > b
    )
    return LoanPlan(now_s=now_s, lendable_gpus=lendable, reclaims=reclaims,
                    reclaim_now_gpus=max(0, lent_gpus - lendable), times_s=_frozen(times),
                    upper_gpus=_frozen(upper), margin_gpus=float(margin_gpus), lead_time_s=lead,
                    min_loan_window_s=timing.min_loan_window_s, bound_gpus=by_bound)


@dataclass(frozen=True)
class TidalConfig:
    """Knobs of :class:`TidalPolicy`."""

    shortfall_budget: float = 0.005
    """At most this fraction of demanded serving GPU-hours may go unmet (0.005 = 0.5 %)."""
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    timing: LoanTiming = field(default_factory=LoanTiming)
    aim_fraction: float = 0.8
    """The calibrator aims at this fraction of the budget; the rest is a reserve for sudden bursts."""
    hold_demand_now: bool = True
    """Within the lead time the bound is at least the demand just seen plus ``z`` one-step error scales."""
    initial_z: float = 3.0
    """Margin before any feedback, in units of the forecast error scale: start careful."""
    calibration_rate_per_h: float = 0.05
    """How fast the margin moves (step 3 of :class:`TidalPolicy`)."""
    shortfall_cap_scales: float = 3.0
    """The calibrator counts a step's shortfall up to this many error scales at the lead time."""
    tail_budget_fraction: float = 1.0
    """The tail reserve's expected excess miss as a fraction of the budget (0 = off; docs/loaning.md)."""
    tail_kappa: float = 0.0
    """The tail reserve also covers this many standard errors of the mean excess over ``tail_period_s``."""
    tail_period_s: float = 86400.0
    """The period of ``tail_kappa``'s standard error."""
    tail_prior_miss: float = 0.5
    """A cautious start: the prior's worst miss per lead window, times the mean demand (0 = no prior)."""
    tail_prior_steps: float = 2.0
    """The prior's weight, in lead windows (steps) of the tail memory; never decays."""
    min_z: float = 0.0
    """Floor of the margin: never plan below the central forecast."""
    max_z: float = 50.0
    """Cap of the margin, against runaway after a freak event."""
    ledger_allowance_pool_h: float = 48.0
    """The budget ledger's allowance ``A = budget x N x this`` GPU-hours (``inf`` = off)."""
    ledger_fraction: float = 1.0
    """The ledger's rate ``B_l`` as a fraction of ``shortfall_budget``."""
    ledger_bank_pool_h: float = 48.0
    """How much unspent budget the ledger may bank (``budget x N x this`` GPU-hours; 0 = none)."""
    pacing_gain: float = 2.0
    """The online promise (:mod:`tidal.policy.budget_pacing`): how strongly a realized shortfall ahead of
    the window's share tightens the reserve and the aim (0 = off)."""
    pacing_half_life_s: float = 7 * 86400.0
    """The memory of the pace's window (a week: a day's window tightens after every burst and lends less;
    docs/loaning.md, "Client-level demand")."""
    pacing_cap: float = 4.0
    """The most the promise multiplies the tail reserve by."""
    pacing_floor: float = 1.0
    """The reserve factor the promise allows while the window's budget is unspent (1 = never below)."""
    clients: pc.ClientConfig = field(default_factory=pc.ClientConfig)
    """The client-level model, used while the context has per-client demand."""

    def __post_init__(self) -> None:
        if not 0 < self.shortfall_budget < 1:
            raise ValueError(f"TidalConfig.shortfall_budget must be in (0, 1), got {self.shortfall_budget}")
        if not self.tail_budget_fraction >= 0 or not self.tail_kappa >= 0 or not self.tail_period_s > 0:
            raise ValueError("TidalConfig.tail_budget_fraction and tail_kappa must be >= 0 and tail_period_s"
                             f" > 0, got {self.tail_budget_fraction}, {self.tail_kappa} and "
                             f"{self.tail_period_s}")
        if not 0 <= self.tail_prior_miss < math.inf or not 0 <= self.tail_prior_steps < math.inf:
            raise ValueError(f"TidalConfig.tail_prior_miss and tail_prior_steps must be finite and >= 0, "
                             f"got {self.tail_prior_miss} and {self.tail_prior_steps}")
        if not 0 < self.aim_fraction <= 1:
            raise ValueError(f"TidalConfig.aim_fraction must be in (0, 1], got {self.aim_fraction}")
        if not self.ledger_allowance_pool_h > 0 or not 0 < self.ledger_fraction <= 1 \
                or not 0 <= self.ledger_bank_pool_h < math.inf:
            raise ValueError("TidalConfig.ledger_allowance_pool_h must be > 0 (inf = off), ledger_fraction "
                             "in (0, 1] and ledger_bank_pool_h finite and >= 0, got "
                             f"{self.ledger_allowance_pool_h}, {self.ledger_fraction} and "
                             f"{self.ledger_bank_pool_h}")
        if not self.pacing_gain >= 0 or not self.pacing_half_life_s > 0 or not self.pacing_cap >= 1 \
                or not 0 < self.pacing_floor <= 1:
            raise ValueError(f"TidalConfig.pacing_gain must be >= 0, pacing_half_life_s > 0, pacing_cap "
                             f">= 1 and pacing_floor in (0, 1], got {self.pacing_gain}, "
                             f"{self.pacing_half_life_s}, {self.pacing_cap} and {self.pacing_floor}")
        horizon_needed = self.timing.lead_time_s + self.timing.min_loan_window_s
        if self.forecast.horizon_s < horizon_needed:
            raise ValueError(f"TidalConfig.forecast.horizon_s ({self.forecast.horizon_s:g}) must cover the "
                             f"lead time plus the minimum loan window ({horizon_needed:g} s)")


@dataclass(frozen=True, eq=False)
class TidalState:
    """What :class:`TidalPolicy` carries between steps: the margin ``z``; ``commitments``, per plan of the
    last lead time ``(decided_at_s, until_s, supply_gpus, pool_gpus, bound_supply_gpus)`` (what serving
    keeps, and would keep by the bound alone; stored states may hold the first 3 or 4 only);
    realized ``shortfall_gpu_s`` and ``demand_gpu_s``; the budget ledger ``G`` (``ledger_gpu_s``); the
    client model's state once per-client demand was seen."""

    forecast: ForecastState
    z: float
    commitments: tuple[tuple[float, ...], ...] = ()
    shortfall_gpu_s: float = 0.0
    demand_gpu_s: float = 0.0
    ledger_gpu_s: float = 0.0
    clients: pc.ClientState | None = None
    pace: tuple[float, float] = (0.0, 0.0)
    """Realized shortfall and demand (GPU-seconds) over the pacing window."""

    @property
    def shortfall_ratio(self) -> float:
        return self.shortfall_gpu_s / self.demand_gpu_s if self.demand_gpu_s > 0 else 0.0


def _lent(commitment: tuple, n: int) -> int:
    """GPUs a plan lent: ``pool - supply`` (a 3-tuple stored without its pool: today's ``n``)."""
    return int(commitment[3] if len(commitment) > 3 else n) - int(commitment[2])


def _lent_by_bound(commitment: tuple, n: int) -> int:
    """GPUs the plan's bound alone would have lent (stored without it: what the plan lent)."""
    if len(commitment) > 4:
        return int(commitment[3]) - int(commitment[4])
    return _lent(commitment, n)


@dataclass(frozen=True)
class TidalPolicy:
    """Forecast upper bound + online-calibrated margin -> :class:`LoanPlan`. Each step, in order:

    1. Observe ``ctx.demand_gpus`` into the forecast (unless ``now_s`` was already observed).
    2. Score the promise: serving's supply now is the smallest ``N - lendable`` of the plans of the
       last lead time; ``shortfall = max(0, demand - supply)``.
    3. Calibrate (online conformal risk control, Feldman et al. 2023):
       ``z += rate * dt_h * (counted - B'' * demand) / (B' * N)``, ``B' = aim_fraction * budget``
       (``B''``: the same over the online promise's tightening, :mod:`~tidal.policy.budget_pacing`), within
       ``[min_z, max_z]``; ``counted`` is the shortfall against what the plans' bounds alone would have
       lent (before the ledger's cap), at most ``shortfall_cap_scales`` error scales at the lead time.
    4. Plan from ``upper = max(center + z * scale, center + R)`` (``R``: the tail reserve, times the
       promise's tightening and the client model's risk factor, loosened only by the budget left), within the
       lead time at least ``demand now + z * scale(1)`` (``hold_demand_now``), and record the promise.
    5. Cap the loans by the budget ledger (:mod:`tidal.policy.budget`; docs/loaning.md, "The guarantee").
    """

    config: TidalConfig = field(default_factory=TidalConfig)

    @classmethod
    def build(cls, shortfall_budget: float, step_s: float, timing: LoanTiming | None = None, *,
              horizon_s: float | None = HORIZON_S) -> TidalPolicy:
        """The one place a policy is built from configuration (``tidal up``, ``serving watch``, the
        simulator, ``tidal plan``): a budget, the forecast's grid and the loan timing, other knobs at their
        defaults. ``horizon_s``: the forecast's (``ValueError`` below a lead time plus a window); None: as
        far as the timing needs."""
        timing = timing if timing is not None else LoanTiming()
        if horizon_s is None:
            horizon_s = timing.horizon_s(step_s)
        return cls(TidalConfig(shortfall_budget=shortfall_budget, timing=timing,
                               forecast=ForecastConfig(step_s=step_s, horizon_s=horizon_s)))

    def initial_state(self) -> TidalState:
        return TidalState(forecast=initial_state(self.config.forecast), z=self.config.initial_z)

    def learn(self, state: TidalState, history: Iterable[tuple[float, float]],
              serving_gpus: int) -> tuple[TidalState, int]:
        """``state`` after observing recorded demand, ``(time, GPUs or NaN)`` oldest first, with nothing lent:
        the history a forecast learns before its first live step (the live plane's and the simulator's
        alike). Points not after the state's last observation, or not a demand, are skipped. Returns the
        state and how many points it learned."""
        n = 0
        for t, y in history:
            if not (math.isnan(y) or 0 <= y < math.inf):
                continue
            if not math.isnan(state.forecast.t_s) and not t > state.forecast.t_s:
                continue
            ctx = LoanContext(now_s=t, serving_gpus=serving_gpus, demand_gpus=y, lent_gpus=0)
            _, state = self(ctx, state)
            n += 1
        return state, n

    def __call__(self, ctx: LoanContext, state: TidalState) -> tuple[LoanPlan, TidalState]:
        cfg = self.config
        n = ctx.serving_gpus
        fs = state.forecast
        new_obs = math.isnan(fs.t_s) or ctx.now_s > fs.t_s + EPS
        cap_unit = self._lead_scale(fs) if cfg.shortfall_cap_scales < math.inf else 0.0
        cs = state.clients
        if new_obs:
            fs = observe(cfg.forecast, fs, ctx.now_s, ctx.demand_gpus)
            if ctx.client_gpus is not None:
                cs = cs or pc.initial_clients(cfg.clients)
                cs = pc.observe_clients(cfg.clients, cfg.forecast, cs, ctx.now_s, ctx.client_gpus)
        z, shortfall_gpu_s, demand_gpu_s = state.z, state.shortfall_gpu_s, state.demand_gpu_s
        ledger, pace = state.ledger_gpu_s, state.pace
        ledger_on = cfg.ledger_allowance_pool_h < math.inf
        covering = [c for c in state.commitments if c[0] < ctx.now_s - EPS and ctx.now_s <= c[1] + EPS]
        y = ctx.demand_gpus
        if new_obs and not math.isnan(y) and n > 0:
            dt_s = cfg.forecast.step_s
            # GPUs away now: the most any plan of the last lead time lent, at most today's pool (a pool
            # that shrank may have lost lent GPUs or serving ones: the worst case, serving ones)
            away = min(n, max(_lent(c, n) for c in covering)) if covering else 0
            shortfall = max(0.0, y - (n - away)) if covering else 0.0
            shortfall_gpu_s += shortfall * dt_s
            demand_gpu_s += y * dt_s
            b = cfg.shortfall_budget * cfg.aim_fraction  # the target paced, the step size not
            aim = b / promise(pace, cfg.shortfall_budget, cfg.pacing_gain, cfg.pacing_cap)[0]
            pace = pace_update(pace, shortfall, y, dt_s, cfg.pacing_half_life_s)
            # z calibrates the bound: scored on what the bound alone would have lent, not the capped plans
            by_bound = shortfall
            if covering:
                away_bound = min(n, max(_lent_by_bound(c, n) for c in covering))
                by_bound = max(0.0, y - (n - away_bound))
            counted = min(by_bound, cfg.shortfall_cap_scales * cap_unit) if cap_unit > 0 else by_bound
            z += cfg.calibration_rate_per_h * dt_s / 3600.0 * (counted - aim * y) / (b * n)
            z = min(cfg.max_z, max(cfg.min_z, z))
            if ledger_on:  # the loans' part of the shortfall: demand beyond the pool is not theirs
                own = max(0.0, min(y, n) - (n - away)) if covering else 0.0
                ledger = ledger_update(ledger, own, y, dt_s, cfg.ledger_fraction * cfg.shortfall_budget,
                                       cfg.shortfall_budget * n * cfg.ledger_bank_pool_h * 3600.0)
        fc = forecast(cfg.forecast, fs) if fs.n_obs else None  # nothing known yet: lend nothing
        by_clients = fc is not None and cs is not None and cs.n_obs > 0 and ctx.client_gpus is not None
        tighten, left = promise(pace, cfg.shortfall_budget, cfg.pacing_gain, cfg.pacing_cap)
        reserve = self._reserve(fs) * tighten * loosened(cfg.pacing_floor, left)
        if by_clients and fc is not None and cs is not None:
            agg, fc = fc, pc.client_forecast(cfg.clients, cfg.forecast, cs, fc)
            if cfg.clients.reserve_floor < 1:
                i = min(max(round(cfg.timing.lead_time_s / cfg.forecast.step_s) - 1, 0), fc.times_s.size - 1)
                factor, cs = pc.reserve_factor(cfg.clients, cfg.forecast, cs, agg, fc, i, new_obs)
                reserve *= loosened(factor, left)
        commitments = tuple(c for c in state.commitments if c[1] > ctx.now_s + EPS)
        cap = self._ledger_cap(ctx.now_s, n, ledger, commitments) if ledger_on else None
        plan = self._plan(ctx, fc, z, reserve, cap)
        if by_clients:
            plan = replace(plan, forecaster="clients")
        bound = plan.lendable_gpus if plan.bound_gpus is None else plan.bound_gpus
        until = ctx.now_s + cfg.timing.lead_time_s
        commitments += ((ctx.now_s, until, n - plan.lendable_gpus, n, n - bound),)
        new_state = replace(state, forecast=fs, z=z, commitments=commitments,
                            shortfall_gpu_s=shortfall_gpu_s, demand_gpu_s=demand_gpu_s, ledger_gpu_s=ledger,
                            clients=cs, pace=pace)
        return plan, new_state

    def _ledger_cap(self, now_s: float, n: int, ledger: float,
                    commitments: tuple[tuple[float, ...], ...]) -> int:
        """The most GPUs the budget ledger lets be on loan now (:func:`~tidal.policy.budget.max_lendable`)."""
        cfg = self.config
        step = cfg.forecast.step_s
        grid = [now_s + step * j for j in range(1, int(math.floor(cfg.timing.lead_time_s / step + EPS)) + 1)]
        committed = [max([_lent(c, n) for c in commitments if c[0] < u - EPS and u <= c[1] + EPS], default=0)
                     for u in grid]
        allowance = cfg.shortfall_budget * n * cfg.ledger_allowance_pool_h * 3600.0
        return max_lendable(ledger, allowance, [float(max(c, 0)) for c in committed], step, n)

    def _lead_scale(self, fs: ForecastState) -> float:
        """The forecast's error scale at the lead time, from the last path (0 if none yet)."""
        if fs.n_obs == 0:
            return 0.0
        i = min(max(round(self.config.timing.lead_time_s / self.config.forecast.step_s) - 1, 0),
                fs.scale_gpus.size - 1)
        v = float(fs.scale_gpus[i])
        return v if v > 0 else 0.0

    def _reserve(self, fs: ForecastState) -> float:
        """The tail reserve (GPUs above the center) for this budget; 0 if off or nothing scored yet."""
        cfg = self.config
        if cfg.tail_budget_fraction <= 0 or fs.n_obs == 0:
            return 0.0
        lead_steps = max(1, math.ceil(cfg.timing.lead_time_s / cfg.forecast.step_s - EPS))
        budget = cfg.tail_budget_fraction * cfg.shortfall_budget
        return tail_reserve_gpus(cfg.forecast, fs, lead_steps, budget, kappa=cfg.tail_kappa,
                                 period_steps=cfg.tail_period_s / cfg.forecast.step_s,
                                 prior_miss=cfg.tail_prior_miss, prior_steps=cfg.tail_prior_steps)

    def _plan(self, ctx: LoanContext, fc: Forecast | None, z: float, reserve: float = 0.0,
              cap: int | None = None) -> LoanPlan:
        cfg = self.config
        step = cfg.forecast.step_s
        if fc is None:
            times = ctx.now_s + step * np.arange(1, cfg.forecast.horizon_steps + 1)
            upper = np.full(times.shape, float(ctx.serving_gpus))
            margin = 0.0
        else:
            keep = fc.times_s > ctx.now_s + EPS
            times = fc.times_s[keep]
            upper = np.maximum(fc.upper(z), fc.center_gpus + reserve)[keep]
            lead_at = int(np.searchsorted(times, ctx.now_s + cfg.timing.lead_time_s + EPS))
            lead_i = min(lead_at - 1, times.size - 1)
            zs = float(z * fc.scale_gpus[keep][max(lead_i, 0)])
            margin = max(zs, reserve)
            if cfg.hold_demand_now and not math.isnan(ctx.demand_gpus) and lead_i >= 0:
                # within the lead time the bound never falls below the demand just seen plus z one-step scales
                floor = ctx.demand_gpus + z * float(fc.scale_gpus[keep][0])
                upper[: lead_i + 1] = np.maximum(upper[: lead_i + 1], floor)
        return plan_loans(now_s=ctx.now_s, serving_gpus=ctx.serving_gpus, lent_gpus=ctx.lent_gpus,
                          demand_now_gpus=ctx.demand_gpus, times_s=times, upper_gpus=upper,
                          timing=cfg.timing, margin_gpus=margin, max_lendable_gpus=cap)


__all__ = [
    "LoanContext", "LoanPlan", "LoanTiming", "Reclaim", "TidalConfig", "TidalPolicy", "TidalState",
    "plan_loans",
]

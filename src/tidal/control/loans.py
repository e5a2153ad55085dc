"""Live loaning: the loan step of the reconcile loop, between the serving adapter and the scheduler.

:meth:`LiveLoans.tick` runs in :meth:`tidal.control.controller.Controller.step` after the jobs are
reconciled and before the scheduler, in this order (after the serving nodes lost and back:
:mod:`tidal.control.loan_nodes`):

1. **Warm-ups end.** GPUs handed back earlier serve again once their warm-up is over (the ledger's
   times and, for a :class:`~tidal.serving.adapters.ReadyAdapter`, its ``ready(node)``: e.g. the new
   Serve replica is healthy); restores the adapter refused earlier are tried again.
2. **Observe demand** at the next grid point of the serving clock (``step_s`` of serving time):
   ``adapter.demand_gpus``; NaN (unknown) is never read as zero. Before the first one, the forecast
   learns the history there is (``warm_history``, a replay's earlier days, or a
   :class:`~tidal.serving.adapters.HistoryAdapter`'s, read after that first observation so that a
   service rate just measured applies).
3. **Plan** with the same :class:`~tidal.policy.loan.TidalPolicy` the simulator evaluates. Unknown
   demand lends nothing new (the plan is capped at what is lent now).
4. **Apply the plan to the ledger** (:class:`~tidal.policy.ledger.LoanLedger`, the simulator's), in
   control-plane time: the plan's serving-clock times are mapped back (``speedup``). GPUs newly lent
   are released through the adapter *first*; a release that fails is undone in the ledger, so
   nothing is lent that serving still uses.

A :class:`~tidal.serving.adapters.QueuedAdapter` (the operator's hook) carries its actions out on a
worker thread, so the step never waits on it: a queued release keeps its GPUs in neither pool (in
the ledger's loan, but not among the loans the scheduler sees, nor serving) until the adapter reports
success (then they are lent: a ``loan`` event) or failure (then the loan is undone: they serve again,
an event says why); restored GPUs end their warm-up only once the restore succeeded (a failure owes
the restore, retried each step). Outcomes are collected at the start of each step. The actions in
flight are part of the stored document: a plane killed meanwhile sends them again on its first step
(the hook gets ``lent_after``, so a repeat is harmless) and keeps the GPUs out of both pools until
they succeed.

The scheduler then sees the loans and reclaims in its snapshot; its :class:`~tidal.model.ReturnGpus`
decisions come back through :meth:`LiveLoans.returned` (ledger, then ``adapter.restore``; a refused
restore leaves the GPUs in neither pool and is retried each step). Everything the ledger, the policy
and the adapter need to continue is one JSON document in the store (:meth:`dump` / :meth:`load`),
written after every step that changed it, so a ``tidal up`` killed with SIGKILL continues the same
loans, reclaims and forecast.

Timing: ``timing`` (:class:`~tidal.policy.loan.LoanTiming`) is in control-plane seconds (the jobs'
grace, their final checkpoint, release, serving warm-up); the policy plans on the serving clock with
the same durations times ``speedup``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tidal.control import loan_nodes, loan_view
from tidal.model import Loan, Reclaim
from tidal.policy import codec
from tidal.policy.forecast import ForecastConfig
from tidal.policy.ledger import LoanLedger
from tidal.policy.loan import LoanContext, LoanPlan, LoanTiming, TidalConfig, TidalPolicy, TidalState
from tidal.serving.adapters import (
    AdapterError,
    HistoryAdapter,
    QueuedAdapter,
    ReadyAdapter,
    ServingAdapter,
)
from tidal.serving.build import build_adapter
from tidal.serving.watch import WatchConfig

log = logging.getLogger(__name__)

DOC_KEY = "serving"
HISTORY_STEPS = 2000  # loan steps kept in memory for the dashboard's timeline (not persisted)
Event = tuple[str, str, dict | None]


def scaled(timing: LoanTiming, factor: float) -> LoanTiming:
    """``timing`` with every duration times ``factor`` (the serving clock's view of it)."""
    return dataclasses.replace(timing, notice_s=timing.notice_s * factor,
                               final_checkpoint_s=timing.final_checkpoint_s * factor,
                               release_s=timing.release_s * factor, warmup_s=timing.warmup_s * factor,
                               restart_cost_s=timing.restart_cost_s * factor)


class LiveLoans:
    """The loan step of the live control plane (see the module docstring). Not thread-safe: the
    reconcile loop calls it; readers (the API) use :meth:`view`, a dict swapped whole."""

    def __init__(self, adapter: ServingAdapter, timing: LoanTiming, *, shortfall_budget: float = 0.005,
                 step_s: float = 600.0, warm_history: list[tuple[float, float]] | None = None) -> None:
        self.adapter = adapter
        self.timing = timing
        self.speedup = float(adapter.speedup)
        self.nodes = adapter.nodes()  # as configured (serving.nodes); the pool now is the ledger's
        self.policy = TidalPolicy(TidalConfig(shortfall_budget=shortfall_budget,
                                              forecast=ForecastConfig(step_s=step_s),
                                              timing=scaled(timing, self.speedup)))
        self.step_s = step_s
        self.ledger = LoanLedger(self.nodes, timing)
        self.state = self.policy.initial_state()
        self.next_grid = math.nan  # serving time of the next observation
        self.pending_restores: dict[str, int] = {}  # node -> GPUs returned whose restore the adapter refused
        self.releasing: dict[str, int] = {}  # node -> GPUs whose release a QueuedAdapter has not finished
        self.restoring: dict[str, int] = {}  # node -> GPUs whose restore a QueuedAdapter has not finished
        self._resend = False  # actions in flight when the plane stopped: sent again on the first step
        self.queued_on: dict[str, int] = {}  # node -> actions a QueuedAdapter has not reported yet
        self.gone: dict[str, dict] = {}  # serving nodes lost (tidal.control.loan_nodes)
        self.returning: dict[str, dict] = {}  # serving nodes back, not yet serving again
        self.stale: dict[str, int] = {}  # node -> outcomes to ignore (actions sent before it was lost)
        self.jobs_seen: dict[str, list[str]] = {}  # node -> jobs holding GPUs there at the last step
        self.stats: dict[str, float] = {
            "steps": 0,
            "unknown_demand_steps": 0,
            "demand_gpu_s": 0.0,
            "shortfall_gpu_s": 0.0,
            "lent_gpu_s": 0.0,
            "used_gpu_s": 0.0,
            "reclaims_met": 0,
            "reclaims_missed": 0,
            "double_counted_steps": 0,
            "returned_gpus": 0,
            "release_failures": 0,
            "restore_failures": 0,
            "lent_total_gpus": 0,
        }
        self.margins: list[float] = []  # seconds before the deadline at each return (negative: late)
        self._due_gpus = (
            0  # lent GPUs due back (notice time come) as of the last step, less those returned since
        )
        self.last_s: float | None = None
        self.latest: dict[str, Any] = {}
        self.plan_shown: dict[str, Any] = {}
        self._dirty = True
        self._warm = list(warm_history or [])
        self._relearn = ""  # why a stored forecast was dropped at load (said in the first step's events)
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_STEPS)
        self.history: tuple[dict[str, Any], ...] = ()
        """The newest loan steps, oldest first (swapped whole; see :meth:`_sample`)."""

    # -------------------------------------------------------------------------------- persistence
    @property
    def serving_gpus(self) -> int:
        """The pool now: GPUs of the serving nodes present and warmed in (lost ones are not in it)."""
        return self.ledger.total

    def dirty(self) -> None:
        self._dirty = True

    def dump(self) -> dict[str, Any]:
        keep = ("since_s", "gpus", "ready_s", "told")
        back = {n: {k: v for k, v in b.items() if k in keep} for n, b in self.returning.items()}
        return {"version": 1, "nodes": dict(self.nodes), "ledger": self.ledger.to_state(),
                "gone": self.gone, "returning": back,
                "policy": codec.encode(self.state),
                "next_grid": codec.encode(self.next_grid), "pending_restores": dict(self.pending_restores),
                "releasing": dict(self.releasing), "restoring": dict(self.restoring),
                "stats": self.stats, "margins": self.margins[-1000:], "last_s": self.last_s,
                "adapter": self.adapter.persist(), "plan_view": self.plan_shown}

    def load(self, doc: Mapping[str, Any]) -> None:
        """Continue from :meth:`dump`'s document (after a restart); ``ValueError`` in one line saying
        what is wrong with it (nothing is changed then)."""
        try:
            self._load(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = e if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise ValueError(
                f"the store's serving document (table docs, key {DOC_KEY!r}) is damaged: {what}; "
                "restore the database from a backup, or delete that row to lend afresh "
                "(jobs on serving nodes must be stopped first)"
            ) from None

    def _load(self, doc: Mapping[str, Any]) -> None:
        if not isinstance(doc, Mapping) or doc.get("version") != 1:
            raise ValueError(f"unknown version {doc.get('version') if isinstance(doc, Mapping) else doc!r}")
        ledger = LoanLedger.from_state(doc["ledger"], self.timing)
        gone, returning = loan_nodes.check_doc(self.nodes, ledger.cap, doc.get("gone"), doc.get("returning"))
        state = codec.decode(doc["policy"], "policy")
        if not isinstance(state, TidalState):
            raise ValueError(f"policy: expected a TidalState, got {type(state).__name__}")
        next_grid = float(codec.decode(doc["next_grid"]))
        misfit = self._misfit(state)
        if misfit:  # e.g. serving.step_s changed: learn afresh (from the adapter's history) rather than crash
            log.warning("serving: the stored forecast %s; it learns afresh from the serving side's history",
                        misfit)
            self._relearn = misfit
            state, next_grid = self.policy.initial_state(), math.nan
        pending = {str(n): int(g) for n, g in (doc.get("pending_restores") or {}).items() if g}
        releasing = {str(n): int(g) for n, g in (doc.get("releasing") or {}).items() if g}
        restoring = {str(n): int(g) for n, g in (doc.get("restoring") or {}).items() if g}
        for what, book in (("releasing", releasing), ("restoring", restoring)):
            for n, g in book.items():
                top = ledger.lent_on(n) if what == "releasing" else ledger.cap.get(n, 0)
                if n in returning or n in gone:
                    raise ValueError(f"{what}[{n!r}]: the node is lost or not back in the pool")
                if not 1 <= g <= top:
                    raise ValueError(f"{what}[{n!r}] = {g} GPUs, outside 1..{top}")
        self.ledger, self.state, self.next_grid, self.pending_restores = ledger, state, next_grid, pending
        self.releasing, self.restoring, self._resend = releasing, restoring, bool(releasing or restoring)
        self.gone, self.returning = gone, returning
        self.stats.update(doc.get("stats") or {})
        self.margins = list(doc.get("margins") or [])
        self.last_s = doc.get("last_s")
        self.plan_shown = dict(doc.get("plan_view") or {})
        self.adapter.resume(doc.get("adapter") or {})
        if not misfit:
            self._warm = []
        self._due_gpus = sum(
            r.gpus for r in ledger.reclaims if self.last_s is not None and r.due(self.last_s)
        )

    def take_dirty(self) -> bool:
        d, self._dirty = self._dirty, False
        return d

    # ------------------------------------------------------------------------------------ queries
    def lent_on(self, node: str) -> int:
        """GPUs of ``node`` lent to jobs: the ledger's loan less a release still in flight."""
        return self.ledger.lent_on(node) - self.releasing.get(node, 0)

    @property
    def lent(self) -> int:
        return self.ledger.lent - sum(self.releasing.values())

    @property
    def loans(self) -> tuple[Loan, ...]:
        """The loans jobs may use (what the scheduler sees): without GPUs whose release is in flight."""
        if not self.releasing:
            return tuple(self.ledger.loans.values())
        return tuple(dataclasses.replace(ln, gpus=self.lent_on(ln.node)) for ln in self.ledger.loans.values()
                     if self.lent_on(ln.node) > 0)

    @property
    def reclaims(self) -> tuple[Reclaim, ...]:
        """The ledger's reclaims, earliest first less GPUs whose release is in flight (nobody holds them;
        once lent, the next step's reclaims ask for them, idle)."""
        hide = sum(self.releasing.values())
        if not hide:
            return tuple(self.ledger.reclaims)
        out = []
        for r in sorted(self.ledger.reclaims, key=lambda r: r.by_s):
            k = min(hide, r.gpus)
            hide -= k
            if r.gpus > k:
                out.append(dataclasses.replace(r, gpus=r.gpus - k))
        return tuple(out)

    def view(self) -> dict[str, Any]:
        return self.latest

    # --------------------------------------------------------------------------------------- tick
    def _misfit(self, state: TidalState) -> str:
        """Why a stored policy state does not fit this policy's configuration ('' when it does)."""
        fresh, fs = self.policy.initial_state().forecast, state.forecast
        for f in dataclasses.fields(fs):
            a, b = getattr(fs, f.name), getattr(fresh, f.name)
            if hasattr(a, "shape") and hasattr(b, "shape") and a.shape != b.shape:
                return f"was made for another step_s or horizon ({f.name} {a.shape}, now {b.shape})"
        k = fs.t_s / self.step_s
        if math.isfinite(k) and abs(k - round(k)) > 1e-6:
            return f"is off the {self.step_s:g} s grid (last observation at {fs.t_s:g})"
        return ""

    def _warm_up(self, grid: float) -> list[Event]:
        """Feed recorded history before the first live grid point ``grid`` to the forecast (a replay's
        earlier days; a :class:`~tidal.serving.adapters.HistoryAdapter`'s trace of earlier days and its own
        measured demand), so the first day is not planned blind; an event says how much."""
        pts = self._warm
        if not pts and isinstance(self.adapter, HistoryAdapter):
            try:
                pts = self.adapter.forecast_history(grid, self.step_s)
            except (ValueError, OSError) as e:  # never a crash of the loop: planned blind, and said
                log.warning("serving: no forecast history: %s", e)
                pts = []
        n = 0
        for t, y in sorted(pts):
            if not t < grid or not (math.isnan(y) or 0 <= y < math.inf):
                continue
            if not math.isnan(self.state.forecast.t_s) and not t > self.state.forecast.t_s:
                continue
            ctx = LoanContext(now_s=t, serving_gpus=self.serving_gpus, demand_gpus=y, lent_gpus=0)
            _, self.state = self.policy(ctx, self.state)
            n += 1
        self._warm = []
        why, self._relearn = (f"the stored forecast {self._relearn}; " if self._relearn else ""), ""
        return [("serving_history", f"{why}the forecast learned {n} steps of history", {"steps": n})] if (
            n or why) else []

    def tick(self, now_s: float, used: Mapping[str, int], wanted: int | None = None, *,
             present: Mapping[str, int] | None = None,
             jobs_on: Mapping[str, Sequence[str]] | None = None) -> list[Event]:
        """Steps 1-4 of the module docstring; returns the events to record. ``wanted``: how many more
        serving GPUs spot jobs could use now (``None``: any number, a saturated spot queue, as the
        simulator assumes); the plan lends no more than that beyond what jobs hold on loans already,
        so serving keeps the GPUs nobody would train on. ``present``: the serving nodes the executor
        has now (node -> GPUs; ``None``: all of them, as configured) and ``jobs_on`` the jobs holding
        GPUs on each: nodes lost and back (:mod:`tidal.control.loan_nodes`)."""
        events: list[Event] = []
        led = self.ledger
        if self.last_s is not None and now_s > self.last_s:  # GPU-seconds lent and used since the last tick
            dt = now_s - self.last_s
            self.stats["lent_gpu_s"] += self.lent * dt
            self.stats["used_gpu_s"] += (
                sum(min(g, self.lent_on(n)) for n, g in used.items() if n in self.nodes) * dt
            )
            self._dirty = True
        self.last_s = now_s
        if isinstance(self.adapter, QueuedAdapter):
            events += self._collect(now_s)
        if self._resend:
            events += self._send_again(now_s)
        if present is not None or self.gone or self.returning:
            events += loan_nodes.track(self, self.nodes if present is None else present, jobs_on or {}, now_s)
        for node, g in led.warm_all_done(now_s, self._ready):  # 1.
            events.append(("serving_ready", f"{g} GPUs of {node} serve again (warm-up over)",
                           {"node": node, "gpus": g}))
            self._dirty = True
        if self.pending_restores:
            events += self._retry_restores(now_s)
        t_serv = self.adapter.serving_time(now_s)
        if math.isnan(self.next_grid):
            self.next_grid = math.ceil(t_serv / self.step_s - 1e-9) * self.step_s
            self._dirty = True
        if t_serv + 1e-9 < self.next_grid:
            return events + self._announce(now_s)
        grid = self.next_grid
        if t_serv >= grid + self.step_s:  # late by whole steps: the forecast counts skipped ones as missing
            grid += math.floor((t_serv - grid) / self.step_s) * self.step_s
        self.next_grid = grid + self.step_s
        demand = self.adapter.demand_gpus(now_s)  # 2.
        if self.state.forecast.n_obs == 0 and math.isnan(self.state.forecast.t_s):  # history first (read
            events += self._warm_up(grid)  # after this demand: at the service rate just measured)
        if not (isinstance(demand, int | float) and (math.isnan(demand) or 0 <= demand < math.inf)):
            demand = math.nan
        unknown = math.isnan(demand)
        capacity = led.capacity
        self.stats["steps"] += 1
        if unknown:
            self.stats["unknown_demand_steps"] += 1
            events.append(("serving_unknown", "serving demand unknown: lending nothing new", None))
        else:
            self.stats["demand_gpu_s"] += demand * self.step_s
            self.stats["shortfall_gpu_s"] += max(0.0, demand - capacity) * self.step_s
        ctx = LoanContext(now_s=grid, serving_gpus=self.serving_gpus, demand_gpus=demand, lent_gpus=led.lent)
        plan, self.state = self.policy(ctx, self.state)  # 3.
        if unknown and plan.lendable_gpus > led.lent:
            plan = dataclasses.replace(plan, lendable_gpus=led.lent)
        if wanted is not None:  # lend only what spot jobs can use (never takes back what is lent)
            on_loans = sum(min(g, led.lent_on(n)) for n, g in used.items() if n in self.nodes)
            cap = max(led.lent, on_loans + max(0, wanted))
            if plan.lendable_gpus > cap:
                plan = dataclasses.replace(plan, lendable_gpus=cap)
        events += self._apply(plan, t_serv, now_s, used)  # 4.
        events += self._announce(now_s)
        self.plan_shown = loan_view.plan_view(self, now_s, t_serv, demand, plan)
        self._sample(now_s, t_serv, demand, plan)
        self._dirty = True
        return events

    def _sample(self, now_s: float, t_serv: float, demand: float, plan: LoanPlan) -> None:
        """One point of the dashboard's loan timeline (control-plane time ``t``): demand, the forecast's
        upper bound for the next step, what the plan lends, what is lent, warming, and under reclaim (every
        reclaim the ledger holds: noticed or planned)."""
        led = self.ledger
        self._history.append({
            "t": round(now_s, 3), "serving_t": round(t_serv, 1),
            "demand": None if math.isnan(demand) else round(demand, 3),
            "upper": _rounded(float(plan.upper_gpus[0])) if len(plan.upper_gpus) else None,
            "lendable": plan.lendable_gpus, "lent": led.lent, "warming": led.warming,
            "capacity": led.capacity, "reclaiming": sum(r.gpus for r in led.reclaims)})
        self.history = tuple(self._history)

    def _apply(self, plan: LoanPlan, t_serv: float, now_s: float, used: Mapping[str, int]) -> list[Event]:
        led = self.ledger
        wall = dataclasses.replace(plan, reclaims=tuple(
            dataclasses.replace(r, notice_s=now_s + (r.notice_s - t_serv) / self.speedup,
                                by_s=now_s + (r.by_s - t_serv) / self.speedup,
                                deadline_s=now_s + (r.deadline_s - t_serv) / self.speedup)
            for r in plan.reclaims))
        before = {n: led.lent_on(n) for n in self.nodes}
        led.apply_plan(wall, now_s, used)
        events: list[Event] = []
        for node in self.nodes:
            k = led.lent_on(node) - before[node]
            if k <= 0:
                continue
            owed = self.pending_restores.get(node, 0)
            if owed:  # lent again before serving got them back: they never left lending, no action
                take = min(k, owed)
                self._owe(node, owed - take)
                k -= take
                if k == 0:
                    continue
            if self.releasing.get(node):  # one release in flight per node, so each lent_after holds
                led.cancel_loan(node, k)  # whatever its outcome: the plan lends there again next step
                continue
            events += self._act("release", node, k, now_s)
        return events

    def _announce(self, now_s: float) -> list[Event]:
        """A ``reclaim`` event when more lent GPUs are due back than at the last step (a reclaim planned
        ahead whose notice time has come, or one due at once); GPUs returned meanwhile are subtracted."""
        due = [r for r in self.ledger.reclaims if r.due(now_s)]
        gpus = sum(r.gpus for r in due)
        new, self._due_gpus = gpus - self._due_gpus, gpus
        if new <= 0:
            return []
        first = min(r.by_s for r in due)
        return [("reclaim", f"reclaim {new} lent GPUs: notice now, off them within {first - now_s:.1f} s",
                 {"gpus": new, "by_s": first})]

    def returned(self, node: str, gpus: int, now_s: float) -> list[Event]:
        """Carry out :class:`~tidal.model.ReturnGpus`: the ledger, then the adapter."""
        led = self.ledger
        if gpus < 1 or led.lent_on(node) - self.releasing.get(node, 0) < gpus:  # e.g. the node was lost
            return [("decision", f"ignored ReturnGpus({node!r}, {gpus}): {self.lent_on(node)} GPUs lent there"
                     + (" (the node was lost)" if node in self.gone else ""), {"node": node, "gpus": gpus})]
        due = sorted(led.reclaims, key=lambda r: r.by_s)
        by = due[0].by_s if due else None
        ready = led.return_gpus(node, gpus, now_s)
        self._due_gpus = max(0, self._due_gpus - gpus)
        self.stats["returned_gpus"] += gpus
        data: dict[str, Any] = {"node": node, "gpus": gpus, "serving_at_s": ready}
        msg = (f"returned {gpus} GPUs of {node} to serving (serving again in {ready - now_s:.0f} s, "
               "after warm-up)")
        if by is not None:
            margin = by - now_s
            self.margins.append(margin)
            self.stats["reclaims_met" if margin >= 0 else "reclaims_missed"] += 1
            data["margin_s"] = margin
            msg += f", {margin:.1f} s before the deadline" if margin >= 0 else f", {-margin:.1f} s LATE"
        events: list[Event] = [("return", msg, data), *self._act("restore", node, gpus, now_s)]
        self._dirty = True
        return events

    def _act(self, action: str, node: str, gpus: int, now_s: float, retry: bool = False) -> list[Event]:
        """Release or restore through the adapter; a :class:`QueuedAdapter`'s outcome comes later
        (:meth:`_collect`), anyone else's now; both end in :meth:`_finish`."""
        lent_after = (self.ledger.lent_on(node) + self.pending_restores.get(node, 0)
                      + loan_nodes.missing(self, node))
        try:
            (self.adapter.release if action == "release" else self.adapter.restore)(
                node, gpus, lent_after, now_s
            )
        except AdapterError as e:
            return self._finish(action, node, gpus, str(e), retry, now_s)
        if isinstance(self.adapter, QueuedAdapter):
            book = self.releasing if action == "release" else self.restoring
            book[node] = book.get(node, 0) + gpus
            self.queued_on[node] = self.queued_on.get(node, 0) + 1
            self._dirty = True
            return []
        return self._finish(action, node, gpus, None, retry, now_s)

    def _collect(self, now_s: float) -> list[Event]:
        """The outcomes of the queued actions that finished since the last step."""
        events: list[Event] = []
        for done in self.adapter.done():  # type: ignore[attr-defined] (a QueuedAdapter)
            n = self.queued_on.get(done.node, 0) - 1
            if n > 0:
                self.queued_on[done.node] = n
            else:
                self.queued_on.pop(done.node, None)
            mine = loan_nodes.outcome(self, done.node, done.action, done.error)
            if mine is not None:  # sent before the node was lost, or telling the adapter it is back
                events += mine
                self._dirty = True
                continue
            book = self.releasing if done.action == "release" else self.restoring
            left = book.get(done.node, 0) - done.gpus
            if left > 0:
                book[done.node] = left
            else:
                book.pop(done.node, None)
            events += self._finish(done.action, done.node, done.gpus, done.error, False, now_s,
                                   after=self.queued_on.get(done.node, 0))
            self._dirty = True
        return events

    def _finish(self, action: str, node: str, gpus: int, error: str | None, retry: bool,
                now_s: float, after: int = 0) -> list[Event]:  # after: actions queued after it there
        led = self.ledger
        data = {"node": node, "gpus": gpus, "action": action}
        if action == "release" and error is None:
            self.stats["lent_total_gpus"] += gpus
            ln = led.loans.get(node)
            return [("loan", f"lent {gpus} GPUs of {node} to spot training ({self.lent_on(node)} lent there)",
                     {"node": node, "gpus": gpus, "until_s": loan_view.finite(ln.until_s) if ln else None})]
        if action == "release":
            self.stats["release_failures"] += 1
            k = min(gpus, led.lent_on(node) - self.releasing.get(node, 0))
            if k > 0 and after:
                # Actions queued after this one told the hook a lent count that assumed it succeeded
                # (a restore's lent_after): tell it the true count again, after them. Until that
                # restore succeeds the GPUs are in neither pool, as for any restore.
                led.return_gpus(node, k, now_s)
                return [("serving_action_failed",
                         f"release of {gpus} GPUs on {node} failed: {error}; nothing lent there (a later "
                         f"action counted them as lent: restoring {k} to set {node} back)", data),
                        *self._act("restore", node, k, now_s)]
            if k > 0:
                led.cancel_loan(node, k)
            return [
                (
                    "serving_action_failed",
                    f"release of {gpus} GPUs on {node} failed: {error}; nothing lent there",
                    data,
                )
            ]
        queued = isinstance(self.adapter, QueuedAdapter)
        if error is None:  # said when it was retried or is the outcome of a queued one
            return [("serving_restored", f"restore of {gpus} GPUs on {node} carried out{' on retry' * retry}",
                     {"node": node, "gpus": gpus})] if retry or queued else []
        self._owe(node, self.pending_restores.get(node, 0) + gpus)
        if retry and not queued:  # a synchronous retry that fails again: owed, quietly
            return []
        self.stats["restore_failures"] += 1
        return [("serving_action_failed", f"restore of {gpus} GPUs on {node} failed: {error}; retrying "
                 "each step (they serve nobody meanwhile)", data)]

    def _ready(self, node: str) -> bool:
        """Whether ``node``'s GPUs whose warm-up time is over serve again: no restore owed or in flight
        there, and a :class:`ReadyAdapter` says so."""
        if self.restoring.get(node) or self.pending_restores.get(node):
            return False
        return self.adapter.ready(node) if isinstance(self.adapter, ReadyAdapter) else True

    def _send_again(self, now_s: float) -> list[Event]:
        """Actions in flight when the plane stopped (:meth:`load`): sent again, the GPUs still in neither
        pool until they succeed."""
        self._resend = False
        events: list[Event] = []
        for action, book in (("release", self.releasing), ("restore", self.restoring)):
            for node, g in list(book.items()):
                del book[node]
                events += self._act(action, node, g, now_s, retry=True)
        self._dirty = True
        return events

    def _owe(self, node: str, gpus: int) -> None:
        if gpus > 0:
            self.pending_restores[node] = gpus
        else:
            self.pending_restores.pop(node, None)

    def _retry_restores(self, now_s: float) -> list[Event]:
        events: list[Event] = []
        for node, gpus in list(self.pending_restores.items()):
            self._owe(node, 0)  # owed again by _finish if it fails
            events += self._act("restore", node, gpus, now_s, retry=True)
        self._dirty = True
        return events

    def refresh(self, now_s: float, held: Mapping[str, int] | None = None,
                jobs_on: Mapping[str, Sequence[str]] | None = None) -> None:
        """Swap in a new :meth:`view` (the newest plan, the ledger as it is now, and ``held``: serving
        node -> GPUs jobs hold there, as the store says at the end of the step; ``jobs_on``: the jobs
        holding them, remembered to name them if the node is lost before the next step)."""
        if jobs_on is not None:
            self.jobs_seen = {n: sorted(j) for n, j in jobs_on.items() if j and n in self.nodes}
        self.latest = loan_view.state_view(self, now_s, held)


def build_live_loans(cfg: WatchConfig, ray_address: str | None = None) -> LiveLoans:
    """The serving adapter (:func:`tidal.serving.build.build_adapter`) and the loan step for a
    ``serving:`` block that lends (``cfg.nodes`` given). Raises ``ValueError`` (or ``OSError`` for an
    unreadable trace) naming what is wrong."""
    adapter, history = build_adapter(cfg, ray_address)
    return LiveLoans(adapter, cfg.timing(), shortfall_budget=cfg.shortfall_budget, step_s=cfg.step_s,
                     warm_history=history)


def _rounded(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None

"""Live loaning: the loan step of the reconcile loop, between the serving adapter and the scheduler.

:meth:`LiveLoans.tick` runs in :meth:`tidal.control.controller.Controller.step` after the jobs are reconciled
and before the scheduler (after the serving nodes lost and back,
:class:`~tidal.control.serving_nodes.ServingNodes`):

1. **Warm-ups end** (the ledger's times and a :class:`~tidal.serving.adapters.ReadyAdapter`'s ``ready``);
   restores refused earlier are tried again.
2. **Observe demand** at the next grid point of the serving clock; NaN (unknown) is never read as zero.
   Before the first one the forecast learns the history there is (``warm_history`` or a ``HistoryAdapter``'s).
3. **Plan** with the simulator's :class:`~tidal.policy.loan.TidalPolicy`; unknown demand lends nothing new.
4. **Apply the plan to the ledger** in control-plane time (serving-clock times divided by ``speedup``).
   Newly lent GPUs are released through the adapter *first*; a failed release is undone in the ledger.

A :class:`~tidal.serving.adapters.QueuedAdapter` acts on a worker thread: GPUs whose action is in flight are
in neither pool until it reports (collected at the start of each step); actions in flight are stored and sent
again after a restart (``lent_after`` makes a repeat harmless). The scheduler's ``ReturnGpus`` come back
through :meth:`LiveLoans.returned`. Everything needed to continue is one JSON document in the store
(:meth:`~LiveLoans.dump` / :meth:`~LiveLoans.load`), written after every step. ``timing`` is in control-plane
seconds; the policy plans on the serving clock with the durations times ``speedup``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tidal.control.loan_book import Actions
from tidal.control.schemas import EngineFigures, answer
from tidal.control.serving_nodes import Event, ServingNodes
from tidal.model import Loan, Reclaim
from tidal.policy import codec
from tidal.policy.ledger import LoanLedger, for_takers
from tidal.policy.loan import LoanContext, LoanPlan, LoanTiming, TidalPolicy, TidalState
from tidal.serving.adapters import (
    ActionDone,
    AdapterError,
    HistoryAdapter,
    QueuedAdapter,
    ReadyAdapter,
    ServingAdapter,
    WarmupAdapter,
)
from tidal.serving.build import build_adapter
from tidal.serving.requests import number_in
from tidal.serving.sources import client_demand
from tidal.serving.watch import WatchConfig

log = logging.getLogger(__name__)

DOC_KEY = "serving"
HISTORY_STEPS = 2000  # loan steps kept in memory for the dashboard's timeline (not persisted)
STATS_START: dict[str, float] = {
    "steps": 0, "unknown_demand_steps": 0, "demand_gpu_s": 0.0, "shortfall_gpu_s": 0.0, "lent_gpu_s": 0.0,
    "used_gpu_s": 0.0, "reclaims_met": 0, "reclaims_missed": 0, "double_counted_steps": 0, "returned_gpus": 0,
    "release_failures": 0, "restore_failures": 0, "lent_total_gpus": 0}
"""The loan step's counters at the start (counts, and GPU-seconds as floats)."""


def finite(x: float) -> float | None:
    """``x``, or None for an infinite time (a loan with no end yet): JSON has no infinity."""
    return None if math.isinf(x) else x


class LiveLoans:
    """The loan step of the live control plane (module docstring). Not thread-safe: the reconcile loop calls
    it; readers (the API) use :meth:`view`, a dict swapped whole. Only what the store keeps and readers see is
    held; the rest is computed each step."""

    def __init__(self, adapter: ServingAdapter, timing: LoanTiming, *, shortfall_budget: float = 0.005,
                 step_s: float = 600.0, warm_history: list[tuple[float, float]] | None = None) -> None:
        self.adapter = adapter
        self.timing = self.configured = timing  # timing: with the adapter's measured warm-up, if any
        self.speedup = float(adapter.speedup)
        self.step_s = step_s
        self.policy = TidalPolicy.build(shortfall_budget, step_s, timing.scaled(self.speedup))
        # as configured (serving.nodes); the pool now is the ledger's
        self.serving = ServingNodes(adapter.nodes(), adapter, timing)
        self.ledger = LoanLedger(self.nodes, timing)
        self.state = self.policy.initial_state()
        self.next_grid = math.nan  # serving time of the next observation
        self.actions = Actions()
        self.stats = dict(STATS_START)
        self.margins: list[float] = []  # seconds before the deadline at each return (negative: late)
        self.last_s: float | None = None  # the last step's time
        self.plan_shown: dict[str, Any] = {}
        self._warm = list(warm_history or [])  # history the forecast learns before its first step
        self._relearn = ""  # why a stored forecast was dropped at load (said in the first step's events)
        self._latest: dict[str, Any] = {}
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_STEPS)
        self.history: tuple[dict[str, Any], ...] = ()
        """The newest loan steps, oldest first (swapped whole; see :meth:`_sample`)."""

    @property
    def nodes(self) -> dict[str, int]:
        """The serving nodes as configured (``serving.nodes``)."""
        return self.serving.nodes

    @property
    def gone(self) -> dict[str, dict[str, Any]]:
        return self.serving.gone

    @property
    def returning(self) -> dict[str, dict[str, Any]]:
        return self.serving.returning

    @property
    def releasing(self) -> dict[str, int]:
        return self.actions.releasing

    @property
    def restoring(self) -> dict[str, int]:
        return self.actions.restoring

    @property
    def pending_restores(self) -> dict[str, int]:
        return self.actions.owed

    @property
    def serving_gpus(self) -> int:
        """The pool now: GPUs of the serving nodes present and warmed in (lost ones are not in it)."""
        return self.ledger.total

    def dump(self) -> dict[str, Any]:
        return {"version": 1, "nodes": dict(self.nodes), "ledger": self.ledger.to_state(),
                **self.serving.to_doc(), "policy": codec.encode(self.state),
                "next_grid": codec.encode(self.next_grid), **self.actions.to_doc(),
                "stats": self.stats, "margins": self.margins[-1000:], "last_s": self.last_s,
                "adapter": self.adapter.persist(), "plan_view": self.plan_shown}

    def load(self, doc: Mapping[str, Any]) -> None:
        """Continue from :meth:`dump`'s document; ``ValueError`` in one line saying what is wrong (nothing
        changed)."""
        try:
            self._load(doc)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            what = e if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise ValueError(
                f"the store's serving document (table docs, key {DOC_KEY!r}) is damaged: {what}; "
                "restore the database from a backup, or delete that row to lend afresh "
                "(jobs on serving nodes must be stopped first)") from None

    def _load(self, doc: Mapping[str, Any]) -> None:
        if not isinstance(doc, Mapping) or doc.get("version") != 1:
            raise ValueError(f"unknown version {doc.get('version') if isinstance(doc, Mapping) else doc!r}")
        ledger = LoanLedger.from_state(doc["ledger"], self.timing)
        serving = ServingNodes(self.nodes, self.adapter, self.timing)
        serving.load(doc, ledger.cap)
        state = codec.decode(doc["policy"], "policy")
        if not isinstance(state, TidalState):
            raise ValueError(f"policy: expected a TidalState, got {type(state).__name__}")
        next_grid = float(codec.decode(doc["next_grid"]))
        misfit = self._misfit(state)
        if misfit:  # e.g. serving.step_s changed: learn afresh (from the adapter's history) rather than crash
            log.warning("serving: the stored forecast %s; it learns afresh from serving's history", misfit)
            self._relearn = misfit
            state, next_grid = self.policy.initial_state(), math.nan
        actions = Actions.from_doc(doc, ledger.lent_on, ledger.cap, serving.away)
        stats, margins, last_s = doc.get("stats") or {}, list(doc.get("margins") or []), doc.get("last_s")
        for what, v in [*((f"stats.{k}", v) for k, v in dict(stats).items()),
                        *((f"margins[{i}]", v) for i, v in enumerate(margins)), ("last_s", last_s)]:
            if (v is not None or what != "last_s") and not number_in(v):
                raise ValueError(f"{what}: {v!r} is not a number")
        try:  # a state that decodes but cannot plan (a wrong type inside): refused now, not at every step
            t = state.forecast.t_s + self.step_s if math.isfinite(state.forecast.t_s) else 0.0
            probe = LoanContext(now_s=t, serving_gpus=ledger.total, demand_gpus=1.0, lent_gpus=ledger.lent)
            self.policy(probe, state)  # pure: the probe's plan and state are dropped
        except Exception as e:
            raise ValueError(f"policy: the stored state does not plan ({type(e).__name__}: {e})") from None
        self.ledger, self.state, self.next_grid, self.actions = ledger, state, next_grid, actions
        self.serving, self.margins, self.last_s = serving, margins, last_s
        self.stats.update(stats)
        self.plan_shown = dict(doc.get("plan_view") or {})
        self.adapter.resume(doc.get("adapter") or {})
        if not misfit:
            self._warm = []

    def lent_on(self, node: str) -> int:
        """GPUs of ``node`` lent to jobs: the ledger's loan less a release still in flight."""
        return self.ledger.lent_on(node) - self.actions.releasing.get(node, 0)

    @property
    def lent(self) -> int:
        return self.ledger.lent - sum(self.actions.releasing.values())

    @property
    def loans(self) -> tuple[Loan, ...]:
        """The loans jobs may use (what the scheduler sees): without GPUs whose release is in flight."""
        if not self.actions.releasing:
            return tuple(self.ledger.loans.values())
        return tuple(dataclasses.replace(ln, gpus=self.lent_on(ln.node)) for ln in self.ledger.loans.values()
                     if self.lent_on(ln.node) > 0)

    @property
    def reclaims(self) -> tuple[Reclaim, ...]:
        """The ledger's reclaims, earliest first, less GPUs whose release is in flight."""
        hide = sum(self.actions.releasing.values())
        if not hide:
            return tuple(self.ledger.reclaims)
        out = []
        for r in sorted(self.ledger.reclaims, key=lambda r: r.by_s):
            k = min(hide, r.gpus)
            hide -= k
            if r.gpus > k:
                out.append(dataclasses.replace(r, gpus=r.gpus - k))
        return tuple(out)

    def due_gpus(self, t_s: float | None) -> int:
        """GPUs of the ledger's reclaims whose notice time has come by ``t_s`` (none for ``None``)."""
        return 0 if t_s is None else sum(r.gpus for r in self.ledger.reclaims if r.due(t_s))

    def view(self) -> dict[str, Any]:
        return self._latest

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
        """Feed recorded history before the first live grid point ``grid`` to the forecast, so the first day
        is not planned blind; an event says how much."""
        pts = self._warm
        if not pts and isinstance(self.adapter, HistoryAdapter):
            try:
                pts = self.adapter.forecast_history(grid, self.step_s)
            except (ValueError, OSError) as e:  # never a crash of the loop: planned blind, and said
                log.warning("serving: no forecast history: %s", e)
                pts = []
        self.state, n = self.policy.learn(self.state, [(t, y) for t, y in sorted(pts) if t < grid],
                                          self.serving_gpus)
        self._warm = []
        why, self._relearn = (f"the stored forecast {self._relearn}; " if self._relearn else ""), ""
        return [("serving_history", f"{why}the forecast learned {n} steps of history", {"steps": n})] if (
            n or why) else []

    def tick(self, now_s: float, used: Mapping[str, int], wanted: int | None = None, *,
             present: Mapping[str, int] | None = None,
             jobs_on: Mapping[str, Sequence[str]] | None = None) -> list[Event]:
        """Steps 1-4 of the module docstring; returns the events to record. ``wanted``: serving GPUs spot jobs
        could still use (``None``: any number, as in the simulator); ``present``: the serving nodes the
        executor has (``None``: all); ``jobs_on``: the jobs holding GPUs on each."""
        events: list[Event] = []
        led = self.ledger
        last_s = self.last_s
        if last_s is not None and now_s > last_s:  # GPU-seconds lent and used since the last tick
            dt = now_s - last_s
            self.stats["lent_gpu_s"] += self.lent * dt
            self.stats["used_gpu_s"] += sum(min(g, self.lent_on(n)) for n, g in used.items()
                                            if n in self.nodes) * dt
        self.last_s = now_s
        # due as of the last step, on the ledger as it is now (less GPUs returned since): announced then
        was_due = self.due_gpus(last_s)
        if isinstance(self.adapter, QueuedAdapter):
            events += self._collect(self.adapter.done(), now_s)
        if self.actions.resend:
            self.actions.resend = False
            for action in ("release", "restore"):
                events += self._again(action, self.actions.book(action), now_s)
        if present is not None or self.serving.away:
            events += self.serving.track(self.nodes if present is None else present, jobs_on or {}, now_s,
                                         led, self.actions, self.stats)
        for node, g in led.warm_all_done(now_s, self._ready):  # 1.
            events.append(("serving_ready", f"{g} GPUs of {node} serve again (warm-up over)",
                           {"node": node, "gpus": g}))
        if self.actions.owed:
            events += self._again("restore", self.actions.owed, now_s)
        self._measured_warmup()
        t_serv = self.adapter.serving_time(now_s)
        if math.isnan(self.next_grid):
            self.next_grid = math.ceil(t_serv / self.step_s - 1e-9) * self.step_s
        if t_serv + 1e-9 < self.next_grid:
            return events + self._announce(now_s, was_due)
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
        ctx = LoanContext(now_s=grid, serving_gpus=self.serving_gpus, demand_gpus=demand, lent_gpus=led.lent,
                          client_gpus=None if unknown else client_demand(self.adapter, now_s))
        plan, self.state = self.policy(ctx, self.state)  # 3.
        if unknown and plan.lendable_gpus > led.lent:
            plan = dataclasses.replace(plan, lendable_gpus=led.lent)
        if wanted is not None:  # lend only what spot jobs can use (never takes back what is lent)
            plan = for_takers(plan, led, used, wanted)
        events += self._apply(plan, t_serv, now_s, used)  # 4.
        events += self._announce(now_s, was_due)
        self.plan_shown = self._plan_view(now_s, t_serv, demand, plan)
        self._sample(now_s, t_serv, demand, plan)
        return events

    def _measured_warmup(self) -> None:
        """Plan with the warm-up a :class:`WarmupAdapter` measured (else the configured one): the policy's
        lead time and the ledger's warm-ups follow it."""
        got = self.adapter.warmup_s() if isinstance(self.adapter, WarmupAdapter) else None
        timing = self.configured if got is None else dataclasses.replace(self.configured, warmup_s=float(got))
        if timing != self.timing:
            self.timing = self.ledger.timing = self.serving.timing = timing
            self.policy = TidalPolicy.build(self.policy.config.shortfall_budget, self.step_s,
                                            timing.scaled(self.speedup))

    def _sample(self, now_s: float, t_serv: float, demand: float, plan: LoanPlan) -> None:
        """One point of the dashboard's loan timeline (control-plane time ``t``)."""
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

        def on_wall(t: float) -> float:  # serving clock -> control-plane time
            return now_s + (t - t_serv) / self.speedup

        wall = dataclasses.replace(plan, reclaims=tuple(
            dataclasses.replace(r, by_s=on_wall(r.by_s),
                                notice_s=None if r.notice_s is None else on_wall(r.notice_s),
                                deadline_s=None if r.deadline_s is None else on_wall(r.deadline_s))
            for r in plan.reclaims))
        before = {n: led.lent_on(n) for n in self.nodes}
        led.apply_plan(wall, now_s, used)
        events: list[Event] = []
        owed = self.actions.owed
        for node in self.nodes:
            k = led.lent_on(node) - before[node]
            if k <= 0:
                continue
            if owed.get(node):  # lent again before serving got them back: they never left lending, no action
                take = min(k, owed[node])
                self.actions.add(owed, node, -take)
                k -= take
                if k == 0:
                    continue
            if self.actions.releasing.get(node):  # one release in flight per node: each lent_after holds
                led.cancel_loan(node, k)  # whatever its outcome: the plan lends there again next step
                continue
            events += self._act("release", node, k, now_s)
        return events

    def _announce(self, now_s: float, was_due: int) -> list[Event]:
        """A ``reclaim`` event when more lent GPUs are due back than at the last step (``was_due``)."""
        due = [r for r in self.ledger.reclaims if r.due(now_s)]
        new = sum(r.gpus for r in due) - was_due
        if new <= 0:
            return []
        first = min(r.by_s for r in due)
        return [("reclaim", f"reclaim {new} lent GPUs: notice now, off them within {first - now_s:.1f} s",
                 {"gpus": new, "by_s": first})]

    def returned(self, node: str, gpus: int, now_s: float) -> list[Event]:
        """Carry out :class:`~tidal.model.ReturnGpus`: the ledger, then the adapter."""
        led = self.ledger
        if gpus < 1 or self.lent_on(node) < gpus:  # e.g. the node was lost
            return [("decision", f"ignored ReturnGpus({node!r}, {gpus}): {self.lent_on(node)} GPUs lent there"
                     + (" (the node was lost)" if node in self.gone else ""), {"node": node, "gpus": gpus})]
        due = sorted(led.reclaims, key=lambda r: r.by_s)
        by = due[0].by_s if due else None
        ready = led.return_gpus(node, gpus, now_s)
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
        return [("return", msg, data), *self._act("restore", node, gpus, now_s)]

    def _act(self, action: str, node: str, gpus: int, now_s: float, retry: bool = False) -> list[Event]:
        """Release or restore through the adapter; a :class:`QueuedAdapter`'s outcome comes later
        (:meth:`_collect`), anyone else's now; both end in :meth:`_finish`."""
        lent_after = (self.ledger.lent_on(node) + self.actions.owed.get(node, 0)
                      + self.serving.missing(self.ledger, node))
        try:
            (self.adapter.release if action == "release" else self.adapter.restore)(
                node, gpus, lent_after, now_s
            )
        except AdapterError as e:
            return self._finish(action, node, gpus, str(e), retry, now_s)
        if isinstance(self.adapter, QueuedAdapter):
            self.actions.sent(action, node, gpus)
            return []
        return self._finish(action, node, gpus, None, retry, now_s)

    def _collect(self, done: list[ActionDone], now_s: float) -> list[Event]:
        """The outcomes of the queued actions that finished since the last step."""
        events: list[Event] = []
        for d in done:
            if self.actions.outcome_came(d.node):
                continue  # sent before the node was lost
            mine = self.serving.outcome(d.node, d.action, d.error, self.stats)
            if mine is not None:  # telling the adapter a node is back
                events += mine
                continue
            self.actions.add(self.actions.book(d.action), d.node, -d.gpus)
            events += self._finish(d.action, d.node, d.gpus, d.error, False, now_s,
                                   after=self.actions.queued.get(d.node, 0))
        return events

    def _finish(self, action: str, node: str, gpus: int, error: str | None, retry: bool,
                now_s: float, after: int = 0) -> list[Event]:  # after: actions queued after it there
        led = self.ledger
        data = {"node": node, "gpus": gpus, "action": action}
        if action == "release" and error is None:
            self.stats["lent_total_gpus"] += gpus
            ln = led.loans.get(node)
            return [("loan", f"lent {gpus} GPUs of {node} to spot training ({self.lent_on(node)} lent there)",
                     {"node": node, "gpus": gpus, "until_s": finite(ln.until_s) if ln else None})]
        if action == "release":
            self.stats["release_failures"] += 1
            k = min(gpus, self.lent_on(node))
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
            return [("serving_action_failed",
                     f"release of {gpus} GPUs on {node} failed: {error}; nothing lent there", data)]
        queued = isinstance(self.adapter, QueuedAdapter)
        if error is None:  # said when it was retried or is the outcome of a queued one
            return [("serving_restored", f"restore of {gpus} GPUs on {node} carried out{' on retry' * retry}",
                     {"node": node, "gpus": gpus})] if retry or queued else []
        self.actions.add(self.actions.owed, node, gpus)
        if retry and not queued:  # a synchronous retry that fails again: owed, quietly
            return []
        self.stats["restore_failures"] += 1
        return [("serving_action_failed", f"restore of {gpus} GPUs on {node} failed: {error}; retrying "
                 "each step (they serve nobody meanwhile)", data)]

    def _ready(self, node: str) -> bool:
        """Whether ``node``'s warmed-up GPUs serve again: no restore owed or in flight, and a
        :class:`ReadyAdapter` agrees."""
        if self.actions.busy(node):
            return False
        return self.adapter.ready(node) if isinstance(self.adapter, ReadyAdapter) else True

    def _again(self, action: str, book: dict[str, int], now_s: float) -> list[Event]:
        """Send what ``book`` holds again: the actions in flight when the plane stopped (:meth:`load`), or
        the restores owed (owed again by :meth:`_finish` if they fail)."""
        return [e for node, g in self.actions.take(book)
                for e in self._act(action, node, g, now_s, retry=True)]

    def _plan_view(self, now_s: float, t_serv: float, demand: float, plan: LoanPlan) -> dict[str, Any]:
        """The newest plan: demand, what may be lent, the margin and the first hours of the forecast."""
        k = min(len(plan.times_s), 36)
        return {
            "planned_s": now_s, "serving_time_s": t_serv, "speedup": self.speedup,
            "demand_gpus": None if math.isnan(demand) else round(demand, 3),
            "lendable_gpus": plan.lendable_gpus, "margin_gpus": round(plan.margin_gpus, 3),
            "z": round(float(self.state.z), 4), "shortfall_budget": self.policy.config.shortfall_budget,
            "forecast_observations": int(self.state.forecast.n_obs),
            "forecast": {"times_s": [round(float(x), 1) for x in plan.times_s[:k]],
                         "upper_gpus": [round(float(x), 2) for x in plan.upper_gpus[:k]]},
        }

    def refresh(self, now_s: float, held: Mapping[str, int] | None = None,
                jobs_on: Mapping[str, Sequence[str]] | None = None) -> None:
        """Swap in a new :meth:`view` (``held``: serving node -> GPUs jobs hold there at the end of the step;
        ``jobs_on``: the jobs holding them, remembered to name them if the node is lost)."""
        if jobs_on is not None:
            self.serving.jobs_seen = {n: sorted(j) for n, j in jobs_on.items() if j and n in self.nodes}
        led, health = self.ledger, self.adapter.health()
        self._latest = {
            "held_gpus": {n: g for n, g in (held or {}).items() if n in self.nodes}, **self.plan_shown,
            "now_s": now_s, "serving_nodes": dict(self.nodes), **self.serving.view(led),
            "serving_gpus": self.serving_gpus, "lent_gpus": self.lent, "warming_gpus": led.warming,
            "serving_capacity_gpus": led.capacity, "releasing": dict(self.actions.releasing),
            "restoring": dict(self.actions.restoring),
            "loans": [{"node": ln.node, "gpus": ln.gpus, "until_s": finite(ln.until_s)} for ln in self.loans],
            "reclaims": [{"gpus": r.gpus, "by_s": r.by_s, "notice_s": r.notice_s} for r in self.reclaims],
            "warming": {n: led.warming_ready_s(n) for n in led.cap if led.warming_ready_s(n)},
            "stats": dict(self.stats), "worst_margin_s": min(self.margins) if self.margins else None,
            "pending_restores": dict(self.actions.owed), "adapter": health,
            "lead_time_s": round(self.timing.lead_time_s, 3), "warmup_s": round(self.timing.warmup_s, 3),
            "warmup_measured": self.timing is not self.configured,
            "engine": None if (e := EngineFigures.of(health)) is None else answer(e)}


def build_live_loans(cfg: WatchConfig, ray_address: str | None = None,
                     workdir: Path | None = None) -> LiveLoans:
    """The serving adapter and the loan step for a ``serving:`` block that lends (an engine's replicas
    work in ``workdir``). Raises ``ValueError`` (``OSError`` for an unreadable trace) naming what is wrong."""
    adapter, history = build_adapter(cfg, ray_address, workdir)
    return LiveLoans(adapter, cfg.timing(), shortfall_budget=cfg.shortfall_budget, step_s=cfg.step_s,
                     warm_history=history)


def _rounded(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None

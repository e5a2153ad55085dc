"""The loan ledger: which serving GPUs are lent, which warm up, what is owed back and by when. Pure.

One ledger for the simulator and the live control plane. It carries out a
:class:`~tidal.policy.loan.LoanPlan` (it decides nothing the plan did not say) and
:class:`~tidal.model.ReturnGpus` decisions of the scheduler. It does no I/O and reads no clock:
time is an argument. The simulator wraps it in its simulated clock; the control plane persists it
in the store (:meth:`LoanLedger.to_state` / :meth:`LoanLedger.from_state`, JSON-able) after every
step and carries out what changed through a serving adapter.

* **Lending.** When the plan's ``lendable_gpus`` exceeds what is lent, the difference is lent at once
  (every lendable GPU is offered; with a saturated spot queue every one has a taker). Partly lent
  nodes are filled first, then nodes whose GPUs are warming up (they do not serve yet), then the
  rest in node order, so loans come in whole nodes where possible.
* **Owing.** The plan's reclaims become :class:`~tidal.model.Reclaim` instructions for the scheduler:
  ``reclaim_now_gpus`` is due now; each future ``(gpus, deadline, notice)`` keeps its notice time and
  gets ``by_s = notice + LoanTiming.notice_s + LoanTiming.final_checkpoint_s`` (the job's grace,
  then its final checkpoint); release and serving warm-up fill the rest of the lead time, so the
  GPUs serve again at the deadline. The list is rebuilt from every plan (level-triggered, like the
  scheduler); between plans a :class:`~tidal.model.ReturnGpus` lowers the earliest one.
* **Loan ends.** Each loan's ``until_s`` is the notice time of the first of its GPUs the plan wants
  back (``inf``: none within the horizon); the least used nodes get the earliest times (the
  scheduler hands idle nodes back first, and starts nothing new on a loan about to end).
* **Returning.** GPUs handed back serve again after ``release_s + warmup_s``; until then they count
  neither as lent nor as serving capacity.
* **Nodes lost and back.** :meth:`LoanLedger.drop_node` takes a serving node out (it was lost): its
  loans end, its warming GPUs go with it, and the reclaims shrink by what was lent there (those GPUs
  cannot be handed back; the next plan asks again with the smaller pool). :meth:`LoanLedger.add_node`
  puts one (back) in, every GPU serving. The pool (``total``) follows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, repeat

from tidal.model import Loan, Reclaim
from tidal.policy.apply import lowered
from tidal.policy.loan import LoanPlan, LoanTiming


class LoanLedger:
    """Serving nodes, their loans and warming GPUs, and the outstanding reclaims. Mutable, no clock."""

    def __init__(self, nodes: Mapping[str, int], timing: LoanTiming) -> None:
        self.cap = dict(nodes)  # node -> GPUs
        self.total = sum(self.cap.values())
        self.timing = timing
        self.loans: dict[str, Loan] = {}
        self.lent = 0
        self.warming_on: dict[str, list[list[float]]] = {}  # node -> [[ready_s, gpus], ...]
        self.warming = 0
        self.reclaims: list[Reclaim] = []
        self.lendable = 0  # the latest plan's
        self._until_key: tuple | None = None  # what the loan ends were last computed from
        self._finite: set[str] = set()  # loaned nodes with a finite until_s
        self._sorted_for: tuple[str, ...] = ()  # the loaned nodes whose names _sorted_names holds, sorted
        self._sorted_names: list[str] = []

    # ------------------------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        """GPUs serving now: neither lent nor warming up."""
        return self.total - self.lent - self.warming

    def lent_on(self, node: str) -> int:
        ln = self.loans.get(node)
        return ln.gpus if ln is not None else 0

    # ------------------------------------------------------------------------------ the plan

    def apply_plan(self, plan: LoanPlan, now: float, used: Mapping[str, int]) -> list[float]:
        """Lend up to the plan, rebuild the reclaims, set loan ends. Returns the reclaim notice times
        in the future (the caller wakes the scheduler then). ``used``: node -> GPUs jobs hold."""
        self.lendable = plan.lendable_gpus
        if plan.lendable_gpus > self.lent:
            self._lend(plan.lendable_gpus - self.lent)
        t = self.timing
        after_notice = t.notice_s + t.final_checkpoint_s
        reclaims = []
        if self.lent > plan.lendable_gpus:
            reclaims.append(Reclaim(self.lent - plan.lendable_gpus, by_s=now + after_notice))
        for r in plan.reclaims:
            reclaims.append(Reclaim(r.gpus, by_s=_notice(r) + after_notice, notice_s=r.notice_s,
                                    deadline_s=r.deadline_s))
        self.reclaims = reclaims
        self._set_until(plan, now, used)
        return [_notice(r) for r in plan.reclaims if _notice(r) > now]

    def _lend(self, gpus: int) -> None:
        """Partly lent nodes first (whole-node loans), then nodes warming up, then the rest in order."""
        partial = [n for n, ln in self.loans.items() if ln.gpus < self.cap[n]]
        warming = [n for n, e in self.warming_on.items() if e and self.lent_on(n) < self.cap[n]]
        seen: set[str] = set()
        loans = self.loans
        # The rest in node order: only nodes without a loan can take GPUs there (a partly lent node is
        # in ``partial``, and only nodes already seen got a loan in this loop), so the others are
        # skipped here at the cost of a dict lookup (read when reached, as the loop below lends).
        rest = (n for n in self.cap if n not in loans)
        for node in chain(partial, warming, rest):
            if gpus <= 0:
                break
            if node in seen:
                continue
            seen.add(node)
            k = min(gpus, self.cap[node] - self.lent_on(node))
            if k <= 0:
                continue
            self._take_warming(node, k)
            old = self.loans.get(node)
            self.loans[node] = Loan(
                node, (old.gpus if old else 0) + k, until_s=old.until_s if old else math.inf
            )
            self.lent += k
            gpus -= k

    def _take_warming(self, node: str, gpus: int) -> None:
        """Lent GPUs come from those warming up first (latest-ready first): they do not serve yet."""
        entries = self.warming_on.get(node)
        free_serving = self.cap[node] - self.lent_on(node) - sum(int(w[1]) for w in entries or ())
        take = max(0, gpus - free_serving)
        while take > 0 and entries:
            last = entries[-1]
            k = min(take, int(last[1]))
            last[1] -= k
            take -= k
            self.warming -= k
            if last[1] <= 0:
                entries.pop()

    def _set_until(self, plan: LoanPlan, now: float, used: Mapping[str, int]) -> None:
        if not self.loans:
            return
        nodes = tuple(self.loans)
        key = (self.lent, plan.lendable_gpus, tuple((r.notice_s, r.gpus) for r in plan.reclaims), nodes)
        if key == self._until_key:
            return  # same plan for the same loans: the ends stand (idle vs used order is a preference)
        self._until_key = key
        # Notice time per lent GPU, earliest first: GPUs lent beyond the plan (wanted now), then the
        # plan's groups; the rest have no deadline. The least used nodes take the earliest ends.
        keep = min(self.lent, plan.lendable_gpus)
        ends: list[tuple[float, int]] = [(now, self.lent - keep)] if self.lent > keep else []
        ends += [(_notice(r), r.gpus) for r in plan.reclaims]
        finite = sum(g for _, g in ends)
        if finite and self.loans:
            # the nodes by (GPUs used, name): as heapq.nsmallest(finite, ...) would list them, and the
            # walk below never takes more than ``finite`` of them (each holds at least one lent GPU)
            # sorted by (used, name) as two sorts: the names, then stably by use (no tuples compared)
            if nodes != self._sorted_for:  # the loaned nodes changed: sort their names again
                self._sorted_for, self._sorted_names = nodes, sorted(nodes)
            names = self._sorted_names
            use = list(map(used.get, names, repeat(0)))
            order = [names[i] for i in sorted(range(len(names)), key=use.__getitem__)]
        else:
            order = []
        new_finite: set[str] = set()
        i, left = 0, ends[0][1] if ends else 0
        for node in order:
            if i >= len(ends):
                break
            ln = self.loans[node]
            until = ends[i][0]
            g = ln.gpus
            while g > 0 and i < len(ends):
                k = min(g, left)
                g -= k
                left -= k
                if left <= 0:
                    i += 1
                    left = ends[i][1] if i < len(ends) else 0
            new_finite.add(node)
            if until != ln.until_s:
                self.loans[node] = Loan(node, ln.gpus, until_s=until)
        for node in self._finite - new_finite:
            was = self.loans.get(node)
            if was is not None and was.until_s != math.inf:
                self.loans[node] = Loan(node, was.gpus, until_s=math.inf)
        self._finite = new_finite

    # ------------------------------------------------------------------------------ decisions

    def return_gpus(self, node: str, gpus: int, now: float) -> float:
        """Carry out :class:`~tidal.model.ReturnGpus`; returns when those GPUs serve again."""
        self._unlend(node, gpus, f"ReturnGpus({node!r}, {gpus})")
        ready = now + self.timing.release_s + self.timing.warmup_s
        self.warming_on.setdefault(node, []).append([ready, gpus])
        self.warming += gpus
        self.reclaims = lowered(self.reclaims, gpus)
        return ready

    def cancel_loan(self, node: str, gpus: int) -> None:
        """Undo ``gpus`` of a loan just made on ``node`` that could not be carried out (the serving side
        refused to release them): they stay serving's, no warm-up."""
        self._unlend(node, gpus, f"cancel_loan({node!r}, {gpus})")
        self._until_key = None

    def _unlend(self, node: str, gpus: int, what: str) -> None:
        ln = self.loans.get(node)
        if ln is None or gpus > ln.gpus or gpus < 1:
            raise AssertionError(f"{what}: node has {ln.gpus if ln else 0} GPUs on loan")
        if gpus == ln.gpus:
            del self.loans[node]
        else:
            self.loans[node] = Loan(node, ln.gpus - gpus, until_s=ln.until_s)
        self.lent -= gpus

    def warm_done(self, node: str, now: float) -> None:
        """GPUs of ``node`` whose warm-up ends by ``now`` serve again."""
        entries = self.warming_on.get(node)
        if not entries:
            return
        keep = []
        for e in entries:
            if e[0] <= now + 1e-9:
                self.warming -= int(e[1])
            else:
                keep.append(e)
        self.warming_on[node] = keep

    def drop_node(self, node: str) -> tuple[int, int]:
        """``node`` left the pool (lost): its loans end, its warming GPUs go, the earliest reclaims shrink by
        what was lent there. Returns (GPUs that were lent, GPUs that were warming) there."""
        if node not in self.cap:
            raise AssertionError(f"drop_node({node!r}): not in the pool")
        lent = self.lent_on(node)
        if lent:
            self._unlend(node, lent, f"drop_node({node!r})")
        warming = sum(int(e[1]) for e in self.warming_on.pop(node, ()))
        self.warming -= warming
        self.total -= self.cap.pop(node)
        self.reclaims = lowered(self.reclaims, lent)
        self._until_key = None
        self._finite.discard(node)
        return lent, warming

    def add_node(self, node: str, gpus: int, order: Sequence[str] = ()) -> None:
        """``node`` joins the pool (back after a loss) with ``gpus`` GPUs, all serving; ``order``: the
        nodes' order to keep (loans go to the rest in node order), else it comes last."""
        if node in self.cap or gpus < 1:
            raise AssertionError(f"add_node({node!r}, {gpus}): already in the pool or no GPUs")
        self.cap[node] = int(gpus)
        self.total += int(gpus)
        rank = {n: i for i, n in enumerate(order)}
        self.cap = dict(sorted(self.cap.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        self._until_key = None

    def due_reclaim(self, now: float) -> bool:
        return any(r.due(now) for r in self.reclaims)

    def warming_ready_s(self, node: str) -> list[tuple[float, int]]:
        """(ready time, GPUs) of ``node``'s GPUs warming up, in the order they were handed back."""
        return [(float(r), int(g)) for r, g in self.warming_on.get(node, ())]

    def warm_all_done(self, now: float, ready: Callable[[str], bool] | None = None) -> list[tuple[str, int]]:
        """Every node's GPUs whose warm-up ends by ``now`` serve again; returns (node, GPUs) for each.
        ``ready``: also asked, for a node with some warm-up over by time, whether it serves again (the
        serving system's word; False keeps all its GPUs warming)."""
        done = []
        for node in list(self.warming_on):
            timed_out = any(float(e[0]) <= now for e in self.warming_on[node])
            if ready is not None and (not timed_out or not ready(node)):
                continue
            before = sum(int(e[1]) for e in self.warming_on[node])
            self.warm_done(node, now)
            after = sum(int(e[1]) for e in self.warming_on[node])
            if before > after:
                done.append((node, before - after))
        return done

    # ------------------------------------------------------------------------------ persistence

    def to_state(self) -> dict:
        """Everything the ledger holds as JSON-able data (``inf`` as ``None``); see :meth:`from_state`."""
        def t(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else float(x)
        return {"nodes": dict(self.cap), "lendable": self.lendable,
                "loans": [[ln.node, ln.gpus, t(ln.until_s)] for ln in self.loans.values()],
                "warming": {n: [[float(r), int(g)] for r, g in e] for n, e in self.warming_on.items() if e},
                "reclaims": [[r.gpus, r.by_s, r.notice_s, r.deadline_s] for r in self.reclaims]}

    @classmethod
    def from_state(cls, state: Mapping, timing: LoanTiming) -> LoanLedger:
        """The ledger :meth:`to_state` wrote. Raises ``ValueError`` naming the field when it is not
        consistent (a loan on an unknown node, more lent than the node has)."""
        led = cls({str(n): int(g) for n, g in state["nodes"].items()}, timing)
        for node, gpus, until in state.get("loans", ()):
            if node not in led.cap or not 1 <= int(gpus) <= led.cap[node]:
                raise ValueError(
                    f"ledger state: loans[{node!r}] = {gpus} GPUs, node has {led.cap.get(node, 0)}"
                )
            led.loans[node] = Loan(node, int(gpus), until_s=math.inf if until is None else float(until))
            led.lent += int(gpus)
        for node, entries in (state.get("warming") or {}).items():
            if node not in led.cap:
                raise ValueError(f"ledger state: warming[{node!r}]: unknown node")
            led.warming_on[node] = [[float(r), int(g)] for r, g in entries]
            led.warming += sum(int(g) for _, g in entries)
        for node in led.cap:
            held = led.lent_on(node) + sum(g for _, g in led.warming_ready_s(node))
            if held > led.cap[node]:
                raise ValueError(
                    f"ledger state: node {node!r} has {held} GPUs lent or warming, of {led.cap[node]}"
                )
        led.reclaims = [Reclaim(int(r[0]), float(r[1]), None if r[2] is None else float(r[2]),
                                None if len(r) < 4 or r[3] is None else float(r[3]))
                        for r in state.get("reclaims", ())]
        led.lendable = int(state.get("lendable", 0))
        return led


def _notice(r: Reclaim) -> float:
    """The notice time of a plan's reclaim (a plan always says when to give notice)."""
    if r.notice_s is None:
        raise ValueError(f"a loan plan's reclaim has no notice time: {r}")
    return r.notice_s

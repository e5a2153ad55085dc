"""The loan ledger: which serving GPUs are lent, which warm up, what is owed back and by when. Pure.

One ledger for the simulator and the control plane (which persists it, :meth:`LoanLedger.to_state`).
It carries out a :class:`~tidal.policy.loan.LoanPlan` and :class:`~tidal.model.ReturnGpus` and decides
nothing: loans go to partly lent nodes first (whole-node loans), reclaims are rebuilt from every plan
(``by_s = notice + notice_s + final_checkpoint_s``), the least used nodes get the earliest loan ends,
GPUs handed back serve again after ``release_s + warmup_s``, and a lost node's loans end with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import chain, repeat

import numpy as np

from tidal.model import Loan, Reclaim
from tidal.policy.apply import lowered
from tidal.policy.loan import LoanPlan, LoanTiming


class LoanLedger:
    """Serving nodes, their loans and warming GPUs, and the outstanding reclaims. Mutable, no clock."""

    def __init__(self, nodes: Mapping[str, int], timing: LoanTiming) -> None:
        self.cap = dict(nodes)  # node -> GPUs
        self.total = sum(self.cap.values())
        self.timing = timing
        self.loans: dict[str, Loan] = {}  # written only where the node is also marked in loans_changed
        self.loans_changed: dict[str, None] = {}  # nodes whose loan came, changed or went (take_loan_changes)
        self.lent = 0
        self.warming_on: dict[str, list[list[float]]] = {}  # node -> [[ready_s, gpus], ...]
        self.warming = 0
        self.reclaims: list[Reclaim] = []
        self.lendable = 0  # the latest plan's
        self._until_key: tuple | None = None  # what the loan ends were last computed from
        self._finite: set[str] = set()  # loaned nodes with a finite until_s
        self._sorted_for: tuple[str, ...] = ()  # the loaned nodes whose names _sorted_names holds, sorted
        self._sorted_names: list[str] = []

    @property
    def capacity(self) -> int:
        """GPUs serving now: neither lent nor warming up."""
        return self.total - self.lent - self.warming

    def lent_on(self, node: str) -> int:
        ln = self.loans.get(node)
        return ln.gpus if ln is not None else 0

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
        # The rest in node order: only nodes without a loan (read lazily, as the loop lends).
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
            self.loans_changed[node] = None
            self.loans[node] = Loan(node, (old.gpus if old else 0) + k,
                                    until_s=old.until_s if old else math.inf)
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
        # Notice time per lent GPU, earliest first (beyond the plan: now); least used nodes first.
        keep = min(self.lent, plan.lendable_gpus)
        ends: list[tuple[float, int]] = [(now, self.lent - keep)] if self.lent > keep else []
        ends += [(_notice(r), r.gpus) for r in plan.reclaims]
        finite = sum(g for _, g in ends)
        if finite and self.loans:
            # the nodes by (GPUs used, name), as two sorts: the names, then stably by use
            if nodes != self._sorted_for:  # the loaned nodes changed: sort their names again
                self._sorted_for, self._sorted_names = nodes, sorted(nodes)
            names = self._sorted_names
            use = np.fromiter(map(used.get, names, repeat(0)), dtype=np.int64, count=len(names))
            order: Iterable[str] = map(names.__getitem__, np.argsort(use, kind="stable").tolist())
        else:
            order = ()
        new_finite: set[str] = set()
        changed = self.loans_changed
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
                changed[node] = None
        for node in self._finite - new_finite:
            was = self.loans.get(node)
            if was is not None and was.until_s != math.inf:
                self.loans[node] = Loan(node, was.gpus, until_s=math.inf)
                changed[node] = None
        self._finite = new_finite

    def take_loan_changes(self) -> dict[str, Loan | None]:
        """Node -> its loan now (``None``: none) for the nodes whose loan came, changed or went since the
        last call (for the scheduler's ``RunningIndex.hint_loans``)."""
        loans = self.loans
        out = {node: loans.get(node) for node in self.loans_changed}
        self.loans_changed = {}
        return out

    def return_gpus(self, node: str, gpus: int, now: float) -> float:
        """Carry out :class:`~tidal.model.ReturnGpus`; returns when those GPUs serve again."""
        self._unlend(node, gpus, f"ReturnGpus({node!r}, {gpus})")
        ready = now + self.timing.release_s + self.timing.warmup_s
        self.warming_on.setdefault(node, []).append([ready, gpus])
        self.warming += gpus
        self.reclaims = lowered(self.reclaims, gpus)
        return ready

    def cancel_loan(self, node: str, gpus: int) -> None:
        """Undo ``gpus`` of a loan just made on ``node`` the serving side refused: no warm-up."""
        self._unlend(node, gpus, f"cancel_loan({node!r}, {gpus})")
        self._until_key = None

    def _unlend(self, node: str, gpus: int, what: str) -> None:
        ln = self.loans.get(node)
        if ln is None or gpus > ln.gpus or gpus < 1:
            raise AssertionError(f"{what}: node has {ln.gpus if ln else 0} GPUs on loan")
        if gpus == ln.gpus:
            del self.loans[node]
            self.loans_changed[node] = None
        else:
            self.loans[node] = Loan(node, ln.gpus - gpus, until_s=ln.until_s)
            self.loans_changed[node] = None
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
        """``node`` was lost (see the module docstring). Returns (GPUs lent, GPUs warming) there."""
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
        """``node`` joins the pool with ``gpus`` GPUs, all serving, placed by ``order`` (else last)."""
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
        ``ready``: the serving system's word for a node with some warm-up over (False keeps it warming)."""
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
        """The ledger :meth:`to_state` wrote; ``ValueError`` naming the field where it is inconsistent."""
        led = cls({str(n): int(g) for n, g in state["nodes"].items()}, timing)
        for node, gpus, until in state.get("loans", ()):
            if node not in led.cap or not 1 <= int(gpus) <= led.cap[node]:
                raise ValueError(f"ledger state: loans[{node!r}] = {gpus} GPUs, node has "
                                 f"{led.cap.get(node, 0)}")
            led.loans[node] = Loan(node, int(gpus), until_s=math.inf if until is None else float(until))
            led.loans_changed[node] = None
            led.lent += int(gpus)
        for node, entries in (state.get("warming") or {}).items():
            if node not in led.cap:
                raise ValueError(f"ledger state: warming[{node!r}]: unknown node")
            led.warming_on[node] = [[float(r), int(g)] for r, g in entries]
            led.warming += sum(int(g) for _, g in entries)
        for node in led.cap:
            held = led.lent_on(node) + sum(g for _, g in led.warming_ready_s(node))
            if held > led.cap[node]:
                raise ValueError(f"ledger state: node {node!r} has {held} GPUs lent or warming, "
                                 f"of {led.cap[node]}")
        led.reclaims = [Reclaim(int(r[0]), float(r[1]), None if r[2] is None else float(r[2]),
                                None if len(r) < 4 or r[3] is None else float(r[3]))
                        for r in state.get("reclaims", ())]
        led.lendable = int(state.get("lendable", 0))
        return led


def for_takers(plan: LoanPlan, ledger: LoanLedger, used: Mapping[str, int], wanted: int) -> LoanPlan:
    """``plan`` lending at most what spot jobs can use: what they hold on loans (``used``: node -> GPUs jobs
    hold) and ``wanted`` more; it never takes back what is lent. The live plane's rule (serving keeps what
    nobody would train on); the simulator follows it with ``SimConfig.lend_to_takers``."""
    on_loans = sum(min(g, ledger.lent_on(n)) for n, g in used.items() if n in ledger.cap)
    cap = max(ledger.lent, on_loans + max(0, wanted))
    return replace(plan, lendable_gpus=cap) if plan.lendable_gpus > cap else plan


def _notice(r: Reclaim) -> float:
    """The notice time of a plan's reclaim (a plan always says when to give notice)."""
    if r.notice_s is None:
        raise ValueError(f"a loan plan's reclaim has no notice time: {r}")
    return r.notice_s

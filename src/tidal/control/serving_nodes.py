"""Serving nodes lost and back while they lend: :class:`ServingNodes`, called first in each loan step.

* **Lost** (not present): its loans end at once (``serving_node_lost``, naming the jobs); nothing is reclaimed
  from it, its GPUs leave the pool, and actions owed or in flight there are dropped. Its jobs recover like
  any node loss.
* **Back** (``serving_node_back``): the adapter is told with a restore (``lent_after``: the GPUs it lacks),
  retried until carried out; it rejoins the pool (``serving_ready``) once warmed up, restored and ready.

Both are in the stored document (``gone``, ``returning``), so a restarted plane continues.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tidal.control.loan_book import Actions
from tidal.policy.ledger import LoanLedger
from tidal.policy.loan import LoanTiming
from tidal.serving.adapters import AdapterError, QueuedAdapter, ReadyAdapter, ServingAdapter

Event = tuple[str, str, dict | None]
"""What the loan step records: (kind, message, data)."""


def _restore_failed(node: str, gpus: int, error: object) -> Event:
    return ("serving_action_failed", f"restore of {gpus} GPUs on {node} (back after a loss) failed: {error}; "
            "retrying each step (the node does not serve meanwhile)",
            {"node": node, "gpus": gpus, "action": "restore"})


def lent_before(doc: Any, nodes: Mapping[str, int]) -> set[str]:
    """Serving nodes that may be missing when a plane starts: all of them with a stored loan document for the
    same ``serving.nodes`` (the loan step handles them), else none."""
    return set(nodes) if isinstance(doc, Mapping) and doc.get("nodes") == dict(nodes) else set()


class ServingNodes:
    """The configured serving nodes (``nodes``), the lost ones (``gone``) and those back and warming
    (``returning``); ``jobs_seen``: the jobs on each at the end of the last step."""

    def __init__(self, nodes: Mapping[str, int], adapter: ServingAdapter, timing: LoanTiming) -> None:
        self.nodes = dict(nodes)
        self.adapter, self.timing = adapter, timing
        self.gone: dict[str, dict[str, Any]] = {}
        self.returning: dict[str, dict[str, Any]] = {}
        self.jobs_seen: dict[str, list[str]] = {}

    def gpus(self, ledger: LoanLedger, node: str) -> int | None:
        """The GPUs ``node`` serves with (in the pool or warming in); None when it is lost."""
        if node in ledger.cap:
            return ledger.cap[node]
        return int(self.returning[node]["gpus"]) if node in self.returning else None

    def missing(self, ledger: LoanLedger, node: str) -> int:
        """GPUs ``node`` lacks against ``serving.nodes`` (it came back with fewer): the adapter counts
        them as not serving (``lent_after`` includes them)."""
        want = self.nodes.get(node, 0)
        have = self.gpus(ledger, node)
        return max(0, want - (want if have is None else have))

    @property
    def away(self) -> set[str]:
        """Nodes lost or not back in the pool yet."""
        return set(self.gone) | set(self.returning)

    def view(self, ledger: LoanLedger) -> dict[str, Any]:
        """The pool now and the serving nodes lost or back, for ``GET /v1/serving``."""
        return {"pool_nodes": dict(ledger.cap), "lost_nodes": {n: dict(v) for n, v in self.gone.items()},
                "returning_nodes": {n: {"gpus": v["gpus"], "ready_s": v["ready_s"],
                                        "told": bool(v.get("told"))} for n, v in self.returning.items()}}

    def track(self, present: Mapping[str, int], jobs_on: Mapping[str, Sequence[str]], now_s: float,
              ledger: LoanLedger, actions: Actions, stats: dict[str, float]) -> list[Event]:
        """Losses, returns and rejoins of serving nodes (module docstring); the events to record."""
        events: list[Event] = []
        present = {n: int(g) for n, g in present.items() if int(g) >= 1}  # no GPUs: serves nothing
        for node in self.nodes:
            if node not in present and node not in self.gone:
                events += self._lose(node, jobs_on, now_s, ledger, actions, stats)
            elif node in present and node in self.gone:
                events += self._back(node, present[node], now_s, ledger, actions, stats)
            elif node in present and self.gpus(ledger, node) not in (None, min(present[node],
                                                                              self.nodes[node])):
                # back with other GPUs between two steps (never seen gone): lost and back at once
                events += self._lose(node, jobs_on, now_s, ledger, actions, stats)
                events += self._back(node, present[node], now_s, ledger, actions, stats)
        for node in list(self.returning):
            events += self._rejoin(node, now_s, ledger, actions, stats)
        return events

    def outcome(self, node: str, action: str, error: str | None,
                stats: dict[str, float]) -> list[Event] | None:
        """A queued action's outcome that belongs here (None: the loan step's own): the restore that
        tells the adapter a node is back."""
        back = self.returning.get(node)
        if back is None or action != "restore":
            return None
        back["told"] = error is None
        if error is None:
            return [("serving_restored", f"restore of {back['gpus']} GPUs on {node} (back after a loss) "
                     "carried out", {"node": node, "gpus": back["gpus"]})]
        stats["restore_failures"] += 1
        return [_restore_failed(node, back["gpus"], error)]

    def _lose(self, node: str, jobs_on: Mapping[str, Sequence[str]], now_s: float, ledger: LoanLedger,
              actions: Actions, stats: dict[str, float]) -> list[Event]:
        jobs = sorted(set(jobs_on.get(node, ())) | set(self.jobs_seen.get(node, ())))
        back = self.returning.pop(node, None)
        if back is not None:  # lost again during its warm-up: none of it was in the pool
            lent, warming = 0, int(back["gpus"])
        else:
            lent, warming = ledger.drop_node(node)
        releasing, restoring, owed = actions.drop_node(node)
        held = lent - releasing  # what jobs could use there
        self.gone[node] = {"since_s": now_s, "lent": held, "jobs": jobs}
        stats["nodes_lost"] = stats.get("nodes_lost", 0) + 1
        parts = [f"its loans end ({held} GPUs lent" + (f", held by {', '.join(jobs)})" if jobs else ")")
                 if held else "nothing lent there"]
        if warming:
            parts.append(f"{warming} GPUs warming up there go with it")
        if releasing or restoring or owed:
            parts.append(f"actions there dropped (release {releasing}, restore {restoring + owed} GPUs)")
        msg = (f"serving node {node} lost{' during its warm-up' if back is not None else ''}: "
               + "; ".join(parts) + f"; nothing is reclaimed from it; the pool is now {ledger.total} GPUs")
        data: dict[str, Any] = {"node": node, "gpus": self.nodes[node], "lent_gpus": held, "jobs": jobs,
                                "warming_gpus": warming, "releasing": releasing,
                                "restoring": restoring + owed, "pool_gpus": ledger.total}
        return [("serving_node_lost", msg, data)]

    def _back(self, node: str, gpus: int, now_s: float, ledger: LoanLedger, actions: Actions,
              stats: dict[str, float]) -> list[Event]:
        want = self.nodes[node]
        have = min(gpus, want)
        info = self.gone.pop(node)
        t = self.timing
        self.returning[node] = {"since_s": now_s, "gpus": have, "ready_s": now_s + t.release_s + t.warmup_s,
                                "told": False}
        stats["nodes_back"] = stats.get("nodes_back", 0) + 1
        other = "" if gpus == want else f" with {gpus} GPUs (serving.nodes says {want}: {have} serve)"
        msg = (f"serving node {node} back{other} after {now_s - float(info['since_s']):.1f} s; it serves "
               "again after its warm-up and may be lent then")
        return [("serving_node_back", msg, {"node": node, "gpus": gpus, "serving_gpus": have,
                                            "ready_s": self.returning[node]["ready_s"]}),
                *self._tell(node, now_s, ledger, actions, stats)]

    def _tell(self, node: str, now_s: float, ledger: LoanLedger, actions: Actions,
              stats: dict[str, float]) -> list[Event]:
        """The restore that tells the adapter ``node`` is back (its GPUs, ``lent_after`` = those it
        lacks)."""
        back = self.returning[node]
        if back.get("told") or back.get("sent"):
            return []
        try:
            self.adapter.restore(node, int(back["gpus"]), self.missing(ledger, node), now_s)
        except AdapterError as e:
            first = not back.get("failed")
            back["failed"] = True
            stats["restore_failures"] += first
            return [_restore_failed(node, back["gpus"], e)] if first else []
        if isinstance(self.adapter, QueuedAdapter):
            back["sent"] = True  # its outcome comes through outcome(); not stored (sent again on restart)
            actions.add(actions.queued, node, 1)
        else:
            back["told"] = True
        return []

    def _rejoin(self, node: str, now_s: float, ledger: LoanLedger, actions: Actions,
                stats: dict[str, float]) -> list[Event]:
        back = self.returning[node]
        if not back.get("told"):
            return [] if back.get("sent") else self._tell(node, now_s, ledger, actions, stats)
        if now_s + 1e-9 < float(back["ready_s"]):
            return []
        if isinstance(self.adapter, ReadyAdapter) and not self.adapter.ready(node):
            return []
        del self.returning[node]
        gpus = int(back["gpus"])
        ledger.add_node(node, gpus, order=tuple(self.nodes))
        msg = (f"serving node {node} serves again ({gpus} GPUs, warm-up over): back in the pool "
               f"({ledger.total} GPUs), lendable again")
        return [("serving_ready", msg, {"node": node, "gpus": gpus, "rejoined": True})]

    def to_doc(self) -> dict[str, Any]:
        keep = ("since_s", "gpus", "ready_s", "told")
        return {"gone": self.gone,
                "returning": {n: {k: v for k, v in b.items() if k in keep}
                              for n, b in self.returning.items()}}

    def load(self, doc: Mapping[str, Any], pool: Mapping[str, int]) -> None:
        """Take the stored ``gone`` and ``returning`` of a loan document, checked against the configured
        nodes and the stored ledger's ``pool``; ``ValueError`` naming what is wrong (nothing changed)."""
        nodes = self.nodes
        gone = {str(n): dict(v) for n, v in (doc.get("gone") or {}).items()}
        returning = {str(n): dict(v) for n, v in (doc.get("returning") or {}).items()}
        for n, v in returning.items():
            if n not in nodes or not 1 <= int(v["gpus"]) <= nodes[n]:
                raise ValueError(f"returning[{n!r}]: {v.get('gpus')} GPUs, serving.nodes has "
                                 f"{nodes.get(n, 0)}")
            v["ready_s"], v["told"] = float(v["ready_s"]), bool(v.get("told"))
            v.pop("sent", None), v.pop("failed", None)
        for n, v in gone.items():
            if n not in nodes:
                raise ValueError(f"gone[{n!r}]: not a serving node")
            v["since_s"], v["lent"] = float(v["since_s"]), int(v.get("lent", 0))
            v["jobs"] = [str(j) for j in v.get("jobs", [])]
        both = set(gone) & set(returning) | (set(gone) | set(returning)) & set(pool)
        if both:
            raise ValueError(f"serving nodes {sorted(both)} both lost (or back) and in the pool")
        out = set(nodes) - set(pool) - set(gone) - set(returning)
        over = {n: g for n, g in pool.items() if g > nodes.get(n, 0)}
        if out or over:
            raise ValueError(f"serving state: the stored ledger has serving nodes {dict(pool)}, the adapter "
                             f"{dict(nodes)}; remove the serving document or keep the nodes")
        self.gone, self.returning = gone, returning

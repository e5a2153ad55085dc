"""Serving nodes lost and back while they lend (the loan step's helper; :mod:`tidal.control.loans`).

:meth:`tidal.control.loans.LiveLoans.tick` gets the serving nodes the executor has now (``present``:
on Ray a node removed or whose raylet died is no longer there) and calls :func:`track` first:

* **Lost** (a configured serving node not present): its loans end at once (a ``serving_node_lost``
  event naming the node, the GPUs lent there and the jobs that held them); nothing is reclaimed from
  it (the ledger's reclaims shrink by what was lent there), its GPUs leave the pool (serving and
  lent: the policy plans with the smaller ``N``), GPUs warming there go with it, and actions owed or
  in flight there are dropped (the outcomes of those in flight are ignored when they come). The spot
  jobs on it recover like any node loss (:mod:`tidal.control.node_watch`).
* **Back** (a lost node present again, ``serving_node_back``): the adapter is told with a restore of
  the GPUs it has now (``lent_after`` = the GPUs it lacks against ``serving.nodes``: a node that
  returns with fewer GPUs serves with those; more are not serving's), retried each step until it is
  carried out. It rejoins the pool only when its warm-up is over (``release_s + warmup_s``), the
  restore succeeded and, for a :class:`~tidal.serving.adapters.ReadyAdapter`, ``ready(node)`` (e.g.
  its Serve replicas run again): a ``serving_ready`` event; from then on it may be lent again.
  Lost again meanwhile, it is lost again (nothing of it was in the pool).

Both are in the stored document (``gone``, ``returning``), so a plane killed between the loss and the
return continues: the restarted plane neither lends on nor counts a lost node, and a node that came
back while it was down is a return at its first step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tidal.serving.adapters import AdapterError, QueuedAdapter, ReadyAdapter

if TYPE_CHECKING:
    from tidal.control.loans import Event, LiveLoans


def track(lo: LiveLoans, present: Mapping[str, int], jobs_on: Mapping[str, Sequence[str]],
          now_s: float) -> list[Event]:
    """Losses, returns and rejoins of serving nodes (module docstring); the events to record."""
    events: list[Event] = []
    present = {n: int(g) for n, g in present.items() if int(g) >= 1}  # a node with no GPUs serves nothing
    for node in lo.nodes:
        if node not in present and node not in lo.gone:
            events += _lose(lo, node, jobs_on, now_s)
        elif node in present and node in lo.gone:
            events += _back(lo, node, present[node], now_s)
        elif node in present and _gpus(lo, node) not in (None, min(present[node], lo.nodes[node])):
            # back with other GPUs between two steps (never seen gone): lost and back at once
            events += _lose(lo, node, jobs_on, now_s) + _back(lo, node, present[node], now_s)
    for node in list(lo.returning):
        events += _rejoin(lo, node, now_s)
    return events


def _gpus(lo: LiveLoans, node: str) -> int | None:
    """The GPUs ``node`` serves with (in the pool or warming in); None when it is lost."""
    if node in lo.ledger.cap:
        return lo.ledger.cap[node]
    return int(lo.returning[node]["gpus"]) if node in lo.returning else None


def missing(lo: LiveLoans, node: str) -> int:
    """GPUs ``node`` lacks against ``serving.nodes`` (it came back with fewer): the adapter counts them
    as not serving (``lent_after`` includes them)."""
    have = _gpus(lo, node)
    return max(0, lo.nodes.get(node, 0) - (lo.nodes.get(node, 0) if have is None else have))


def outcome(lo: LiveLoans, node: str, action: str, error: str | None) -> list[Event] | None:
    """A queued action's outcome that belongs here (None: the loan step's own): one sent to a node
    before it was lost (ignored), or the restore that tells the adapter a node is back."""
    if lo.stale.get(node):
        lo.stale[node] -= 1
        if not lo.stale[node]:
            del lo.stale[node]
        return []
    back = lo.returning.get(node)
    if back is None or action != "restore":
        return None
    back["told"] = error is None
    if error is None:
        return [("serving_restored", f"restore of {back['gpus']} GPUs on {node} (back after a loss) carried "
                 "out", {"node": node, "gpus": back["gpus"]})]
    lo.stats["restore_failures"] += 1
    return [("serving_action_failed", f"restore of {back['gpus']} GPUs on {node} (back after a loss) "
             f"failed: {error}; retrying each step (the node does not serve meanwhile)",
             {"node": node, "gpus": back["gpus"], "action": "restore"})]


def _lose(lo: LiveLoans, node: str, jobs_on: Mapping[str, Sequence[str]], now_s: float) -> list[Event]:
    jobs = sorted(set(jobs_on.get(node, ())) | set(lo.jobs_seen.get(node, ())))
    back = lo.returning.pop(node, None)
    if back is not None:  # lost again during its warm-up: none of it was in the pool
        lent, warming = 0, int(back["gpus"])
    else:
        lent, warming = lo.ledger.drop_node(node)
    releasing, restoring = lo.releasing.pop(node, 0), lo.restoring.pop(node, 0)
    owed = lo.pending_restores.pop(node, 0)
    inflight = lo.queued_on.pop(node, 0)
    if inflight:
        lo.stale[node] = lo.stale.get(node, 0) + inflight
    held = lent - releasing  # what jobs could use there
    lo.gone[node] = {"since_s": now_s, "lent": held, "jobs": jobs}
    lo.stats["nodes_lost"] = lo.stats.get("nodes_lost", 0) + 1
    parts = [f"its loans end ({held} GPUs lent" + (f", held by {', '.join(jobs)})" if jobs else ")")
             if held else "nothing lent there"]
    if warming:
        parts.append(f"{warming} GPUs warming up there go with it")
    if releasing or restoring or owed:
        parts.append(f"actions there dropped (release {releasing}, restore {restoring + owed} GPUs)")
    msg = (f"serving node {node} lost{' during its warm-up' if back is not None else ''}: " + "; ".join(parts)
           + f"; nothing is reclaimed from it; the pool is now {lo.ledger.total} GPUs")
    data: dict[str, Any] = {"node": node, "gpus": lo.nodes[node], "lent_gpus": held, "jobs": jobs,
                            "warming_gpus": warming, "releasing": releasing, "restoring": restoring + owed,
                            "pool_gpus": lo.ledger.total}
    lo.dirty()
    return [("serving_node_lost", msg, data)]


def _back(lo: LiveLoans, node: str, gpus: int, now_s: float) -> list[Event]:
    want = lo.nodes[node]
    have = min(gpus, want)
    info = lo.gone.pop(node)
    t = lo.timing
    lo.returning[node] = {"since_s": now_s, "gpus": have, "ready_s": now_s + t.release_s + t.warmup_s,
                          "told": False}
    lo.stats["nodes_back"] = lo.stats.get("nodes_back", 0) + 1
    other = "" if gpus == want else f" with {gpus} GPUs (serving.nodes says {want}: {have} serve)"
    msg = (f"serving node {node} back{other} after {now_s - float(info['since_s']):.1f} s; it serves again "
           "after its warm-up and may be lent then")
    lo.dirty()
    return [("serving_node_back", msg, {"node": node, "gpus": gpus, "serving_gpus": have,
                                        "ready_s": lo.returning[node]["ready_s"]}), *_tell(lo, node, now_s)]


def _tell(lo: LiveLoans, node: str, now_s: float) -> list[Event]:
    """The restore that tells the adapter ``node`` is back (its GPUs, ``lent_after`` = those it lacks)."""
    back = lo.returning[node]
    if back.get("told") or back.get("sent"):
        return []
    try:
        lo.adapter.restore(node, int(back["gpus"]), missing(lo, node), now_s)
    except AdapterError as e:
        first = not back.get("failed")
        back["failed"] = True
        lo.stats["restore_failures"] += first
        return [("serving_action_failed", f"restore of {back['gpus']} GPUs on {node} (back after a loss) "
                 f"failed: {e}; retrying each step (the node does not serve meanwhile)",
                 {"node": node, "gpus": back["gpus"], "action": "restore"})] if first else []
    if isinstance(lo.adapter, QueuedAdapter):
        back["sent"] = True  # the outcome comes through outcome(); not stored (sent again after a restart)
        lo.queued_on[node] = lo.queued_on.get(node, 0) + 1
    else:
        back["told"] = True
    lo.dirty()
    return []


def _rejoin(lo: LiveLoans, node: str, now_s: float) -> list[Event]:
    back = lo.returning[node]
    if not back.get("told"):
        return [] if back.get("sent") else _tell(lo, node, now_s)
    if now_s + 1e-9 < float(back["ready_s"]):
        return []
    if isinstance(lo.adapter, ReadyAdapter) and not lo.adapter.ready(node):
        return []
    del lo.returning[node]
    gpus = int(back["gpus"])
    lo.ledger.add_node(node, gpus, order=tuple(lo.nodes))
    lo.dirty()
    msg = (f"serving node {node} serves again ({gpus} GPUs, warm-up over): back in the pool "
           f"({lo.ledger.total} GPUs), lendable again")
    return [("serving_ready", msg, {"node": node, "gpus": gpus, "rejoined": True})]


def view(lo: LiveLoans) -> dict[str, Any]:
    """The pool now and the serving nodes lost or back, for ``GET /v1/serving``."""
    return {"pool_nodes": dict(lo.ledger.cap), "lost_nodes": {n: dict(v) for n, v in lo.gone.items()},
            "returning_nodes": {n: {"gpus": v["gpus"], "ready_s": v["ready_s"], "told": bool(v.get("told"))}
                                for n, v in lo.returning.items()}}


def lent_before(doc: Any, nodes: Mapping[str, int]) -> set[str]:
    """Serving nodes that may be missing from the cluster (or have other GPUs) when a plane starts: with
    a stored loan document written for the same ``serving.nodes``, all of them (a node lost, before or
    while the plane was down, is the loan step's to handle); else none (a fresh start checks the nodes
    strictly)."""
    return set(nodes) if isinstance(doc, Mapping) and doc.get("nodes") == dict(nodes) else set()


def check_doc(nodes: Mapping[str, int], pool: Mapping[str, int], gone: Any, returning: Any
              ) -> tuple[dict[str, dict], dict[str, dict]]:
    """The stored ``gone`` and ``returning`` of a loan document, checked against the configured
    ``nodes`` and the stored ledger's ``pool``; ``ValueError`` naming what is wrong."""
    gone = {str(n): dict(v) for n, v in (gone or {}).items()}
    returning = {str(n): dict(v) for n, v in (returning or {}).items()}
    for n, v in returning.items():
        if n not in nodes or not 1 <= int(v["gpus"]) <= nodes[n]:
            raise ValueError(f"returning[{n!r}]: {v.get('gpus')} GPUs, serving.nodes has {nodes.get(n, 0)}")
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
    return gone, returning

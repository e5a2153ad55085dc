"""Nodes joining and leaving the executor's pool, and jobs that lose one (the controller's helper).

The controller calls :meth:`NodeWatch.refresh` every step, :meth:`NodeWatch.node_lost` when a job's ranks went
with their node (kill the others; requeued once all are gone) and :meth:`NodeWatch.recovered` (its event once
the next attempt trains). The loss totals for the metrics and the losses not yet recovered from are one
document in the store (:data:`DOC_KEY`).
"""

from __future__ import annotations

from tidal.control.states import HELD
from tidal.control.store import JobRow, Store
from tidal.exec.protocol import Executor, Observation, RankState
from tidal.model import Node

DOC_KEY = "node_loss"
ZERO = {"losses": 0, "heartbeat_age_count": 0, "heartbeat_age_sum_s": 0.0, "recoveries": 0,
        "recovery_sum_s": 0.0}


def _doc(store: Store) -> dict:
    try:
        doc = store.get_doc(DOC_KEY)
    except ValueError:  # unreadable: counted afresh
        return {}
    return doc if isinstance(doc, dict) else {}


def totals(store: Store) -> dict:
    """Node losses of jobs so far: counts and sums (see the module docstring)."""
    out = {**ZERO, **_doc(store)}
    out.pop("pending", None)
    return out


def _pending(store: Store) -> dict[str, dict]:
    got = _doc(store).get("pending")
    return {str(k): v for k, v in got.items() if isinstance(v, dict)} if isinstance(got, dict) else {}


class NodeWatch:
    """See the module docstring. ``nodes`` is the controller's list, changed in place."""

    def __init__(self, store: Store, executor: Executor, nodes: list[Node]) -> None:
        self.store, self.executor, self.nodes = store, executor, nodes
        self.lost: dict[str, dict] = _pending(store)  # job -> its node loss, until it trains again
        self.departed: set[str] = set()  # nodes that left and still show (jobs hold GPUs there)

    def refresh(self, now_s: float) -> None:
        """The executor's nodes, read every step; joins and leaves are events. A node that left stays while
        jobs hold GPUs on it, with only those (none free). ``self.nodes`` (shared with the API) is changed in
        place."""
        live = self.executor.nodes()
        if live == self.nodes:
            return
        names = {n.name for n in live}
        held: dict[str, int] = {}
        for j in self.store.jobs(states=HELD) if any(n.name not in names for n in self.nodes) else ():
            for n, g in (j.placement or {}).items():
                held[n] = held.get(n, 0) + g
        gone = [Node(n.name, held[n.name], n.pool) for n in self.nodes
                if n.name not in names and held.get(n.name)]
        before = {n.name for n in self.nodes}
        for n in live:
            if n.name not in before or n.name in self.departed:
                self.departed.discard(n.name)
                self.store.record("node", f"node {n.name} joined ({n.gpus} GPUs, {n.pool} pool)", now_s,
                                  data={"node": n.name, "gpus": n.gpus, "joined": True})
        for n in self.nodes:
            if n.name not in names and n.name not in self.departed:
                self.departed.add(n.name)
                jobs = sorted(j.id for j in self.store.jobs(states=HELD) if n.name in (j.placement or {}))
                self.store.record("node", f"node {n.name} ({n.gpus} GPUs) left the cluster"
                                  + (f"; jobs on it: {', '.join(jobs)}" if jobs else ""), now_s,
                                  data={"node": n.name, "gpus": n.gpus, "left": True, "jobs": jobs})
        self.nodes[:] = [*live, *gone]
        self.departed &= {n.name for n in gone}

    def node_lost(self, job: JobRow, ob: Observation, lost: list[RankState], now_s: float) -> JobRow:
        """Ranks went with their node: stop the others (SIGKILL; nothing to wait for, the gang is broken)
        and requeue the job, once all are gone, to resume on the remaining GPUs (not a failure)."""
        nodes = sorted({r.node or "?" for r in lost})
        p = ob.progress
        beat = f"; last heartbeat {now_s - p.heartbeat_s:.1f} s ago" if p.heartbeat_s is not None else ""
        why = (f"node {', '.join(nodes)} lost with ranks {[r.rank for r in lost]} at step {p.step} "
               f"(newest checkpoint step {p.ckpt_step}{beat})")
        self.executor.kill(job.id)
        self.lost[job.id] = {"detected_s": now_s, "attempt": job.attempt, "nodes": nodes, "step": p.step,
                              "ckpt_step": p.ckpt_step, "world_size": len(ob.ranks)}
        age = None if p.heartbeat_s is None else now_s - p.heartbeat_s
        self.store.record(
            "node_lost", f"{why}: killing the other {len(ob.alive)} ranks", now_s, job=job,
            data={**self.lost[job.id], "ranks": [r.rank for r in lost], "since_heartbeat_s": age})
        t = totals(self.store)
        t["losses"] += 1
        if age is not None:
            t["heartbeat_age_count"] += 1
            t["heartbeat_age_sum_s"] += age
        self._save(t, now_s)
        return self.store.update(job, stop_reason="node_lost", killed=True, message=why)

    def recovered(self, job: JobRow, ob: Observation, now_s: float) -> None:
        """A job requeued after a node loss trains again: the ``recovered`` event (detection to the first
        step of the new attempt, where it restored from)."""
        info = self.lost.get(job.id)
        p = ob.progress
        if info is None or ob.attempt <= info["attempt"] or p.first_step is None:
            return
        del self.lost[job.id]
        took = (p.first_step_s or now_s) - info["detected_s"]
        lost_steps = max(0, (info["step"] or 0) - (p.start_step or 0))  # none if the attempt had not stepped
        self.store.record(
            "recovered", f"training again {took:.1f} s after the loss of node {', '.join(info['nodes'])} was "
            f"detected: {len(ob.ranks)} ranks (were {info['world_size']}), restored step {p.start_step} from "
            f"tier {p.restore_tier}; {lost_steps} steps to redo", now_s, job=job,
            data={"recovery_s": took, "detected_s": info["detected_s"], "world_size": len(ob.ranks),
                  "was_world_size": info["world_size"], "start_step": p.start_step,
                  "restore_tier": p.restore_tier, "lost_steps": lost_steps, "nodes": info["nodes"]})
        t = totals(self.store)
        t["recoveries"] += 1
        t["recovery_sum_s"] += took
        self._save(t, now_s)

    def forget(self, job_id: str, now_s: float | None = None) -> None:
        """The job ended for good: it will not train again."""
        if self.lost.pop(job_id, None) is not None and now_s is not None:
            self._save(totals(self.store), now_s)

    def _save(self, t: dict, now_s: float) -> None:
        self.store.put_doc(DOC_KEY, {**t, "pending": self.lost}, now_s)

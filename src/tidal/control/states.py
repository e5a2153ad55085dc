"""The job state machine: one table of legal transitions (:data:`TRANSITIONS`). The store refuses anything
else and records every transition as an event, with the reason (:meth:`tidal.control.store.Store.transition`).
The diagram and when each edge is taken: docs/control.md, "Job states: one table". ``pending`` and
``backoff`` hold nothing; ``succeeded``, ``failed`` and ``cancelled`` are terminal; a held job goes back
to ``pending`` only in recovery (a restarted plane that finds none of its workers).
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"
    RUNNING = "running"
    RESIZING = "resizing"
    PREEMPTING = "preempting"
    CANCELLING = "cancelling"
    BACKOFF = "backoff"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = State
_ENDINGS = {S.SUCCEEDED, S.FAILED, S.BACKOFF, S.PENDING, S.CANCELLING}

# The one table. Key: from; value: the states it may move to.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.PENDING: frozenset({S.ADMITTED, S.CANCELLED}),
    S.ADMITTED: frozenset({S.RUNNING, S.RESIZING, S.PREEMPTING} | _ENDINGS),
    S.RUNNING: frozenset({S.RESIZING, S.PREEMPTING} | _ENDINGS),
    S.RESIZING: frozenset({S.ADMITTED, S.PREEMPTING} | _ENDINGS),
    S.PREEMPTING: frozenset(_ENDINGS),
    S.CANCELLING: frozenset({S.CANCELLED, S.SUCCEEDED}),
    S.BACKOFF: frozenset({S.PENDING, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

HELD = frozenset({S.ADMITTED, S.RUNNING, S.RESIZING, S.PREEMPTING, S.CANCELLING})
"""States in which a job holds GPUs (a placement) and may have worker processes."""
STOPPING = frozenset({S.RESIZING, S.PREEMPTING, S.CANCELLING})
"""Held states in which the job has been told to stop (a notice was sent)."""
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
ACTIVE = frozenset(State) - TERMINAL


class IllegalTransition(ValueError):
    """A transition that the table does not allow (a bug in the caller, or a race it lost)."""

    def __init__(self, job_id: str, old: str, new: str) -> None:
        allowed = sorted(s.value for s in TRANSITIONS.get(State(old), ())) if old in set(State) else []
        super().__init__(f"job {job_id}: illegal transition {old} -> {new} (from {old}: {allowed or 'none'})")
        self.job_id, self.old, self.new = job_id, old, new


def check_transition(job_id: str, old: str, new: str) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    try:
        ok = State(new) in TRANSITIONS[State(old)]
    except ValueError:
        ok = False
    if not ok:
        raise IllegalTransition(job_id, old, new)

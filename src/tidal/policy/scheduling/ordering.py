"""Who goes first: aged priority, then fair-share deficit, then waiting time.

Pending jobs wait in one FIFO per (tenant, kind, priority) (see :func:`tidal.model.queue_key`),
ordered by when they (re)entered it (``Job.queued_s``: submission, or the last preemption). Aging
adds the same amount per second of waiting to every job, so within one such queue the oldest job is
always the most aged one: only queue *heads* ever compete, and :class:`QueueHeads` merges them with a
heap. A call that admits k jobs from Q queues costs O((Q + k) log Q), whatever the queue lengths.

A job for which others were shrunk or preempted (``Job.nominated_s``) stands first in its queue
(:func:`tidal.model.arrival`) and, within ``SchedulerConfig.nomination_ttl_s``, first in the merge:
every key below starts with ``nominated lately ? 0 : 1``. (A nomination older than that keeps the
job at the front of its own queue, where it was anyway when it preempted.)

Keys (smaller first), after that flag:

* dedicated: ``(-aged priority, queued_s, id)``. Each tenant's dedicated jobs only compete for its
  own quota, so fairness between tenants has nothing to order here.
* spot: ``(-aged priority, share, queued_s, id)`` where ``share`` is the tenant's spot GPUs over its
  weighted fair share (:meth:`Cycle.share`): among equal priorities, the tenant furthest below its
  share goes first. Aging is counted in whole levels so that ties on priority are common and the
  share decides them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from tidal.model import Job
from tidal.policy.scheduling.config import SchedulerConfig


def aged_priority(job: Job, now_s: float, cfg: SchedulerConfig) -> int:
    """``priority + min(aging_max_levels, floor((now - queued_s) * aging_per_s))``."""
    wait_s = now_s - job.queued_s
    if wait_s <= 0 or cfg.aging_per_s <= 0:
        return job.priority
    return job.priority + min(cfg.aging_max_levels, int(wait_s * cfg.aging_per_s))


class QueueHeads:
    """Pop pending jobs across FIFO queues in key order.

    ``key`` may change during the call (a tenant's share grows as its jobs are admitted). Stored keys
    are re-checked when popped: a head whose key moved is pushed back with its new key. This is
    exact when keys only grow, which is the case for admissions; preemptions lower a victim
    tenant's share, and its heads are then seen a little later than an exact order would (by design
    cheaper than re-keying every queue).
    """

    def __init__(self, queues: Sequence[Sequence[Job]], key: Callable[[Job], tuple]) -> None:
        self._queues = queues
        self._pos = [0] * len(queues)
        self._key = key
        self._heap = [(key(q[0]), i) for i, q in enumerate(queues) if q]
        heapq.heapify(self._heap)
        self._dead: set[int] = set()
        self._last = -1

    def drop_queue_of_last(self) -> None:
        """Forget the rest of the queue the last popped job came from (nothing in it can run now)."""
        self._dead.add(self._last)

    def pop(self) -> Job | None:
        heap, key = self._heap, self._key
        while heap:
            k, i = heap[0]
            if i in self._dead:
                heapq.heappop(heap)
                continue
            q = self._queues[i]
            job = q[self._pos[i]]
            k2 = key(job)
            if k2 != k:
                heapq.heapreplace(heap, (k2, i))
                continue
            self._pos[i] += 1
            self._last = i
            if self._pos[i] < len(q):
                heapq.heapreplace(heap, (key(q[self._pos[i]]), i))
            else:
                heapq.heappop(heap)
            return job
        return None

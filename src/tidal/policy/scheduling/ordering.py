"""Who goes first: lately nominated, then aged priority, then (spot) fair-share deficit, then waiting
time. Only queue heads compete (aging keeps each FIFO in order), merged by :class:`QueueHeads`
(docs/scheduling.md, "One call, step by step")."""

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
    """Pop pending jobs across FIFO queues in key order. A head whose key moved during the call is pushed
    back with its new key when popped: exact while keys only grow (admissions)."""

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

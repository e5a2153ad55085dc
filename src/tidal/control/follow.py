"""Following a job from the command line: its rank logs as whole lines, through restarts of ``tidal up``.

A call that cannot reach the API, or gets a 5xx, is retried on a fresh client (a restarted plane may write a
new ``api.url``) after saying so once; any other error ends the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tidal.contract import EXIT_PREEMPTED
from tidal.control.client import ApiError, TidalClient

T = TypeVar("T")
TAIL_BYTES = 16384  # read this much of a log's end for its last lines
RETRY_NOTE_S = 30.0  # while the API is away, say so again this often


def transient(e: ApiError) -> bool:
    """The API is away (no connection) or failing (5xx): worth retrying, unlike a 4xx."""
    return e.status == 0 or e.status >= 500


class Reconnecting:
    """Calls on a client made by ``make``; a transient failure is retried every ``poll_s`` on a new one, and
    ``say`` told when the API goes away (again every ``RETRY_NOTE_S``) and when it is back."""

    def __init__(self, make: Callable[[], TidalClient], say: Callable[[str], None], poll_s: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.make, self.say, self.poll_s, self.sleep = make, say, poll_s, sleep
        self.client = make()
        self.away_since: float | None = None

    def call(self, fn: Callable[[TidalClient], T]) -> T:
        noted = 0.0
        while True:
            try:
                out = fn(self.client)
            except ApiError as e:
                if not transient(e):
                    raise
                now = time.monotonic()
                if self.away_since is None:
                    self.away_since = noted = now
                    self.say(f"lost the Tidal API ({e}); retrying until it is back (Ctrl-C to stop)")
                elif now - noted >= RETRY_NOTE_S:
                    noted = now
                    self.say(f"the Tidal API has been away for {now - self.away_since:.0f} s; still retrying")
                self.sleep(self.poll_s)
                self.client.close()
                self.client = self.make()
                continue
            if self.away_since is not None:
                self.say(f"the Tidal API is back after {time.monotonic() - self.away_since:.1f} s")
                self.away_since = None
            return out


class LogFollower:
    """Whole lines of a job's rank logs, from where the last call stopped (one offset per rank)."""

    def __init__(self, job_id: str, ranks: list[int]) -> None:
        self.job_id, self.ranks = job_id, ranks
        self.offsets = dict.fromkeys(ranks, 0)
        self.partial = dict.fromkeys(ranks, "")
        self.unsaid: list[tuple[int, str]] = []  # read by a call that then failed: the next call returns them
        self.done = False

    def poll(self, c: TidalClient) -> list[tuple[int, str]]:
        """New whole lines as ``(rank, line)`` (without the newline), each rank's in order; sets ``done``
        once the job has ended and every rank's log was read to its end. A call that fails part way (the API
        went away after some ranks were read) loses nothing: the next call returns those lines first."""
        out = self.unsaid
        done = True
        for r in self.ranks:
            while True:
                chunk = c.logs(self.job_id, rank=r, offset=self.offsets[r])
                self.offsets[r] = chunk["offset"]
                text = self.partial[r] + chunk["data"]
                *lines, self.partial[r] = text.split("\n")
                out += [(r, ln) for ln in lines]
                if chunk["offset"] >= chunk["size"] or not chunk["data"]:
                    break
            done = done and chunk["done"] and chunk["offset"] >= chunk["size"]
        self.done = done
        self.unsaid = []
        return out

    def rest(self) -> list[tuple[int, str]]:
        """Lines not ended by a newline yet (at the end of the job, or when the follower stops)."""
        out = [(r, p) for r, p in self.partial.items() if p]
        self.partial = dict.fromkeys(self.ranks, "")
        return out


def failing_rank(events: list[dict]) -> int | None:
    """The rank whose log explains the last failed attempt: the first exiting above 0 but not 75, else the
    first that vanished, else the first killed by a signal but SIGKILL/SIGTERM; None if none failed."""
    for e in reversed(events):
        if e.get("kind") != "transition" or e.get("to") not in ("backoff", "failed"):
            continue
        codes = (e.get("data") or {}).get("exit_codes") or []
        for test in (lambda c: c is not None and c > 0 and c != EXIT_PREEMPTED, lambda c: c is None,
                     lambda c: c is not None and c < 0 and c not in (-9, -15)):
            for rank, code in enumerate(codes):
                if test(code):
                    return rank
        return 0
    return None


def log_tail(c: TidalClient, job_id: str, rank: int, lines: int = 12) -> list[str]:
    """The last ``lines`` non-empty lines of a rank's log (every attempt's output, newest last)."""
    size = c.logs(job_id, rank=rank, offset=0, limit=1)["size"]
    start = max(0, size - TAIL_BYTES)
    data = c.logs(job_id, rank=rank, offset=start, limit=TAIL_BYTES)["data"]
    got = data.split("\n")
    if start > 0:
        got = got[1:]  # the first line may be cut
    return [ln for ln in got if ln.strip()][-lines:]

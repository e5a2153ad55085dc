"""The agent's replicator: pushes everything this node's ranks hand the agent to its buddy agent.

One thread pushes in arrival order, so a *sync* request (a sidecar, the manifest) is answered only once
every earlier object of the step is at the buddy. A ``Handoff`` is pushed from the staging slot before
its local copy, a ``Growing`` file while it is copied in. When idle, every ``resync_s``, committed steps
the buddy lacks are pushed, manifest last; it never deletes at the buddy on its own (only the job's
removals are forwarded). Bodies go with ``sendfile`` to ``/v1/replicas/<node>/...``."""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tidal.ckpt.agent.store import MANIFEST, Store, step_dirname
from tidal.ckpt.tiers.peer import AgentClient

log = logging.getLogger("tidal.ckpt.agent")
PUSH_CHUNK = 64 << 20  # bytes per sendfile call: how often a push reports progress


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Growing:
    """A file being copied in; a push may send the bytes copied so far and wait for the rest."""

    size: int
    copied: int = 0
    error: str | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)

    def advance(self, n: int) -> None:
        with self.cond:
            self.copied += n
            self.cond.notify_all()

    def fail(self, why: str) -> None:
        with self.cond:
            self.error = why
            self.cond.notify_all()

    def available(self, pos: int) -> int:
        """Block until more than ``pos`` bytes are copied; return how many are."""
        with self.cond:
            while self.copied <= pos and self.error is None:
                self.cond.wait(5.0)
            if self.error is not None:
                raise OSError(f"copy failed: {self.error}")
            return self.copied


@dataclass(eq=False)
class Handoff:
    """A data file read from a rank's staging slot: pushed to the buddy first, then copied here; the
    rank keeps the slot unchanged until ``copied`` is set. ``pushed``/``copied``: None while running,
    then "" or why it failed. The copy starts when the push ends or stalls for ``stall_s``. Thread-safe.
    """

    size: int
    sent: int = 0
    pushed: str | None = None
    copied: str | None = None
    cancelled: bool = False  # removed (retention, discard) while in flight: do not make it visible
    finished_at: float | None = None  # monotonic time the copy ended
    cond: threading.Condition = field(default_factory=threading.Condition)

    def progress(self, sent: int) -> None:
        with self.cond:
            self.sent = sent
            self.cond.notify_all()

    def push_done(self, error: str | None) -> None:
        with self.cond:
            self.pushed = error or ""
            self.cond.notify_all()

    def copy_done(self, error: str | None) -> None:
        with self.cond:
            self.copied = error or ""
            self.finished_at = time.monotonic()
            self.cond.notify_all()

    def wait_push(self, stall_s: float) -> None:
        """Block until the push ended or made no progress for ``stall_s`` seconds."""
        with self.cond:
            last, since = self.sent, time.monotonic()
            while self.pushed is None:
                self.cond.wait(stall_s / 4)
                now = time.monotonic()
                if self.sent != last:
                    last, since = self.sent, now
                elif now - since >= stall_s:
                    return

    def wait_copied(self, timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.copied is not None, timeout_s)


@dataclass(eq=False)
class _Item:
    kind: str  # "push" (background), "sync" (a caller waits), "delete"
    job: str
    step: int
    name: str | None
    fd: int | None = None
    size: int = 0
    growing: Growing | None = None
    handoff: Handoff | None = None
    done: threading.Event | None = None
    error: str | None = None


class Replicator:
    """Pushes this node's objects to the buddy agent, in order, from one thread."""

    def __init__(self, store: Store, node: str, buddy: str | None, *, resync_s: float = 2.0,
                 timeout_s: float = 120.0, handoffs: Callable[[str, int], dict[str, Handoff]] | None = None,
                 token: str | None = None) -> None:
        self.store, self.node = store, node
        self._handoffs = handoffs  # (job, step) -> data files of the step being handed off (name -> Handoff)
        self.client = AgentClient(buddy, timeout_s=timeout_s, token=token) if buddy else None
        self.resync_s = resync_s
        self._cond = threading.Condition()
        self._items: deque[_Item] = deque()
        self._remote: dict[str, dict[int, dict[str, int]]] | None = None  # the buddy's copy of our tree
        self._closing = False
        self.reachable: bool | None = None
        self.last_error: str | None = None
        self.last_error_unix_s: float | None = None
        self.pushing: str | None = None
        self.pushed_bytes = 0
        self._thread = threading.Thread(target=self._run, name="tidal-agent-replicator", daemon=True)
        if self.client is not None:
            self._thread.start()

    # -- called by request threads -----------------------------------------------------------------
    def push_later(self, job: str, step: int, name: str, fd: int, size: int, growing: Growing | None = None,
                   handoff: Handoff | None = None) -> None:
        """Push an object in the background (``fd`` is closed afterwards); ``handoff`` hears how it went."""
        if self.client is None:
            os.close(fd)
            if handoff is not None:
                handoff.push_done("no buddy")
            return
        self._put(_Item("push", job, step, name, fd, size, growing, handoff))

    def sync(self, job: str, step: int, name: str, path: Path, timeout_s: float) -> None:
        """Return once the buddy holds every visible object of the step and then ``path`` as ``name``."""
        if self.client is None:
            return
        fd = os.open(path, os.O_RDONLY)
        done = threading.Event()
        item = _Item("sync", job, step, name, fd, os.fstat(fd).st_size, done=done)
        self._put(item)
        if not done.wait(timeout_s):
            raise HTTPError(503, f"buddy {self.client.address} did not take step {step} within "
                                 f"{timeout_s:.0f} s")
        if item.error is not None:
            raise HTTPError(503, f"buddy {self.client.address}: {item.error}")

    def forget(self, job: str, step: int, name: str | None) -> None:
        if self.client is not None:
            self._put(_Item("delete", job, step, name))

    def _put(self, item: _Item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def status(self) -> dict | None:
        if self.client is None:
            return None
        with self._cond:
            queued = len(self._items)
        return {"address": self.client.address, "reachable": self.reachable, "last_error": self.last_error,
                "last_error_unix_s": self.last_error_unix_s, "queued": queued, "pushing": self.pushing,
                "pushed_bytes": self.pushed_bytes}

    def replicated(self, job: str, step: int, files: dict[str, int]) -> bool | None:
        """Whether the buddy holds this own step as ``files`` (as last seen); None without a buddy."""
        remote = self._remote
        if self.client is None or remote is None:
            return None
        have = remote.get(job, {}).get(step, {})
        return all(have.get(n) == s for n, s in files.items())

    # -- the replicator thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._items and not self._closing:
                    self._cond.wait(self.resync_s)
                if self._closing:
                    left, self._items = list(self._items), deque()
                    break
                item = self._items.popleft() if self._items else None
            if item is None:
                self._guard(self._resync)
            else:
                self._process(item)
        for it in left:
            it.error = "the agent is stopping"
            self._finish(it)

    def _guard(self, fn, *args) -> str | None:
        try:
            fn(*args)
        except Exception as e:
            why = f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
            repeated = why == self.last_error and self.reachable is False
            self.reachable = False
            self.last_error, self.last_error_unix_s = why, time.time()
            self._remote = None  # re-read the buddy's state before trusting it again
            log.log(logging.DEBUG if repeated else logging.WARNING, "replication to %s: %s",
                    self.client.address if self.client else "-", why)
            return why
        return None

    def _process(self, it: _Item) -> None:
        try:
            if it.kind == "push":
                it.error = self._guard(self._push, it.job, it.step, it.name, it.fd, it.size, it.growing,
                                       it.handoff)
            elif it.kind == "sync":
                it.error = self._guard(self._sync, it)
            else:
                it.error = self._guard(self._delete, it.job, it.step, it.name)
        finally:
            self._finish(it)

    @staticmethod
    def _finish(it: _Item) -> None:
        """Release what an item holds and tell its waiters (with ``it.error``, None when it worked)."""
        if it.fd is not None:
            os.close(it.fd)
        if it.handoff is not None:
            it.handoff.push_done(it.error)
        if it.done is not None:
            it.done.set()

    def _sync(self, it: _Item) -> None:
        self._ensure_step(it.job, it.step)
        if it.name == MANIFEST and self._handoffs is not None:
            # A handed-off file reached the buddy by its own (earlier) push, or goes from the local copy.
            for name, h in self._handoffs(it.job, it.step).items():
                if self._remote_index().get(it.job, {}).get(it.step, {}).get(name) == h.size:
                    continue
                if self.store.step_files(None, it.job, it.step).get(name) != h.size:
                    raise OSError(f"data file {name} is not at the buddy (push: {h.pushed or 'running'}) and "
                                  "still being copied in here")
                self._ensure_step(it.job, it.step)  # the local copy is whole now: push it from there
        assert it.name is not None and it.fd is not None  # a sync names its file, open
        self._push(it.job, it.step, it.name, it.fd, it.size, None)

    def _remote_index(self) -> dict[str, dict[int, dict[str, int]]]:
        if self._remote is None:
            assert self.client is not None
            doc = self.client.json("GET", f"/v1/replicas/{urllib.parse.quote(self.node, safe='')}")
            self._remote = {j: {int(s): dict(f) for s, f in st.items()} for j, st in doc["jobs"].items()}
            self.reachable = True
        return self._remote

    def _ensure_step(self, job: str, step: int, with_manifest: bool = False) -> None:
        have = self._remote_index().get(job, {}).get(step, {})
        files = self.store.step_files(None, job, step)
        for name, size in sorted(files.items(), key=lambda kv: kv[0] == MANIFEST):
            if (name != MANIFEST or with_manifest) and have.get(name) != size:
                try:
                    fd = os.open(self.store.step_dir(None, job, step) / name, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # removed meanwhile (retention)
                try:
                    self._push(job, step, name, fd, os.fstat(fd).st_size, None)
                finally:
                    os.close(fd)

    def _resync(self) -> None:
        """Push committed own steps the buddy lacks (it restarted empty, or was down for a while)."""
        self._remote = None
        remote = self._remote_index()
        for job, steps in self.store.tree_index(None).items():
            for step, files in steps.items():
                have = remote.get(job, {}).get(step, {})
                if MANIFEST in files and any(have.get(n) != s for n, s in files.items()):
                    assert self.client is not None  # (_push needs it too)
                    log.info("resync: pushing %s step %d to %s", job, step, self.client.address)
                    self._ensure_step(job, step, with_manifest=True)

    def _path(self, job: str, step: int, name: str | None) -> str:
        q = urllib.parse.quote
        p = f"/v1/replicas/{q(self.node, safe='')}/{q(job, safe='')}/{step_dirname(step)}"
        return p + (f"/{q(name, safe='')}" if name else "")

    def _push(self, job: str, step: int, name: str, fd: int, size: int, growing: Growing | None,
              handoff: Handoff | None = None) -> None:
        assert self.client is not None
        self.pushing = f"{job}/{step_dirname(step)}/{name}"
        try:
            for attempt in (0, 1):
                conn, reused = self.client.connection(fresh=attempt == 1)
                try:
                    conn.putrequest("PUT", self._path(job, step, name), skip_accept_encoding=True)
                    conn.putheader("Content-Length", str(size))
                    for k, v in self.client.headers.items():
                        conn.putheader(k, v)
                    conn.endheaders()
                    with open(fd, "rb", closefd=False) as f:
                        sent = 0
                        while sent < size:
                            upto = size if growing is None else growing.available(sent)
                            sent += conn.sock.sendfile(f, sent, min(upto - sent, PUSH_CHUNK))
                            if handoff is not None:
                                handoff.progress(sent)
                    resp = conn.getresponse()
                    body = resp.read()
                except OSError:
                    self.client.drop()
                    if reused and attempt == 0:
                        continue
                    raise
                if resp.status != 200:
                    raise OSError(f"buddy {self.client.address} refused {name}: HTTP {resp.status} "
                                  f"{body[:200].decode(errors='replace')}")
                break
        finally:
            self.pushing = None
        self.reachable = True
        self.pushed_bytes += size
        if self._remote is not None:
            self._remote.setdefault(job, {}).setdefault(step, {})[name] = size

    def _delete(self, job: str, step: int, name: str | None) -> None:
        assert self.client is not None
        status, body = self.client.request("DELETE", self._path(job, step, name))
        if status != 200:
            raise OSError(f"buddy refused DELETE: HTTP {status}")
        if self._remote is not None:
            steps = self._remote.get(job, {})
            if name is None:
                steps.pop(step, None)
            else:
                steps.get(step, {}).pop(name, None)

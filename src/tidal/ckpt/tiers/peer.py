"""The peer-memory tier: steps held in node memory by checkpoint agents and replicated to a buddy.

``PeerTier`` writes to this node's agent (``agent``, default ``TIDAL_CKPT_AGENT``): data files are
handed off (the agent reads the staging slot), small objects written in sync (answered once the buddy
holds them). Reads and listings see the union of the local agent, its buddy and ``peers`` (default
``TIDAL_CKPT_PEERS``), with HTTP Range requests; unreachable agents are skipped, ``TierError`` only when
none answers (or one refuses: 403). Thread-safe. See docs/checkpoint.md, "Peer memory"."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

from tidal.ckpt.agent.auth import agent_token, parse_key
from tidal.ckpt.agent.auth import headers as auth_headers
from tidal.ckpt.errors import SaveError, TierError, TierSpecError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.protocol import TruncatedRead
from tidal.contract import (
    ENV_CKPT_AGENT,
    ENV_CKPT_AGENT_KEY,
    ENV_CKPT_AGENT_TOKEN,
    ENV_CKPT_PEERS,
    ENV_JOB_ID,
)

log = logging.getLogger(__name__)

OPTIONS = {
    "agent": f"this node's agent, host:port (default: ${ENV_CKPT_AGENT})",
    "peers": f"more agents to read from, a list of host:port (default: ${ENV_CKPT_PEERS}, comma-separated)",
    "job": "the job's namespace in the agents (default: derived from the job's first durable tier, or "
           f"{ENV_JOB_ID})",
    "timeout_s": "seconds to wait for an agent's answer, e.g. while it replicates a step (default 300; "
                 "an agent gives up on its buddy after 240)",
    "connect_timeout_s": "TCP connect timeout, seconds (default 2)",
}


def parse_address(value: Any, where: str = "agent", *, any_port: bool = False) -> str:
    """``host:port`` (an ``http://`` prefix and a trailing ``/`` are accepted; port 0 only with
    ``any_port``, for a server to bind); TierSpecError naming ``where`` if malformed."""
    host, sep, port = str(value).strip().removeprefix("http://").rstrip("/").rpartition(":")
    low = 0 if any_port else 1
    if not sep or not host or "/" in host or not port.isdigit() or not low <= int(port) < 65536:
        raise TierSpecError(f"{where} {value!r}: expected host:port, e.g. 127.0.0.1:7070")
    return f"{host}:{int(port)}"


def env_token() -> str | None:
    """What to show the agents: ``$TIDAL_CKPT_AGENT_TOKEN`` (a job's, from its executor), else the
    agent token of ``$TIDAL_CKPT_AGENT_KEY`` (the plane's key: an operator's ``tidal ckpt``), else none."""
    token = os.environ.get(ENV_CKPT_AGENT_TOKEN)
    if token:
        if not token.isascii() or not token.isalnum():
            raise TierSpecError(f"${ENV_CKPT_AGENT_TOKEN}: expected the hex token the executor sets")
        return token
    key = os.environ.get(ENV_CKPT_AGENT_KEY)
    try:
        return agent_token(parse_key(key, f"${ENV_CKPT_AGENT_KEY}")) if key else None
    except ValueError as e:
        raise TierSpecError(str(e)) from None


def env_peers() -> list[str]:
    return [p.strip() for p in os.environ.get(ENV_CKPT_PEERS, "").split(",") if p.strip()]


class _Conn(http.client.HTTPConnection):
    """A short connect timeout, a longer I/O timeout and TCP_NODELAY."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, timeout_s: float) -> None:
        super().__init__(host, port, timeout=connect_timeout_s)
        self.io_timeout_s = timeout_s

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(self.io_timeout_s)


class Unreachable(TierError):
    """The agent did not answer (refused, reset, timed out)."""


class AgentClient:
    """Requests to one agent, one kept-alive connection per thread. Thread-safe."""

    def __init__(self, address: str, *, timeout_s: float = 120.0, connect_timeout_s: float = 2.0,
                 token: str | None = None) -> None:
        self.address = address
        self.headers = auth_headers(token)  # sent with every request (``Authorization``; none: open agents)
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.failed_at: float | None = None  # monotonic time of the last failure, None after a success
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"AgentClient({self.address!r})"

    def connection(self, fresh: bool = False) -> tuple[_Conn, bool]:
        """(this thread's connection, whether it was used before)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and not fresh:
            return conn, True
        self.drop()
        conn = self._local.conn = _Conn(self.host, self.port, self.connect_timeout_s, self.timeout_s)
        return conn, False

    def drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                into: memoryview | None = None) -> tuple[int, Any]:
        """Send one request; return (status, body bytes), or (status, count read) when ``into`` is given
        and the answer is 2xx: the body is read straight into ``into`` (at most its length). A kept-alive
        connection the agent closed meanwhile is retried once on a fresh one, else ``Unreachable``."""
        for attempt in (0, 1):
            conn, reused = self.connection(fresh=attempt == 1)
            try:
                conn.request(method, path, body=body, headers={**(headers or {}), **self.headers})
                resp = conn.getresponse()
                if into is not None and 200 <= resp.status < 300:
                    got = _read_into(resp, into)
                    if not resp.isclosed():
                        resp.read()  # a longer answer than asked for: drain it, keep the connection
                    self.failed_at = None
                    return resp.status, got
                data = resp.read()
                self.failed_at = None
                return resp.status, data
            except (OSError, http.client.HTTPException) as e:
                self.drop()
                if reused and attempt == 0 and not isinstance(e, TimeoutError):
                    continue
                self.failed_at = time.monotonic()
                raise Unreachable(f"agent {self.address} unreachable: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def json(self, method: str, path: str, body: Any = None) -> Any:
        status, data = self.request(method, path, body)
        if status != 200:
            raise _error(status, data, f"agent {self.address} {method} {path}")
        return json.loads(data)


def _read_into(resp: http.client.HTTPResponse, out: memoryview) -> int:
    got = 0
    while got < len(out):
        n = resp.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def _error(status: int, data: Any, what: str) -> Exception:
    """An HTTP error answer as the exception the Tier protocol calls for: FileNotFoundError (404),
    SaveError (409: the agent refused the commit; final for this step), else TierError (retried)."""
    try:
        msg = json.loads(data)["error"]
    except Exception:
        msg = bytes(data)[:300].decode(errors="replace") if isinstance(data, (bytes, bytearray)) else ""
    text = f"{what}: HTTP {status}: {msg}"
    if status == 404:
        return FileNotFoundError(2, text, what)
    if status == 409:
        return SaveError(text)
    return TierError(text)


def _q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


class PeerTier:
    """Committed steps in checkpoint agents' memory, namespace ``job``. See the module docstring."""

    kind = "peer"
    durable = True  # survives the node (and its memory) being lost: the buddy holds every committed step
    fast = False  # an upload queue feeds it (remote.RemoteQueue)
    poll_s = (0.002, 0.05)

    def __init__(self, job: str, *, name: str = "peer", agent: str | None = None,
                 peers: Sequence[str] | None = None, timeout_s: float = 300.0, connect_timeout_s: float = 2.0,
                 token: str | None = None) -> None:
        self.name, self.job = name, job
        self.token = token or env_token()
        self.location = f"peer://{job}"
        address = agent or os.environ.get(ENV_CKPT_AGENT) or None
        self.agent_address = parse_address(address, f"tier '{name}': agent") if address else None
        if isinstance(peers, str):
            peers = [p for p in peers.split(",") if p.strip()]
        self.peer_addresses = [parse_address(p, f"tier '{name}': peer") for p in (env_peers() if peers is None
                                                                                    else peers)]
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self._clients: dict[str, AgentClient] = {}
        self._lock = threading.Lock()
        self._buddy: str | None = None
        self._buddy_at = -1e9
        self._held: set[tuple[int, str]] = set()  # handoffs whose slot the local agent may still read

    def __repr__(self) -> str:
        return f"PeerTier({self.name!r}, {self.location!r}, agent={self.agent_address!r})"

    def client(self, address: str) -> AgentClient:
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = AgentClient(address, timeout_s=self.timeout_s,
                                                         connect_timeout_s=self.connect_timeout_s,
                                                         token=self.token)
            return c

    def _local(self) -> AgentClient:
        if self.agent_address is None:
            raise TierError(f"tier '{self.name}': no checkpoint agent configured for this node; start one "
                            f"(tidal ckpt agent --listen HOST:PORT --mem-dir DIR --buddy HOST:PORT) and set "
                            f"{ENV_CKPT_AGENT}=HOST:PORT, or give the tier an 'agent'")
        return self.client(self.agent_address)

    def _path(self, step: int | None = None, name: str | None = None) -> str:
        p = f"/v1/jobs/{_q(self.job)}"
        if step is not None:
            p += f"/{mf.step_dirname(step)}"
        if name is not None:
            p += f"/{_q(name)}"
        return p

    def where(self, step: int, name: str | None = None) -> str:
        return f"{self.location}/{mf.step_dirname(step)}" + (f"/{name}" if name else "")

    def check(self) -> None:
        st = self.agent_status()
        if st.get("format") != "tidal-ckpt-agent":
            raise TierError(f"tier '{self.name}': {self.agent_address} is not a checkpoint agent")

    def agent_status(self) -> dict:
        """The local agent's ``GET /status`` document."""
        c = self._local()
        try:
            st = c.json("GET", "/status")
        except Unreachable as e:
            raise TierError(
                f"tier '{self.name}': {e}; is `tidal ckpt agent` running there? ({ENV_CKPT_AGENT})"
            ) from None
        with self._lock:
            self._buddy = (st.get("buddy") or {}).get("address")
            self._buddy_at = time.monotonic()
        return st

    def agents(self) -> list[AgentClient]:
        """The local agent, its buddy, then ``peers`` (no duplicates); those failing in the last 30 s last."""
        now = time.monotonic()
        if self.agent_address is not None and now - self._buddy_at > 10.0:
            with self._lock:
                self._buddy_at = now  # one refresh at a time, and not again for 10 s even if it fails
            with contextlib.suppress(OSError):
                self.agent_status()
        order = [a for a in (self.agent_address, self._buddy, *self.peer_addresses) if a]
        if not order:
            self._local()  # raises: nothing configured
        clients = [self.client(a) for a in dict.fromkeys(order)]
        return sorted(clients, key=lambda c: c.failed_at is not None and now - c.failed_at < 30.0)

    def _answers(self, method: str, path: str, where: str, agents: list[AgentClient] | None = None,
                 headers: dict | None = None,
                 into: memoryview | None = None) -> Iterator[tuple[AgentClient, int, Any]]:
        """(agent, status, body) of each agent whose answer to ``path`` is not 404, in order (see
        ``AgentClient.request`` for ``into``); then TierError when no agent answered at all."""
        errors, answered = [], 0
        for c in self.agents() if agents is None else agents:
            try:
                status, data = c.request(method, path, headers=headers, into=into)
            except Unreachable as e:
                errors.append(str(e))
                continue
            answered += 1
            if status != 404:
                yield c, status, data
        if not answered:
            raise TierError(f"tier '{self.name}' ({where}): no agent answered: {'; '.join(errors)}; is "
                            f"`tidal ckpt agent` running? ({ENV_CKPT_AGENT}, {ENV_CKPT_PEERS})")

    def _each(self, method: str, path: str) -> list[Any]:
        """The JSON answer of every reachable agent that has ``path``."""
        out = []
        for c, status, data in self._answers(method, path, self.location):
            if status != 200:
                raise _error(status, data, f"tier '{self.name}' ({c.address})")
            out.append(json.loads(data))
        return out

    def _first(self, path: str, where: str, agents: list[AgentClient] | None = None,
               headers: dict | None = None, into: memoryview | None = None) -> tuple[AgentClient, int, Any]:
        """The first answer to GET ``path`` that is not 404; FileNotFoundError when every agent said 404."""
        for answer in self._answers("GET", path, where, agents, headers, into):
            return answer
        raise FileNotFoundError(2, f"{where}: not found in any agent", where)

    # -- listing -----------------------------------------------------------------------------------
    def _index(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for doc in self._each("GET", self._path()):
            for s, info in doc["steps"].items():
                cur = out.setdefault(int(s), {"files": set(), "committed_unix_s": None})
                cur["files"] |= set(info["files"])
                if cur["committed_unix_s"] is None:
                    cur["committed_unix_s"] = info.get("committed_unix_s")
        return out

    def step_files(self) -> dict[int, set[str]]:
        return {s: info["files"] for s, info in self._index().items()}

    def committed(self) -> dict[int, float]:
        return {s: float(info["committed_unix_s"] or 0.0) for s, info in self._index().items()
                if mf.MANIFEST in info["files"]}

    def committed_steps(self) -> list[int]:
        return sorted(self.committed())

    def list_files(self, step: int) -> set[str]:
        return set(self.file_sizes(step))

    def file_sizes(self, step: int) -> dict[str, int]:
        """Object name -> size in bytes, for one step, over every agent (the first agent's size wins)."""
        out: dict[str, int] = {}
        for doc in self._each("GET", self._path(step)):
            for n, size in doc["files"].items():
                out.setdefault(n, int(size))
        return out

    # -- small objects -----------------------------------------------------------------------------
    def read_bytes(self, step: int, name: str) -> bytes:
        _, status, data = self._first(self._path(step, name), self.where(step, name))
        if status != 200:
            raise _error(status, data, f"tier '{self.name}' ({self.where(step, name)})")
        return bytes(data)

    def _ask(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One request to the local agent; ``TierError`` when it does not answer."""
        try:
            return self._local().request(method, path, body=body)
        except Unreachable as e:
            raise TierError(f"tier '{self.name}': {e}") from None

    def _put(self, step: int, name: str, data: Any, query: str = "") -> None:
        status, body = self._ask("PUT", self._path(step, name) + query, data)
        if status != 200:
            raise _error(status, body, f"tier '{self.name}' ({self.where(step, name)})")

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        """Answered once the agent's buddy holds ``name`` and every earlier object of the step."""
        self._put(step, name, data, "?sync=1")

    def read_manifest(self, step: int) -> mf.Manifest:
        return mf.read_object(lambda: self.read_bytes(step, mf.MANIFEST), self.where(step, mf.MANIFEST), step)

    # -- data --------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data: memoryview) -> None:
        """Send ``data`` to the local agent (which replicates it to its buddy in the background)."""
        self._put(step, name, data)

    def handoff(self, step: int, name: str, data: memoryview, path: str | os.PathLike | None = None) -> None:
        """Give this rank's data file to the local agent: it reads the first ``len(data)`` bytes of
        ``path`` (a staging slot) itself, or gets ``data`` over HTTP when it cannot. The slot must stay
        unchanged until ``wait_handoff`` returned (the commit need not wait for that)."""
        if path is not None:
            query = urllib.parse.urlencode({"copy_from": os.fspath(path), "length": len(data), "hold": 1})
            status, body = self._ask("POST", f"{self._path(step, name)}?{query}")
            if status == 202:
                with self._lock:
                    self._held.add((step, name))
                return
            if status == 200:  # copied before answering
                return
            if status not in (403, 404):  # 403/404: not allowed to or cannot read the slot; send the bytes
                raise _error(status, body, f"tier '{self.name}' ({self.where(step, name)})")
        self.write_file(step, name, data)

    def wait_handoff(self, step: int, name: str) -> None:
        """Return once the local agent no longer reads the staging slot it was handed for ``name``. A
        failed copy is logged by the agent; the commit's check then refuses or retries the step."""
        with self._lock:
            if (step, name) not in self._held:
                return
            self._held.discard((step, name))
        c = self._local()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                status, body = c.request("POST", f"{self._path(step, name)}?wait=copy")
            except Unreachable as e:  # gone: it reads nothing any more; or it hangs past timeout_s
                log.warning("tier '%s': waiting for agent %s to finish reading the slot of %s: %s", self.name,
                            c.address, self.where(step, name), e)
                return
            if status == 503 and time.monotonic() < deadline:
                continue
            if status not in (200, 404):  # 404: the object was removed meanwhile, nothing is held
                log.warning("tier '%s': agent %s on the slot of %s: %s", self.name, c.address,
                            self.where(step, name), _error(status, body, "wait=copy"))
            return

    def open_file(self, step: int, name: str) -> _PeerReader:
        return _PeerReader(self, self._path(step, name), self.where(step, name))

    # -- removal -----------------------------------------------------------------------------------
    def remove_file(self, step: int, name: str) -> None:
        self._each("DELETE", self._path(step, name))

    def remove_step(self, step: int) -> None:
        self._each("DELETE", self._path(step))

    def discard(self, step: int, name: str) -> None:
        """Drop an object this rank handed off but will not commit (best effort, local agent only)."""
        with contextlib.suppress(OSError):
            self._local().request("DELETE", self._path(step, name))


class _PeerReader:
    """Range requests of one object, from the first agent that has it; falls over to the others."""

    def __init__(self, tier: PeerTier, path: str, where: str) -> None:
        self.tier, self.path, self.where = tier, path, where
        self._first: str | None = None  # the agent that served the last range

    def _get(self, offset: int, out: memoryview) -> None:
        agents = sorted(self.tier.agents(), key=lambda c: c.address != self._first)
        headers = {"Range": f"bytes={offset}-{offset + len(out) - 1}"}
        c, status, got = self.tier._first(self.path, self.where, agents, headers, out)
        if status in (200, 206):
            if got != len(out):  # a 2xx answer read into out: got is the count read
                raise TruncatedRead(offset, len(out), got)
            self._first = c.address
        elif status == 416:
            raise TruncatedRead(offset, len(out), 0)
        else:
            raise _error(status, got, f"tier '{self.tier.name}' ({self.where})")

    def read_ranges(self, ranges: Sequence[tuple[int, int]], out: memoryview) -> None:
        pos = 0
        for offset, length in ranges:
            if length:
                self._get(offset, out[pos : pos + length])
            pos += length

    def close(self) -> None:
        pass

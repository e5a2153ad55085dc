"""The checkpoint agent's HTTP layer: one thread per connection, requests dispatched to a :class:`Router`
(``server.Agent.route``), errors as JSON, bodies streamed into files, files sent (with ``Range``).
Bounded: ``max_connections`` at once (one more: 503), shared receive :class:`Buffers`, bodies cut (408)
when they pause longer than ``grace_s`` or then arrive slower than ``min_rate_bytes_per_s``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol

from tidal.ckpt.agent.replicator import HTTPError

log = logging.getLogger("tidal.ckpt.agent")


class Router(Protocol):
    """What a :class:`Server` dispatches each request to: answers it through ``h`` (``send_json``,
    ``send_file``, ``body_to``) or raises :class:`HTTPError`, ``FileNotFoundError`` or ``ValueError``."""

    def route(self, h: Handler, method: str, parts: list[str], query: dict[str, str]) -> None: ...


class Buffers:
    """Receive buffers shared by every connection, each taken for one ``recv`` and its write only (never
    while a connection waits for bytes): memory for bodies is ``count * size_bytes`` however many
    connections are open. 4 MiB: measured faster on tmpfs than smaller buffers, and than receiving into an
    ``mmap`` of the file (a page fault per page)."""

    def __init__(self, count: int = 8, size_bytes: int = 4 << 20) -> None:
        self.size_bytes = size_bytes
        self._free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(None)  # allocated on first use

    @contextlib.contextmanager
    def take(self) -> Iterator[memoryview]:
        buf = self._free.get()
        try:
            if buf is None:
                buf = memoryview(bytearray(self.size_bytes))
            yield buf
        finally:
            self._free.put(buf)


def _write_all(fd: int, data: memoryview | bytes) -> None:
    w = 0
    while w < len(data):
        w += os.write(fd, data[w:])


def recv_into(sock: socket.socket, rfile, fd: int, length: int, buffers: Buffers,
              min_rate_bytes_per_s: float = 0.0, grace_s: float = 0.0) -> None:
    """Read exactly ``length`` body bytes into the file ``fd``: those ``rfile`` read ahead with the
    headers, then from ``sock`` through ``buffers``. 408 when the sender pauses longer than ``grace_s``
    (0: no limit) or, after ``grace_s``, sends slower than ``min_rate_bytes_per_s`` on average."""
    start = time.monotonic()
    sock.settimeout(0)  # what the header parser read ahead, without waiting for more
    try:
        ahead = rfile.read1(length) if length else b""
    finally:
        sock.settimeout(None)
    _write_all(fd, ahead)
    got = len(ahead)
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    while got < length:
        if not poll.poll(grace_s * 1000 if grace_s else None):
            raise HTTPError(408, f"body stalled after {got} of {length} bytes (cut)")
        with buffers.take() as buf:
            n = sock.recv_into(buf, min(len(buf), length - got))
            if not n:
                raise HTTPError(400, f"body ended after {got} of {length} bytes")
            _write_all(fd, buf[:n])
        got += n
        late_s = time.monotonic() - start - grace_s
        if late_s > 0 and got < length and got < min_rate_bytes_per_s * late_s:
            raise HTTPError(408, f"body arrives slower than {min_rate_bytes_per_s:.0f} bytes/s ({got} of "
                                 f"{length} bytes after {late_s + grace_s:.1f} s): cut")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tidal-ckpt-agent/1"
    timeout = 120  # an idle kept-alive connection is closed after this many seconds
    server: Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self) -> None:
        method = self.command
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        self._body_read = int(self.headers.get("Content-Length") or 0) == 0
        try:
            self.server.agent.route(self, method, parts, query)
        except ConnectionError as e:  # the client went away mid-request (a rank or agent killed): normal
            self.close_connection = True
            log.info("%s %s: %s closed the connection (%s)", method, self.path, self.address_string(),
                     type(e).__name__)
        except HTTPError as e:
            self.send_json(e.status, {"error": str(e)})
        except FileNotFoundError as e:
            self.send_json(404, {"error": f"not found: {e.filename or e}"})
        except ValueError as e:
            self.send_json(400, {"error": str(e)})
        except Exception as e:
            log.exception("%s %s failed", method, self.path)
            self.send_json(500, {"error": f"{type(e).__name__}: {e}"})

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _dispatch  # noqa: N815 - http.server's naming

    def send_json(self, status: int, doc: dict) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if not self._body_read:  # answering before reading the body: the connection cannot be reused
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def content_length(self) -> int:
        """The request's ``Content-Length``: 411 when absent, 400 when not a byte count."""
        value = self.headers.get("Content-Length")
        if value is None:
            raise HTTPError(411, "Content-Length required")
        if not value.strip().isdigit():
            raise HTTPError(400, f"Content-Length {value!r} is not a byte count")
        return int(value)

    def body_to(self, fd: int) -> None:
        s = self.server
        try:
            recv_into(self.connection, self.rfile, fd, self.content_length(), s.buffers,
                      s.min_rate_bytes_per_s, s.grace_s)
        finally:
            self.connection.settimeout(self.timeout)
        self._body_read = True

    def send_file(self, path: Path, head: bool) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start, end, status = 0, size - 1, 200
            rng = self.headers.get("Range")
            if rng:
                unit, _, spec = rng.partition("=")
                a, _, b = spec.partition("-")
                if unit.strip() != "bytes" or not a.isdigit() or (b and not b.isdigit()) or "," in spec:
                    raise HTTPError(400, f"unsupported Range {rng!r}; expected bytes=START-END")
                start, end, status = int(a), min(int(b) if b else size - 1, size - 1), 206
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            n = max(0, end - start + 1)
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if not head and n:
                self.connection.sendfile(f, start, n)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    agent: Router

    def __init__(self, address: tuple[str, int], handler: type[Handler], *, max_connections: int = 128,
                 min_rate_bytes_per_s: float = 1 << 20, grace_s: float = 10.0) -> None:
        super().__init__(address, handler)
        self.max_connections, self.refused_connections = max_connections, 0
        self.min_rate_bytes_per_s, self.grace_s = min_rate_bytes_per_s, grace_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.buffers = Buffers()

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        """A peer that closes or resets its connection (between requests, or a rank or agent killed) is
        one line; anything else keeps its traceback (socketserver would print every one to stderr)."""
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            log.info("connection from %s:%s closed: %s", *client_address[:2], type(e).__name__)
        else:
            log.error("request from %s:%s failed", *client_address[:2], exc_info=True)

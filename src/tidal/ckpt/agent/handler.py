"""The checkpoint agent's HTTP layer: one thread per connection, requests dispatched to a :class:`Router`
(the agent, ``server.Agent.route``), errors as JSON, bodies streamed into files and files sent (with
``Range``) without holding them in memory."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol

from tidal.ckpt.agent.replicator import HTTPError

log = logging.getLogger("tidal.ckpt.agent")


class Router(Protocol):
    """What a :class:`Server` dispatches each request to: answers it through ``h`` (``send_json``,
    ``send_file``, ``body_to``) or raises :class:`HTTPError`, ``FileNotFoundError`` or ``ValueError``."""

    def route(self, h: Handler, method: str, parts: list[str], query: dict[str, str]) -> None: ...


def recv_into(rfile, fd: int, length: int) -> None:
    """Read exactly ``length`` body bytes into the file ``fd``, through one reused buffer (measured
    faster on tmpfs than receiving into an ``mmap`` of the file, which pays a page fault per page)."""
    buf = memoryview(bytearray(min(length, 4 << 20)))
    got = 0
    while got < length:
        n = rfile.readinto(buf[: min(len(buf), length - got)])
        if not n:
            raise HTTPError(400, f"body ended after {got} of {length} bytes")
        view, w = buf[:n], 0
        while w < n:
            w += os.write(fd, view[w:])
        got += n


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

    def body_to(self, fd: int) -> None:
        if "Content-Length" not in self.headers:
            raise HTTPError(411, "Content-Length required")
        recv_into(self.rfile, fd, int(self.headers["Content-Length"]))
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

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        """A peer that closes or resets its connection (between requests, or a rank or agent killed) is
        one line; anything else keeps its traceback (socketserver would print every one to stderr)."""
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            log.info("connection from %s:%s closed: %s", *client_address[:2], type(e).__name__)
        else:
            log.error("request from %s:%s failed", *client_address[:2], exc_info=True)

"""The servers and directories of one ``tidal bench tiers`` run: SeaweedFS (S3), two checkpoint agents that
are each other's buddy, and a trivial HTTP receiver (the peer tier's raw device), all on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.bench.seaweed import SeaweedServer
from tidal.ckpt.agent.childproc import stop_process, wait_ready
from tidal.ckpt.agent.proc import AgentProcess
from tidal.net import free_ports

BUCKET = "tidal-bench"

RECEIVER = r"""
import os, socket, sys, uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, where = int(sys.argv[1]), sys.argv[2]
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def log_message(self, *a):
        pass
    def do_PUT(self):
        n, got = int(self.headers["Content-Length"]), 0
        buf = memoryview(bytearray(min(n, 4 << 20)))
        path = os.path.join(where, uuid.uuid4().hex)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        while got < n:
            k = self.rfile.readinto(buf[: min(len(buf), n - got)])
            w = 0
            while w < k:
                w += os.write(fd, buf[w:k])
            got += k
        os.close(fd)
        os.unlink(path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class Env:
    """The servers and directories of one run; ``close`` stops every process it started, by pid."""

    def __init__(self, root: Path, shm: Path, log: Callable[[str], None]) -> None:
        self.disk = root / "disk"
        log("starting SeaweedFS (S3), two checkpoint agents (buddies) and an HTTP receiver on loopback")
        self.seaweed = SeaweedServer(root / "seaweed", volume_size_limit_mb=1024)
        self.seaweed.start()
        self.seaweed.create_bucket(BUCKET)
        os.environ.update(self.seaweed.env())
        self.a = AgentProcess(shm / "agent-a", node="a", log_path=root / "agent-a.log")
        self.b = AgentProcess(shm / "agent-b", node="b", log_path=root / "agent-b.log")
        self.a.buddy, self.b.buddy = self.b.address, self.a.address
        self.a.start()
        self.b.start()
        self.recv_port = free_ports(1)[0]
        (shm / "recv").mkdir(parents=True, exist_ok=True)
        self.receiver = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, str(self.recv_port), str(shm / "recv")],
            stdin=subprocess.DEVNULL, start_new_session=True)
        wait_ready(self.receiver, lambda: _listening(self.recv_port), 20.0,
                   f"the HTTP receiver on port {self.recv_port}", Path(os.devnull), self.close)

    def s3_url(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}"

    def peer(self, job: str, agent: AgentProcess | None = None, **kw: Any) -> dict:
        return {"kind": "peer", "agent": (agent or self.a).address, "job": job, **kw}

    def close(self) -> None:
        for p in (self.a, self.b):
            with contextlib.suppress(Exception):
                p.stop()
        stop_process(self.receiver, 0)
        with contextlib.suppress(Exception):
            self.seaweed.stop()


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False

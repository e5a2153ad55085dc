"""A checkpoint agent (a real ``python -m tidal.ckpt.agent`` process on loopback) whose clients reset
their connections - before a request, in the middle of an upload, in the middle of a download, as a
rank or an agent killed on another node does: each is one line in its log, never a traceback; the
cut upload leaves no step behind, and the agent serves on."""

from __future__ import annotations

import socket
import struct
import time

from tidal.ckpt.agent.proc import AgentProcess
from tidal.ckpt.tiers.peer import AgentClient


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a killed process's kernel does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_reset_connection_is_one_line_and_the_agent_serves_on(tmp_path):
    ag = AgentProcess(tmp_path / "mem", node="a").start()
    try:
        host, port = ag.address.rsplit(":", 1)
        client = AgentClient(ag.address, timeout_s=10)
        big = bytes(range(256)) * (64 << 12)  # 64 MiB: more than the socket buffers hold
        assert client.request("PUT", "/v1/jobs/j/step_000000000001/r00000-x.safetensors", body=big)[0] == 200

        s = socket.create_connection((host, int(port)))  # a request cut short
        s.sendall(b"GET /sta")
        reset(s)
        s = socket.create_connection((host, int(port)))  # an upload cut short
        s.sendall(b"PUT /v1/jobs/j/step_000000000002/r00000-x.safetensors HTTP/1.1\r\nHost: a\r\n"
                  b"Content-Length: 1000000\r\n\r\n" + b"x" * 1000)
        reset(s)
        s = socket.create_connection((host, int(port)))  # a download cut short
        s.sendall(b"GET /v1/jobs/j/step_000000000001/r00000-x.safetensors HTTP/1.1\r\nHost: a\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        reset(s)

        def lines() -> str:
            return ag.log_path.read_text(errors="replace")

        deadline = time.monotonic() + 10
        while lines().count("closed") < 3 and time.monotonic() < deadline:  # logged as it notices
            time.sleep(0.1)
        st = client.json("GET", "/status")  # the cut upload left nothing: no step 2
        assert st["pid"] == ag.pid and [r["step"] for r in st["steps"]] == [1], st["steps"]
        log = lines()
        assert "Traceback" not in log and "Exception occurred" not in log, log
        assert log.count("closed") >= 3, log
    finally:
        ag.stop()

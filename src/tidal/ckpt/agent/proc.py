"""Run a checkpoint agent as a child process in its own session (tests, benchmarks, a single-machine
launcher): ``kill`` is a lost node; ``stop`` is safe to call twice and after ``kill``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import tidal
from tidal.ckpt.agent.auth import agent_token
from tidal.ckpt.agent.childproc import stop_process, wait_ready
from tidal.ckpt.tiers.peer import AgentClient
from tidal.contract import ENV_CKPT_AGENT_KEY
from tidal.net import free_ports


class AgentProcess:
    """One ``python -m tidal.ckpt.agent`` on 127.0.0.1. Not thread-safe; one owner starts and stops it."""

    def __init__(self, mem_dir: str | os.PathLike, *, buddy: str | None = None, port: int | None = None,
                 node: str | None = None, env: dict[str, str] | None = None, resync_s: float = 2.0,
                 log_path: str | os.PathLike | None = None, key: bytes | None = None) -> None:
        self.mem_dir = Path(mem_dir)
        self.port = port or free_ports(1)[0]
        self.buddy, self.node, self.resync_s = buddy, node, resync_s
        self.env = env
        self.key = key  # given to the agent in its own environment (None: an open agent)
        self.token = agent_token(key) if key is not None else None  # what status() asks with
        self.log_path = Path(log_path) if log_path else self.mem_dir.with_name(self.mem_dir.name + ".log")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> AgentProcess:
        if self.running():
            return self
        args = [sys.executable, "-m", "tidal.ckpt.agent", "--listen", self.address,
                "--mem-dir", str(self.mem_dir), "--resync-s", str(self.resync_s)]
        if self.buddy:
            args += ["--buddy", self.buddy]
        if self.node:
            args += ["--node", self.node]
        env = dict(os.environ if self.env is None else self.env)
        src = str(Path(tidal.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        env.pop(ENV_CKPT_AGENT_KEY, None)
        if self.key is not None:
            env[ENV_CKPT_AGENT_KEY] = self.key.hex()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        client = AgentClient(self.address, timeout_s=2.0, connect_timeout_s=0.5, token=self.token)
        proc = self.proc

        def ours() -> bool:
            with contextlib.suppress(OSError, ValueError):
                status, body = client.request("GET", "/status")
                # Ours, not another process that took the port first (then ours exits: port in use).
                return status == 200 and json.loads(body).get("pid") == proc.pid
            return False

        try:
            wait_ready(proc, ours, timeout_s, f"agent on {self.address}", self.log_path, self.stop)
        finally:
            client.drop()
        return self

    def status(self) -> dict:
        client = AgentClient(self.address, timeout_s=10.0, token=self.token)
        try:
            return client.json("GET", "/status")
        finally:
            client.drop()

    def kill(self) -> None:
        """SIGKILL by pid, as if the node died (its memory directory stays unless the caller removes it)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL by pid. Safe to call twice."""
        proc, self.proc = self.proc, None
        stop_process(proc, grace_s)

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Checkpoint agents of the peer-memory tier, one per Ray node, started and supervised by the Ray executor.

Each alive GPU node runs one agent (:mod:`tidal.ckpt.agent`) under a detached actor pinned to it
(:class:`AgentActor`, ``tidal.agent.<node>``), in a ring in node-name order: each pushes to the next
node's agent, so losing a node loses no committed step. :meth:`RayAgents.ensure` (every step, at most
every ``check_s``) starts missing agents, restarts dead ones on the same memory and port, and re-points
buddies. Ranks get ``TIDAL_CKPT_AGENT``/``TIDAL_CKPT_PEERS`` from :meth:`RayAgents.env` and their job's
token from :meth:`RayAgents.token`; the key (``<root>/.ckpt-agent.key``) reaches each agent through its
environment, never a command line. An agent's memory directory is ``<shm base>/<node>/agent``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tidal import contract as c
from tidal.ckpt.agent.auth import agent_token, job_token
from tidal.exec.isolation import private_dir
from tidal.exec.ray_rank import _child_setup
from tidal.net import free_port

log = logging.getLogger(__name__)

AGENT_PREFIX = "tidal.agent."
CHECK_S = 2.0  # the supervisor looks at the agents this often at most
CALL_TIMEOUT_S = 30.0


def key_id(key: bytes | None) -> str | None:
    """A short fingerprint of a key (which key an agent runs with, without the key)."""
    return hashlib.sha256(b"tidal-ckpt-agent/id\0" + key).hexdigest()[:16] if key is not None else None


def ring(names: list[str]) -> dict[str, str | None]:
    """Each node's buddy: the next node in name order (none for a single node)."""
    order = sorted(names)
    return {n: (order[(i + 1) % len(order)] if len(order) > 1 else None) for i, n in enumerate(order)}


class AgentActor:
    """One node's agent process (see the module docstring). Methods are quick but for ``start``."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.buddy: str | None = None
        self.addr: str | None = None
        self.key: str | None = None  # the key (hex) the running agent was given

    def reserve(self) -> dict:
        """This node's agent address (a port chosen once) and state: ``{"address", "buddy", "running",
        "key"}``."""
        import ray

        if self.addr is None:
            ip = ray.util.get_node_ip_address()
            self.port = free_port(ip)
            self.addr = f"{ip}:{self.port}"
        return {"address": self.addr, "buddy": self.buddy,
                "running": self.proc is not None and self.proc.poll() is None,
                "key": key_id(bytes.fromhex(self.key)) if self.key is not None else None}

    def start(self, node: str, mem_dir: str, allow: str | None, buddy: str | None, log_path: str,
              key: str | None = None) -> str:
        """Run (or re-run, with a new buddy or key) the agent; its address once it answers ``/status``.
        ``key``: hex, handed to the agent in its own environment (None: an open agent).
        ``allow``: the directory it may copy staging slots from; None: none (jobs run as their own
        uids: the agent, root, would read any job's file a rank names), and the node's directories
        are 0711 (a job's uid passes through to its own)."""
        self.reserve()
        addr = self.addr
        assert addr is not None  # reserve() chose it
        running = self.proc is not None and self.proc.poll() is None
        if running and buddy == self.buddy and key == self.key:
            return addr
        if running:
            self.stop()
        node_dir = Path(mem_dir).parent
        for d in (node_dir.parent, node_dir):
            private_dir(d, 0o700 if allow is not None else 0o711)
        private_dir(Path(mem_dir), 0o700)
        copy = ["--allow-copy-from", allow] if allow is not None else ["--no-copy-from"]
        cmd = [sys.executable, "-m", "tidal.ckpt.agent", "--listen", addr, "--mem-dir", mem_dir,
               "--node", node, *copy, *(["--buddy", buddy] if buddy else [])]
        parent = os.getpid()
        env = {k: v for k, v in os.environ.items() if k != c.ENV_CKPT_AGENT_KEY}
        if key is not None:
            env[c.ENV_CKPT_AGENT_KEY] = key
        with open(
            os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "ab"
        ) as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True,
                                         preexec_fn=lambda: _child_setup(parent))
        self.buddy, self.key = buddy, key
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the checkpoint agent on {node} exited with {self.proc.returncode} "
                                   f"(log {log_path})")
            with contextlib.suppress(OSError, ValueError), \
                    urllib.request.urlopen(f"http://{addr}/status", timeout=1) as r:
                if json.loads(r.read()).get("pid") == self.proc.pid:
                    return addr
            time.sleep(0.1)
        raise RuntimeError(f"the checkpoint agent on {node} did not answer within 20 s (log {log_path})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class RayAgents:
    """The supervisor: one :class:`AgentActor` per GPU node, in a buddy ring. Driven by ``RayExecutor``."""

    def __init__(self, ray: Any, namespace: str, shm_root: Path, log_dir: Path, check_s: float = CHECK_S, *,
                 uids: bool = False, key: bytes | None = None) -> None:
        self._ray, self.namespace, self.shm_root, self.log_dir = ray, namespace, shm_root, log_dir
        self.uids = uids  # jobs run as their own uids: agents copy no staging slot (see AgentActor.start)
        self.check_s = check_s
        self.key = key  # None: open agents (every request accepted)
        self._remote = ray.remote(AgentActor)
        self._checked = float("-inf")
        self.addresses: dict[str, str] = {}  # node -> agent host:port (of the newest check)
        self.buddies: dict[str, str | None] = {}

    def ensure(self, nodes: dict[str, str], *, force: bool = False) -> dict[str, str]:
        """Start, restart or re-point the agents of ``nodes`` (name -> Ray node id of the alive GPU nodes);
        forget those of nodes that left. Returns node -> agent address."""
        now = time.monotonic()
        if not force and now - self._checked < self.check_s and set(nodes) == set(self.addresses):
            return self.addresses
        self._checked = now
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        buddies = ring(list(nodes))
        actors, states = {}, {}
        for name, node_id in nodes.items():
            actor_name = AGENT_PREFIX + name
            try:
                actors[name] = self._ray.get_actor(actor_name, namespace=self.namespace)
            except ValueError:
                actors[name] = self._remote.options(
                    name=actor_name, namespace=self.namespace, lifetime="detached", num_cpus=0,
                    max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote()
        refs = {n: a.reserve.remote() for n, a in actors.items()}
        for n, ref in refs.items():
            try:
                states[n] = self._ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as e:  # an actor on a node going away: the next check
                log.warning("checkpoint agent on %s does not answer: %s", n, e)
        addresses = {n: s["address"] for n, s in states.items()}
        starts = {}
        for n, s in states.items():
            peer = buddies[n]
            buddy = addresses.get(peer) if peer else None
            # (an agent tolerates a buddy not up yet: it retries)
            if not s["running"] or s["buddy"] != buddy or s.get("key") != key_id(self.key):
                node_dir = self.shm_root / n
                starts[n] = actors[n].start.remote(n, str(node_dir / "agent"),
                                                   None if self.uids else str(node_dir), buddy,
                                                   str(self.log_dir / f"agent-{n}.log"),
                                                   self.key.hex() if self.key is not None else None)
        for n, ref in starts.items():
            try:
                self._ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as e:
                addresses.pop(n, None)
                log.warning("checkpoint agent on %s did not start: %s", n, e)
        self.addresses = {n: a for n, a in addresses.items() if n in nodes}
        self.buddies = buddies
        return self.addresses

    def env(self, node: str) -> dict[str, str]:
        """A rank's variables on ``node``: its agent and the others (nothing without an agent there)."""
        own = self.addresses.get(node)
        if own is None:
            return {}
        others = [a for n, a in sorted(self.addresses.items()) if n != node]
        return {c.ENV_CKPT_AGENT: own, **({c.ENV_CKPT_PEERS: ",".join(others)} if others else {})}

    def token(self, namespace: str) -> str | None:
        """The token of a job's ``namespace`` at these agents (None: they are open)."""
        return job_token(self.key, namespace) if self.key is not None else None

    @property
    def agent_token(self) -> str | None:
        """The plane's own token: accepted by every agent for every job's steps."""
        return agent_token(self.key) if self.key is not None else None

    def held_jobs(self) -> list[str]:
        """Peer namespaces of which an agent (of the newest check) holds a step."""
        from tidal.exec.agent_memory import held_jobs

        return sorted(held_jobs(self.addresses.values(), self.agent_token))

    def free_job(self, namespace: str) -> bool:
        """Every step of ``namespace`` removed from every agent; True if any was there."""
        from tidal.exec.agent_memory import free_job

        return free_job(self.addresses.values(), namespace, self.agent_token) > 0

    def stop_all(self) -> None:
        """Kill every agent actor of this plane (their processes die with them)."""
        for a in self._ray.util.list_named_actors(all_namespaces=True):
            if a.get("namespace") == self.namespace and a.get("name", "").startswith(AGENT_PREFIX):
                with contextlib.suppress(Exception):
                    self._ray.kill(self._ray.get_actor(a["name"], namespace=self.namespace), no_restart=True)
        self.addresses = {}

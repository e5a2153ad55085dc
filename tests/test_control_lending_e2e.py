"""Live lending through a real ``tidal up``: virtual serving nodes, real workers, SIGKILL and restart.

The plane replays the shipped daily profile from midnight at 600x on eight serving nodes of 2 GPUs. An
elastic spot job grows onto lent GPUs during the night; ``tidal up`` is killed with SIGKILL while the
job runs on them and started again: it re-adopts the workers (never a second copy), continues the
same loans, reclaims and forecast from the store, and at the morning rise the job is shrunk and the
GPUs go back to serving before their deadline. The plane's own check (jobs against the ledger after
every step) never fires.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tidal.serving
from tidal.control.client import TidalClient
from tidal.exec import procs

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
PROFILE = Path(tidal.serving.__file__).parent / "data" / "daily-profile.csv"
CONFIG = f"""
restart_backoff_s: 0.2
hang_timeout_s: 30
startup_timeout_s: 60
kill_slack_s: 3
loop_interval_s: 0.2
serving:
  trace: {PROFILE}
  nodes: 8x2
  speedup: 600
  start_s: {2 * 86400}
  history_days: 2
  grace_s: 5
  final_checkpoint_s: 2
  release_s: 1
  warmup_s: 2
  restart_cost_s: 5
"""


class Plane:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.state = tmp, tmp / "state"
        (tmp / "config.yaml").write_text(CONFIG)
        self.proc: subprocess.Popen | None = None
        self.n = 0

    def start(self) -> None:
        url_file = self.state / "api.url"
        url_file.unlink(missing_ok=True)
        out = self.tmp / f"up-{self.n}.log"
        self.n += 1
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tidal.cli import main; main()", "up", "--gpus", "1", "--port", "0",
                 "--state-dir", str(self.state), "--config", str(self.tmp / "config.yaml")],
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
        import json

        for launch in self.state.glob("jobs/*/attempt-*/launch.json"):
            for r in json.loads(launch.read_text())["ranks"]:
                if procs.alive(r["pid"], r.get("started")):
                    procs.kill_group(r["pid"])


def _wait(what: str, pred, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _on_serving(job: dict) -> int:
    return sum(g for n, g in (job.get("placement") or {}).items() if n.startswith("serve-"))


def test_lending_survives_sigkill_of_the_plane(tmp_path):
    p = Plane(tmp_path)
    try:
        p.start()
        token = p.admin.create_tenant("t")["token"]
        client = TidalClient(p.url, token)
        job = client.submit({"name": "spot", "kind": "spot", "gpus": {"min": 1, "max": 3}, "grace_s": 5,
                             "max_restarts": 20, "workdir": str(tmp_path),
                             "command": [sys.executable, str(WORKER), "--steps", "10000000"],
                             "env": {"TIDAL_CKPT_INTERVAL_STEPS": "50", "TIDAL_SHM_DIR": str(tmp_path / "shm")}})
        jid = job["id"]
        _wait("the job running on lent serving GPUs",
              lambda: client.job(jid)["state"] == "running" and _on_serving(client.job(jid)) > 0)
        before = p.admin.serving()
        attempt = client.job(jid)["attempt"]
        assert before["lending"] and before["lent_gpus"] >= _on_serving(client.job(jid))
        p.crash()
        p.start()
        client = TidalClient(p.url, token)  # a new port
        after = p.admin.serving()
        kinds = [e["kind"] for e in p.admin.events(jid)]
        assert "adopted" in kinds, kinds
        assert client.job(jid)["attempt"] == attempt  # re-adopted, not relaunched
        assert after["forecast_observations"] >= before["forecast_observations"]
        assert after["stats"]["lent_total_gpus"] >= before["stats"]["lent_total_gpus"]
        assert after["stats"]["steps"] >= before["stats"]["steps"]
        # the morning rise: GPUs go back to serving before their deadline
        _wait("a return to serving", lambda: p.admin.serving()["stats"]["returned_gpus"] > 0, timeout_s=150)
        _wait("the job off the serving nodes", lambda: _on_serving(client.job(jid)) == 0, timeout_s=150)
        final = p.admin.serving()
        st = final["stats"]
        assert st["reclaims_missed"] == 0 and final["worst_margin_s"] >= 0, final
        assert st["double_counted_steps"] == 0
        assert client.job(jid)["state"] in ("running", "admitted", "resizing", "pending")
    finally:
        p.stop()

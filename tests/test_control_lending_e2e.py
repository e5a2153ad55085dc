"""Live lending through a real ``tidal up``: virtual serving nodes, real workers, SIGKILL and restart.

The plane replays the shipped daily profile from midnight at 600x on eight serving nodes of 2 GPUs. An
elastic spot job grows onto lent GPUs during the night; ``tidal up`` is killed with SIGKILL while the
job runs on them and started again: it re-adopts the workers (never a second copy), continues the
same loans, reclaims and forecast from the store, and at the morning rise the job is shrunk and the
GPUs go back to serving before their deadline. The plane's own check (jobs against the ledger after
every step) never fires.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plane_proc import Plane, lending_config, wait_until
from tidal.control.client import TidalClient

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
CONFIG = lending_config("8x2", start_h=5, hang_timeout_s=30, kill_slack_s=3)


def _on_serving(job: dict) -> int:
    return sum(g for n, g in (job.get("placement") or {}).items() if n.startswith("serve-"))


def test_lending_survives_sigkill_of_the_plane(tmp_path):
    p = Plane(tmp_path, CONFIG, gpus=1)
    try:
        p.start()
        token = p.admin.create_tenant("t")["token"]
        client = TidalClient(p.url, token)
        job = client.submit(
            {
                "name": "spot",
                "kind": "spot",
                "gpus": {"min": 1, "max": 3},
                "grace_s": 5,
                "max_restarts": 20,
                "workdir": str(tmp_path),
                "command": [sys.executable, str(WORKER), "--steps", "10000000", "--step-s", "0.05"],
                "env": {"TIDAL_CKPT_INTERVAL_STEPS": "50", "TIDAL_SHM_DIR": str(tmp_path / "shm")},
            }
        )
        jid = job["id"]
        def settled() -> bool:  # running on lent GPUs at its maximum: no grow (a notice) can race the crash
            j = client.job(jid)
            return j["state"] == "running" and _on_serving(j) > 0 and sum(j["placement"].values()) == 3

        wait_until("the job running on lent serving GPUs at its maximum size", settled)
        before = p.admin.serving()
        attempt = client.job(jid)["attempt"]
        assert before["lending"] and before["lent_gpus"] >= _on_serving(client.job(jid))
        p.crash()
        p.start()
        client = TidalClient(p.url, token)  # a new port
        after = p.admin.serving()
        events = p.admin.events(jid)
        adopted = [e for e in events if e["kind"] == "adopted" and (e.get("data") or {}).get("pids")]
        assert adopted, [e["kind"] for e in events]
        # Re-adopted, not relaunched: the attempt running at the crash (a grow may have started a newer
        # one after `attempt` was read) was launched once, before the restart.
        again = adopted[-1]["data"]["attempt"]
        assert again >= attempt
        launches = [e for e in events
                    if e["kind"] == "launch" and e["message"].startswith(f"attempt {again}:")]
        assert len(launches) == 1
        assert after["forecast_observations"] >= before["forecast_observations"]
        assert after["stats"]["lent_total_gpus"] >= before["stats"]["lent_total_gpus"]
        assert after["stats"]["steps"] >= before["stats"]["steps"]
        # the morning rise: GPUs go back to serving before their deadline
        wait_until(
            "a return to serving", lambda: p.admin.serving()["stats"]["returned_gpus"] > 0, timeout_s=150
        )
        wait_until("the job off the serving nodes", lambda: _on_serving(client.job(jid)) == 0, timeout_s=150)
        final = p.admin.serving()
        st = final["stats"]
        assert st["reclaims_missed"] == 0 and final["worst_margin_s"] >= 0, final
        assert st["double_counted_steps"] == 0
        assert client.job(jid)["state"] in ("running", "admitted", "resizing", "pending")
    finally:
        p.stop()

"""End to end: ``tidal up`` as a real process (uvicorn on a loopback port, the reconcile loop, the
local executor on 2 CPU slots) and real training workers (tests/workers/train_worker.py).

One scenario, in order: a spot job trains and checkpoints; a dedicated job of another tenant
preempts it (SIGTERM, exit 75: requeued, not a failure); the spot job resumes from the step it
stopped at; ``tidal up`` is killed with SIGKILL and started again: the spot job's workers are
re-adopted, not run twice; it is cancelled. Then a job that always fails is restarted up to
max_restarts and fails, and a job that stops beating is detected as hung. Then the command line
against the same server (a failure before leaves no job holding the GPUs it would wait for). Every
process started here is stopped at the end, also on failure, by pid.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from plane_proc import Plane, wait_until
from tidal.control import cli as control_cli
from tidal.control.client import TidalClient
from tidal.exec import procs

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "train_worker.py"
CONFIG = """
restart_backoff_s: 0.2
hang_timeout_s: 8
startup_timeout_s: 60
kill_slack_s: 5
loop_interval_s: 0.2
scheduler: {min_runtime_before_preempt_s: 0, preempt_grace_s: 30}
"""
HANG = (
    "import json, os, time; d = os.environ['TIDAL_PROGRESS_DIR']; "
    "open(os.path.join(d, 'heartbeat-r00000.json'), 'w').write(json.dumps({'time': time.time(), 'step': 1, "
    "'phase': 'training'})); print('beat once, now stuck', flush=True); time.sleep(600)"
)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(tmp_path_factory.mktemp("plane"), CONFIG)
    try:
        p.start()
        yield p
    finally:
        p.stop()


def wait_for(what: str, pred, client: TidalClient, timeout_s: float = 90.0):
    def explain() -> str:
        return "; events:\n" + "\n".join(f"{e['job']}: {e['kind']} {e['from']}->{e['to']}: {e['message']}"
                                        for e in client.events())
    return wait_until(what, pred, timeout_s, explain)


def train_spec(name: str, steps: int, tmp: Path, step_s: float = 0.0, **kw) -> dict:
    return {"name": name, "gpus": kw.pop("gpus", 2), "workdir": str(tmp),
            "command": [sys.executable, str(WORKER), "--steps", str(steps), "--pad-mib", "1",
                        "--step-s", str(step_s)],
            # one shm directory per job, each made by its job: as root, two tenants run as two uids
            "env": {"TIDAL_CKPT_INTERVAL_STEPS": "10", "TIDAL_SHM_DIR": str(tmp / f"shm-{name}")}, **kw}


def transitions(client: TidalClient, job: str) -> list[tuple]:
    return [(e["from"], e["to"]) for e in client.events(job) if e["kind"] == "transition"]


def test_preempt_resume_failures_hang_and_crash(plane):
    try:
        preempt_resume_crash_then_failures(plane)
    finally:  # a failure here leaves no job holding the plane's GPUs for the next test (whose --wait waits)
        for j in plane.admin.jobs():
            if j["state"] not in ENDED:
                with contextlib.suppress(Exception):
                    plane.admin.cancel(j["id"])


ENDED = ("succeeded", "failed", "cancelled")


def preempt_resume_crash_then_failures(plane):
    admin, tmp = plane.admin, plane.tmp
    prod = TidalClient(plane.url, admin.create_tenant("prod", quota_gpus=1, weight=1.0)["token"])
    lab = TidalClient(plane.url, admin.create_tenant("lab", quota_gpus=0, weight=1.0)["token"])
    spot = lab.submit(train_spec("sweep", 1_000_000, tmp, step_s=0.05, max_restarts=0))["id"]
    wait_for(
        "a checkpoint of the spot job", lambda: (lab.job(spot)["progress"].get("ckpt_step") or 0) >= 10, admin
    )
    assert lab.job(spot)["progress"]["ckpt_every_steps"] == 10  # its own (TIDAL_CKPT_INTERVAL_STEPS) wins:
    wait_for("the cadence said once", lambda: [e for e in lab.events(spot) if e["kind"] == "ckpt_interval"],
             admin)
    (cadence,) = [e for e in lab.events(spot) if e["kind"] == "ckpt_interval"]
    assert cadence["message"].startswith("checkpoint cadence: every 10 steps, the job's own")

    # A dedicated job inside its tenant's quota preempts the spot gang.
    ded = prod.submit(train_spec("urgent", 30, tmp, kind="dedicated", gpus=1))["id"]
    wait_for("the preemption", lambda: lab.job(spot)["preemptions"] == 1, admin)
    job = lab.job(spot)
    assert job["restarts"] == 0 and ("running", "preempting") in transitions(lab, spot)
    requeued = [e for e in lab.events(spot) if e["to"] == "pending" and e["from"] == "preempting"]
    assert requeued and requeued[0]["data"]["exit_codes"] == [75, 75]
    stopped_at = requeued[0]["data"]["step"]
    assert requeued[0]["data"]["ckpt_step"] == stopped_at  # the notice's final checkpoint: nothing lost
    wait_for("the dedicated job to succeed", lambda: prod.job(ded)["state"] == "succeeded", admin)

    # The spot job resumes from the step it stopped at.
    wait_for(
        "the spot job to resume", lambda: (lab.job(spot)["progress"].get("step") or 0) > stopped_at + 5, admin
    )
    job = lab.job(spot)
    assert job["attempt"] == 2 and job["progress"]["start_step"] == stopped_at

    # kill -9 of the control plane; a new one re-adopts the running workers (pid + start time).
    pids = [r["pid"] for r in job["handle"]["ranks"]]
    plane.crash()
    time.sleep(0.5)
    assert all(procs.alive(p) for p in pids)
    plane.start()
    admin, lab = plane.admin, TidalClient(plane.url, lab.token)
    adopted = wait_for(
        "the adoption", lambda: [e for e in admin.events(spot) if e["kind"] == "adopted"], admin
    )
    assert f"re-adopted attempt 2, 2 of 2 ranks running (pids {pids})" in adopted[0]["message"]
    before = lab.job(spot)["progress"]["step"]
    wait_for("progress after the adoption", lambda: lab.job(spot)["progress"]["step"] > before + 5, admin)
    assert (
        lab.job(spot)["attempt"] == 2 and len([e for e in admin.events(spot) if e["kind"] == "launch"]) == 2
    )

    lab.cancel(spot)
    wait_for("the cancel", lambda: lab.job(spot)["state"] == "cancelled", admin)
    assert transitions(lab, spot)[-2:] == [("running", "cancelling"), ("cancelling", "cancelled")]
    report = lab.job(spot)["report"]
    assert report["preemptions"] == 1 and report["restarts"] == 0 and 0 < report["ettr"] <= 1

    # A failing and a hanging job, once the spot job has let the GPUs go (submitted beside it, the failing
    # one's last attempt could come after the resumed spot job had taken both GPUs, and wait behind it).
    flaky = lab.submit({"name": "flaky", "gpus": 1, "max_restarts": 2,
                        "command": [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]})["id"]
    stuck = lab.submit(
        {"name": "stuck", "gpus": 1, "max_restarts": 0, "command": [sys.executable, "-c", HANG]}
    )["id"]
    wait_for("the failing job to fail", lambda: lab.job(flaky)["state"] == "failed", admin)
    f = lab.job(flaky)
    assert (
        f["restarts"] == 2
        and f["attempt"] == 3
        and "rank 0 exited with code 3; no restarts left" in f["message"]
    )
    assert len([t for t in transitions(lab, flaky) if t[1] == "backoff"]) == 2
    assert lab.logs(flaky)["data"].count("boom") == 3
    wait_for("the hang to be detected", lambda: lab.job(stuck)["state"] == "failed", admin)
    assert any(e["kind"] == "hang" and "no heartbeat for" in e["message"] for e in lab.events(stuck))
    # /metrics is as of the end of the loop's newest step (its published view): the store may say "failed"
    # while the step that wrote it has not ended yet
    wait_for("the metrics to count both failures and the GPUs free", lambda: (
        'tidal_jobs{state="failed"} 2.0' in (metrics := admin.metrics())
        and 'tidal_pool_gpus{pool="training",state="free",tenant=""} 2.0' in metrics), admin, timeout_s=10)


def test_cli_against_the_server(plane, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_API_URL", plane.url)
    monkeypatch.setenv("TIDAL_TOKEN", (plane.state / "admin.token").read_text().strip())
    app = typer.Typer()
    for name in ("submit", "jobs", "status", "logs", "cancel", "pool", "events"):
        app.command(name)(getattr(control_cli, name))
    app.add_typer(control_cli.tenants_app, name="tenants")
    run = CliRunner().invoke
    (tmp_path / "hello.yaml").write_text(
        "name: hello\ngpus: 1\ncommand: [" + sys.executable + ", -c, \"print('hello from rank 0')\"]\n")
    r = run(app, ["submit", str(tmp_path / "hello.yaml"), "--wait"])
    assert r.exit_code == 0, r.output
    assert "submitted hello-" in r.output and "succeeded" in r.output
    job = r.output.split("submitted ")[1].split()[0]
    assert "hello from rank 0" in run(app, ["logs", job]).output
    assert "succeeded" in run(app, ["status", job]).output
    assert job in run(app, ["jobs"]).output
    assert "-> succeeded: its only rank exited 0" in run(app, ["events", job]).output
    assert "free" in run(app, ["pool"]).output
    (tmp_path / "bad.yaml").write_text("name: bad\ngpus: {min: 0}\ncommand: python x.py\n")
    r = run(app, ["submit", str(tmp_path / "bad.yaml")])
    assert r.exit_code == 1
    assert (
        "gpus.min: Input should be greater than or equal to 1" in r.output
        and "command: expected a list" in r.output
    )
    r = run(app, ["tenants", "create", "cli-team", "--quota", "1", "--weight", "2"])
    assert r.exit_code == 0 and "tidal_" in r.output
    r = run(app, ["cancel", job])
    assert r.exit_code == 1 and "already succeeded" in r.output

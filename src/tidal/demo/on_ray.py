"""``tidal demo ray``: a GPT job across a local 3-node Ray cluster loses a node and recovers on the rest,
then grows back (docs/control.md, the Ray executor; ``--cycle``: :mod:`tidal.demo.ray_cycle`)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tidal.control.client import ApiError, TidalClient
from tidal.demo.options import example_script, gpt_job
from tidal.demo.plane import PLANE_CONFIG, DemoError, EmbeddedPlane, attempt_records
from tidal.demo.ray_cluster import LocalRayCluster, stdout_to_stderr


def job_spec(steps: int, ckpt_every: int, parallel: str) -> dict[str, Any]:
    args = ["--parallel", parallel, "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--micro-batch=2",
            "--log-every", str(max(1, steps // 10)), "--warmup", "3"]
    return gpt_job(example_script(), "gpt-ray", "tiny", args, gpus={"min": 2, "max": 3}, max_restarts=0,
                   grace_s=20)


def _events(c: TidalClient, job: str, kind: str) -> list[dict]:
    return [e for e in c.events(job) if e["kind"] == kind]


def run(steps: int, ckpt_every: int, parallel: str, kill_at: float, timeout_s: float, say) -> dict[str, Any]:  # noqa: ANN001
    """The whole story; the summary. ``DemoError`` when the job did not recover."""
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="tidal-demo-ray-"))
    say("starting a Ray cluster on this machine: a head and nodes n1 (2 GPUs), n2 (1), n3 (1)")
    cluster = LocalRayCluster()
    plane = None
    try:
        plane = EmbeddedPlane(work / "state", "auto", PLANE_CONFIG, executor="ray",
                              ray_address=cluster.cluster.address)
        url = plane.start()
        admin = TidalClient(url, plane.admin_token)
        say(f"control plane on {url}: {plane.plane.describe}")
        lab = TidalClient(url, admin.create_tenant("lab", quota_gpus=0, weight=1.0)["token"])
        job = lab.submit(job_spec(steps, ckpt_every, parallel))["id"]
        deadline = time.monotonic() + timeout_s

        def wait(what: str, pred, poll_s: float = 0.2):  # noqa: ANN001, ANN202
            while time.monotonic() < deadline:
                got = pred()
                if got:
                    return got
                time.sleep(poll_s)
            raise DemoError(f"timed out after {timeout_s:g} s waiting for {what}")

        kill_step = max(ckpt_every + 1, int(steps * kill_at))
        wait("the job to train past the kill step with a checkpoint",
             lambda: ((p := lab.job(job)["progress"]).get("step") or 0) >= kill_step
             and (p.get("ckpt_step") or 0) > 0)
        j = lab.job(job)
        placement = j["placement"]
        say(f"{job} runs on {placement} ({parallel}), step {j['progress']['step']}, newest checkpoint step "
            f"{j['progress'].get('ckpt_step')} (tiers {sorted(j['progress'].get('tiers') or {})})")
        big = max(placement, key=lambda n: placement[n])
        t_kill = time.time()
        say(f"killing node {big} (its raylet, SIGKILL) with {placement[big]} of the job's ranks")
        cluster.remove(big)
        lost = wait("the node loss to be noticed", lambda: _events(admin, job, "node_lost"))[0]
        say(f"noticed {lost['time_s'] - t_kill:.2f} s after the kill: {lost['message']}")
        rec = wait("training again", lambda: _events(admin, job, "recovered"))[0]
        say(f"recovered: {rec['message']}")
        say(f"node {big} comes back")
        cluster.add(big)
        wait("the job to finish", lambda: lab.job(job)["state"] in ("succeeded", "failed", "cancelled"), 0.5)
        j = lab.job(job)
        records = attempt_records(plane.state_dir, job)
        losses = [(r["step"], r.get("loss")) for recs in records.values() for r in recs
                  if r.get("event") == "step"]
        worlds = {}
        for a in records:
            doc = json.loads((plane.state_dir / "jobs" / job / f"attempt-{a}" / "launch.json").read_text())
            worlds[a] = doc["world_size"]
        d = rec["data"]
        summary = {
            "job": job, "state": j["state"], "steps": steps, "parallel": parallel, "node_lost": big,
            "detection_s": round(lost["time_s"] - t_kill, 3), "recovery_s": round(d["recovery_s"], 3),
            "restored_step": d["start_step"], "restore_tier": d["restore_tier"],
            "steps_redone": d["lost_steps"], "world_sizes": worlds, "restarts": j["restarts"],
            "attempts": j["attempt"], "loss_first": losses[0][1] if losses else None,
            "loss_last": losses[-1][1] if losses else None, "wall_s": round(time.time() - t_start, 1)}
        if j["state"] != "succeeded" or j["restarts"] != 0:
            raise DemoError(f"{job} ended {j['state']} ({j['message']}) after the node loss; "
                            f"summary {summary}")
        return summary
    finally:
        if plane is not None:
            plane.stop()
        from tidal.exec.ray_exec import kill_ranks, namespace_for, shm_base

        kill_ranks(work / "state" / "jobs")
        shm = shm_base(namespace_for(work / "state" / "jobs"))
        cluster.shutdown()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def demo_ray(
    steps: Annotated[int, typer.Option(help="optimizer steps of the job")] = 60,
    ckpt_every: Annotated[int, typer.Option(help="checkpoint every N steps")] = 5,
    parallel: Annotated[str, typer.Option(help="ddp or fsdp (FSDP2), over gloo")] = "ddp",
    kill_at: Annotated[float, typer.Option(
        help="kill the node once this fraction of the steps is done")] = 0.4,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 600.0,
    json_out: Annotated[bool, typer.Option("--json", help="print the summary as JSON on stdout")] = False,
    cycle: Annotated[bool, typer.Option("--cycle", help="the day cycle of lending on a 4-node Ray "
                                        "cluster, a node lost at night (tidal.demo.ray_cycle)")] = False,
    speedup: Annotated[float | None, typer.Option(
        help="--cycle: serving seconds per second (default 360, 180 with --serve; at most 480: the "
        "forecast's horizon must cover the scaled timing)", show_default=False)] = None,
    hours: Annotated[float, typer.Option(help="--cycle: hours of serving time to replay")] = 14.0,
    start_hour: Annotated[float, typer.Option(help="--cycle: serving time of day to start at")] = 22.0,
    kill_hour: Annotated[float, typer.Option(help="--cycle: serving time of day to kill a node at")] = 2.0,
    jobs: Annotated[int, typer.Option(help="--cycle: elastic spot jobs")] = 2,
    max_ranks: Annotated[int, typer.Option(help="--cycle: largest size of each job")] = 2,
    keep: Annotated[bool, typer.Option("--keep", help="--cycle: keep the state dir")] = False,
    serve: Annotated[bool, typer.Option(
        "--serve", help="--cycle: Ray Serve replicas (a toy model) on the serving nodes serve generated "
        "traffic that follows the day (tidal.demo.serve_traffic); latency before/during/after the "
        "reclaims")] = False,
) -> None:
    """Node loss on Ray: a GPT job across a local 3-node Ray cluster loses a node and recovers on the rest
    (--cycle: a day of lending serving GPUs across Ray nodes, a node lost at night)."""
    console, err = Console(stderr=json_out), Console(stderr=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cycle:
        from tidal.demo.ray_cycle import SERVE_SPEEDUP, SPEEDUP, main

        if speedup is None:
            speedup = SERVE_SPEEDUP if serve else SPEEDUP
        raise typer.Exit(main(speedup, hours, start_hour, kill_hour, jobs, max_ranks, keep, json_out, serve))
    if serve:
        err.print("[red]error:[/red] --serve goes with --cycle (the day of lending)", highlight=False)
        raise typer.Exit(2)
    if parallel not in ("ddp", "fsdp"):
        err.print(f"[red]error:[/red] --parallel {parallel!r}: expected ddp or fsdp", highlight=False)
        raise typer.Exit(2)
    if not 0 < kill_at < 1 or steps < 2 * ckpt_every + 2 or ckpt_every < 1:
        err.print(f"[red]error:[/red] --steps {steps}, --ckpt-every {ckpt_every}, --kill-at {kill_at}: "
                  "expected 0 < kill-at < 1 and steps >= 2 x ckpt-every + 2", highlight=False)
        raise typer.Exit(2)
    t0 = time.time()

    def say(line: str) -> None:
        console.print(f"[dim]{time.time() - t0:6.1f}s[/dim] {line}", highlight=False)

    try:
        with stdout_to_stderr(json_out):  # Ray prints a killed raylet's last log lines on stdout
            s = run(steps, ckpt_every, parallel, kill_at, timeout, say)
    except (DemoError, ApiError, OSError, ValueError) as e:
        err.print(f"[red]demo failed:[/red] {e}", highlight=False)
        raise typer.Exit(1) from None
    if json_out:
        print(json.dumps(s, indent=2))
        return
    console.print(f"\n[bold]{s['job']}[/bold] {s['state']}: {s['steps']} steps ({s['parallel']}), world "
                  f"sizes per attempt {s['world_sizes']}, restarts {s['restarts']}", highlight=False)
    console.print(f"node {s['node_lost']} lost: noticed in [bold]{s['detection_s']:.2f} s[/bold], training "
                  f"again [bold]{s['recovery_s']:.2f} s[/bold] later from step {s['restored_step']} (tier "
                  f"{s['restore_tier']}), {s['steps_redone']} steps redone", highlight=False)
    console.print(f"loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}; wall {s['wall_s']:.0f} s",
                  highlight=False)

"""``tidal demo`` (``make demo``): a spot GPT job on an embedded plane loses a rank midway and recovers from
its checkpoint (docs/control.md, Demo). Everything started here is stopped on the way out."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from tidal.control.auth import ADMIN_TOKEN_FILE
from tidal.control.client import ApiError, TidalClient
from tidal.control.dashboard import dashboard_url
from tidal.demo.options import SIZES, DemoOptions, example_script, gpt_job
from tidal.demo.plane import (
    DemoError,
    EmbeddedPlane,
    Kill,
    attempt_records,
    kill_rank,
    reached_step,
    uninterrupted,
)
from tidal.demo.show import _clock, _fmt, _tiers, event_line, progress_line, status_panel, summary_table

TERMINAL = ("succeeded", "failed", "cancelled")
QUIET_EVENTS = frozenset({"ckpt_interval"})  # in the summary, not narrated: the demo checkpoints by steps
# A pause after each step of the tiny model (a few ms of compute a step), so that the run lasts long
# enough for the demo to kill a rank midway.
TINY_STEP_PAUSE_S = 0.05


def job_spec(opts: DemoOptions, script: Path, shm_dir: Path) -> dict[str, Any]:
    """The demo's job: the GPT example as a spot gang on every slot, a checkpoint every few steps."""
    args = ["--parallel", opts.parallel, "--steps", str(opts.steps), "--ckpt-every", str(opts.ckpt_every),
            "--log-every", str(max(1, opts.steps // 20)), "--warmup", str(max(1, min(10, opts.steps // 10))),
            f"--micro-batch={opts.global_batch // opts.gpus}"]  # one micro-batch per rank
    if opts.size == "tiny":
        args.append(f"--step-pause-s={TINY_STEP_PAUSE_S}")
    return gpt_job(script, "gpt-demo", opts.size, args, shm_dir, gpus=opts.gpus, max_restarts=3, grace_s=10)


@dataclass
class Watch:
    """What the poll loop has seen."""

    seen_event: int = 0
    events: list[dict] = field(default_factory=list)
    announced_ckpt: int = 0
    running_attempts: set[int] = field(default_factory=set)
    kill: Kill | None = None
    resumed_told: bool = False
    initial_loss: float | None = None


def run_demo(
    opts: DemoOptions, console: Console, *, state_dir: Path | None = None, keep: bool = False
) -> dict:
    """Run the demo; return its summary (see the module docstring). Stops everything it started."""
    opts.check()
    script = example_script()
    t0 = time.monotonic()
    own_state = state_dir is None
    sdir = Path(tempfile.mkdtemp(prefix="tidal-demo-")) if state_dir is None else Path(state_dir)
    sdir.mkdir(parents=True, exist_ok=True)
    shm_base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else sdir
    shm_dir = Path(tempfile.mkdtemp(prefix="tidal-demo-shm-", dir=shm_base))
    plane: EmbeddedPlane | None = None
    job_id: str | None = None
    try:
        plane = EmbeddedPlane(sdir, opts.gpus)
        url = plane.start()
        say = _narrator(console)
        say(f"control plane up at {url} ({plane.plane.describe}); state in {sdir}")
        say(f"  (in another terminal: TIDAL_STATE_DIR={sdir} tidal events -f)", style="dim")
        say(f"  dashboard: {dashboard_url(url)} (sign in with the token in {sdir / ADMIN_TOKEN_FILE})",
            style="dim")
        admin = TidalClient(url, plane.admin_token)
        tenant = admin.create_tenant("research", quota_gpus=0, weight=1.0)
        client = TidalClient(url, tenant["token"])
        job_id = client.submit(job_spec(opts, script, shm_dir))["id"]
        m = SIZES[opts.size]
        say(f"submitted [bold]{job_id}[/bold] as tenant research: the GPT example ({opts.size}: "
            f"{m['n-layer']} layers, d={m['n-embd']}, {m['global-batch']} x {m['block']} bytes a step), "
            f"kind spot, {opts.gpus} ranks, {opts.steps} steps, a checkpoint every {opts.ckpt_every} steps "
            "(node memory, then disk)")
        say(f"plan: a few steps after step {opts.kill_step}, SIGKILL rank {opts.rank_to_kill} as if its GPU "
            "died; the platform must restart the gang from the newest checkpoint")
        w, j = _watch(client, job_id, opts, console, say, plane.state_dir, t0)
        wall_s = time.monotonic() - t0
        if j["state"] != "succeeded":  # the state dir may be gone soon: show why, from the ranks' own output
            for rank in range(opts.gpus):
                say(f"the end of rank {rank}'s log:", style="red")
                console.print(log_tail(client, job_id, rank), markup=False, highlight=False)
        return summarize(j, w, opts, plane.state_dir, wall_s, keep or not own_state)
    finally:
        with uninterrupted():  # a second Ctrl-C (or a SIGTERM) must not cut the clean-up short
            if plane is not None:
                killed = plane.stop()
                if killed:  # (a file's last live render has no newline)
                    console.print(("" if console.is_terminal else "\n")
                                  + f"[dim]stopped {len(killed)} worker process groups (pids {killed})[/dim]",
                                  highlight=False)
            shutil.rmtree(shm_dir, ignore_errors=True)
            if own_state and not keep:
                shutil.rmtree(sdir, ignore_errors=True)


def log_tail(client: TidalClient, job_id: str, rank: int, limit: int = 3000) -> str:
    size = client.logs(job_id, rank=rank, offset=0, limit=1)["size"]
    return client.logs(job_id, rank=rank, offset=max(0, size - limit), limit=limit)["data"].rstrip()


def _narrator(console: Console):
    def say(msg: str, style: str = "") -> None:
        line = f"[dim]{_clock(time.time())}[/dim] [bold cyan]demo[/bold cyan] {msg}"
        console.print(f"[{style}]{line}[/]" if style else line, highlight=False)
    return say


def _watch(client: TidalClient, job_id: str, opts: DemoOptions, console: Console, say, state_dir: Path,
           t0: float) -> tuple[Watch, dict]:
    """Poll the API until the job ends: narrate its events, checkpoints, the kill and the recovery."""
    w = Watch()
    j = client.job(job_id)
    live_ok = console.is_terminal
    last_line = 0.0
    deadline = time.monotonic() + opts.timeout_s
    with Live(status_panel(j, opts, 0.0, None, None), console=console, refresh_per_second=4,
              transient=False, auto_refresh=live_ok) as live:
        while True:
            try:
                j = client.job(job_id)
                new = client.events(job_id, after=w.seen_event)
            except ApiError as e:
                raise DemoError(f"the embedded API failed: {e}") from e
            for ev in new:
                w.seen_event = ev["id"]
                w.events.append(ev)
                if ev["kind"] in QUIET_EVENTS:
                    continue
                console.print(f"[dim]{_clock(ev['time_s'])}[/dim] {event_line(ev)}", highlight=False)
            _narrate_progress(j, w, opts, say, state_dir)
            if j["state"] in TERMINAL:
                live.update(status_panel(j, opts, time.monotonic() - t0, w.kill, w.initial_loss))
                break
            if w.kill is None and _due(j, opts):
                w.kill = k = kill_rank(j, opts.rank_to_kill)
                if k is not None:
                    say(f"[bold red]SIGKILL to rank {k.rank} (pid {k.pid}, the child of its shim pid "
                        f"{k.shim_pid} named in the events)[/bold red], as if its GPU died: attempt "
                        f"{k.attempt}, last reported at step {k.at_step} with newest checkpoint step "
                        f"{k.ckpt_step} (the summary gives the step it had reached, from its own records)")
            if time.monotonic() > deadline:
                raise DemoError(f"job {job_id} did not end within --timeout {opts.timeout_s:g} s "
                                f"(state {j['state']}, step {(j.get('progress') or {}).get('step')})")
            live.update(status_panel(j, opts, time.monotonic() - t0, w.kill, w.initial_loss))
            if not live_ok and time.monotonic() - last_line >= 5.0:
                console.print(progress_line(j, opts), highlight=False)
                last_line = time.monotonic()
            time.sleep(opts.poll_s)
    return w, j


def _due(j: dict, opts: DemoOptions) -> bool:
    """Kill once the first attempt has a committed checkpoint, runs past the kill step, and is a third of
    the way into a checkpoint interval (so that the steps to recompute show; the reported step lags the
    ranks by up to a few steps)."""
    p = j.get("progress") or {}
    step, ck = p.get("step") or 0, j.get("ckpt_step") or 0
    return (j["state"] == "running" and j["attempt"] == 1 and ck > 0 and opts.kill_step <= step < opts.steps
            and step % opts.ckpt_every >= max(1, opts.ckpt_every // 3))


def _narrate_progress(j: dict, w: Watch, opts: DemoOptions, say, state_dir: Path) -> None:
    p = j.get("progress") or {}
    if w.initial_loss is None and p.get("step"):
        recs = attempt_records(state_dir, j["id"]).get(1, [])
        first = next((r for r in recs if r.get("event") == "step"), None)
        w.initial_loss = first.get("loss") if first else None
    if j["state"] == "running" and j["attempt"] not in w.running_attempts and p.get("step"):
        w.running_attempts.add(j["attempt"])
        start = p.get("start_step") or 0
        if j["attempt"] == 1:
            say(f"training: step {p['step']}, loss {_fmt(p.get('loss'), '{:.3f}')} (from scratch)")
        elif w.kill is not None and not w.resumed_told:
            w.resumed_told = True
            restore = next((r for r in attempt_records(state_dir, j["id"]).get(j["attempt"], [])
                            if r.get("event") == "restore"), {})
            after = (p.get("first_step_s") or time.time()) - w.kill.time_s
            how = (f" from tier {restore['tier']} in {restore.get('duration_s', 0):.2f} s"
                   if restore.get("tier") else "")
            reached = reached_step(attempt_records(state_dir, j["id"]).get(w.kill.attempt, []))
            redo = f" (attempt {w.kill.attempt} had reached step {reached}: {reached - start} to recompute)" \
                if reached is not None else ""
            say(f"[bold green]recovered[/bold green]: attempt {j['attempt']} restored checkpoint step "
                f"{start}{how}{redo}; training again {after:.1f} s after the kill")
    ck = j.get("ckpt_step") or 0
    if ck > w.announced_ckpt:
        w.announced_ckpt = ck
        stall = p.get("ckpt_stall_s")
        say(f"checkpoint step {ck} committed ({_tiers(p)})"
            + (f"; training paused {stall * 1000:.0f} ms for it" if stall is not None else ""), style="")


def summarize(j: dict, w: Watch, opts: DemoOptions, state_dir: Path, wall_s: float, kept: bool) -> dict:
    """The demo's outcome as a JSON-able dict, from the API's view of the job and its attempt files."""
    recs = attempt_records(state_dir, j["id"])
    steps = [r for a in recs.values() for r in a if r.get("event") == "step"]
    first = next((r for r in recs.get(1, []) if r.get("event") == "step"), None)
    last = max(steps, key=lambda r: (r.get("time") or 0), default=None)
    ckpts: dict[str, set[int]] = {}
    stalls = []
    for a in recs.values():
        for r in a:
            if r.get("event") == "committed":
                for t in r.get("tiers", []):
                    ckpts.setdefault(t, set()).add(int(r["step"]))
            elif r.get("event") == "checkpoint" and r.get("stall_s") is not None:
                stalls.append(r["stall_s"])
    k = w.kill
    after = {a: rs for a, rs in recs.items() if k is not None and a > k.attempt}
    restore = next((r for a in after.values() for r in a if r.get("event") == "restore"), None)
    next_step = next((r for a in after.values() for r in a if r.get("event") == "step"), None)
    for a in recs.values():  # a step restored from a tier was committed there (its record may have died)
        for r in a:
            if r.get("event") == "restore" and r.get("tier") and r.get("step"):
                ckpts.setdefault(r["tier"], set()).add(int(r["step"]))
    reached = reached_step(recs.get(k.attempt, [])) if k is not None else None
    resumed = restore.get("step") if restore else None
    rep = j["report"]
    final_step = (j.get("progress") or {}).get("step")
    out: dict[str, Any] = {
        "job": j["id"], "state": j["state"], "succeeded": j["state"] == "succeeded", "steps": opts.steps,
        "final_step": final_step, "initial_loss": first.get("loss") if first else None,
        "final_loss": last.get("loss") if last else None, "restarts": rep["restarts"],
        "attempts": j["attempt"],
        "killed": None if k is None else {"rank": k.rank, "pid": k.pid, "shim_pid": k.shim_pid,
                                          "attempt": k.attempt, "at_step": k.at_step,
                                          "ckpt_step": k.ckpt_step, "reached_step": reached},
        "resumed_from_step": resumed, "restore_tier": restore.get("tier") if restore else None,
        "restore_s": restore.get("duration_s") if restore else None,
        "recovery_s": (next_step["time"] - k.time_s) if (next_step and k) else None,
        "steps_recomputed": (reached - resumed) if (reached is not None and resumed is not None) else None,
        **{k: rep[k] for k in ("lost_steps", "lost_work_s", "ettr", "held_s", "productive_s")},
        "checkpoints": {t: sorted(s) for t, s in sorted(ckpts.items())},
        "ckpt_stall_median_s": statistics.median(stalls) if stalls else None, "model": dict(SIZES[opts.size]),
        "parallel": opts.parallel, "ranks": opts.gpus, "wall_s": round(wall_s, 2),
        "events": [(f"{e['from'] or 'new'} -> {e['to']}" if e["kind"] == "transition" else e["kind"])
                   + f": {e['message']}" for e in w.events],
        "state_dir": str(state_dir) if kept else None,
    }
    problems = []
    if not out["succeeded"]:
        problems.append(f"the job ended {j['state']}: {j['message']}")
    if k is None:
        problems.append("no rank was killed (the job ended before the kill step)")
    if rep["restarts"] < 1:
        problems.append("the platform never restarted the job")
    if not out["resumed_from_step"]:
        problems.append("the restarted attempt did not restore a checkpoint step > 0 "
                        "(it started from scratch)")
    if final_step != opts.steps:
        problems.append(f"the job reached step {final_step}, not {opts.steps}")
    out["problems"] = problems
    out["ok"] = not problems
    return out


def demo(
    ctx: typer.Context,
    steps: Annotated[int, typer.Option(help="optimizer steps of the job")] = 300,
    ckpt_every: Annotated[int, typer.Option(help="checkpoint every N steps")] = 25,
    gpus: Annotated[int, typer.Option(
        help="CPU slots of the embedded plane; the job runs on all of them")] = 2,
    parallel: Annotated[str, typer.Option(help="ddp or fsdp (FSDP2), over gloo")] = "ddp",
    size: Annotated[str, typer.Option(help="model size: small (the demo) or tiny (tests)")] = "small",
    kill_at: Annotated[float, typer.Option(help="kill a rank once this fraction of the steps is done")] = 0.5,
    kill_rank: Annotated[int | None, typer.Option(help="which rank to kill (default: the last)")] = None,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 600.0,
    state_dir: Annotated[Path | None, typer.Option(
        help="use this state dir (kept) instead of a temporary one")] = None,
    keep: Annotated[bool, typer.Option(
        "--keep", help="keep the temporary state dir and print its path")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="print the summary as JSON on stdout (the narration goes to stderr)")] = False,
) -> None:
    """The platform end to end: a spot GPT job loses a rank midway and recovers from its checkpoint.

    An embedded control plane (API, reconcile loop, local executor) runs examples/gpt/train.py on CPU
    slots; one rank is SIGKILLed midway; the platform restarts the job from its newest checkpoint.
    Exit code 0 only if the job succeeded after resuming from a checkpoint step > 0.
    `tidal demo cycle`: a day of lending serving GPUs to spot jobs and taking them back.
    """
    if ctx.invoked_subcommand is not None:
        return
    console = Console(stderr=json_out)
    err = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = DemoOptions(steps=steps, ckpt_every=ckpt_every, gpus=gpus, parallel=parallel, size=size,
                       kill_at=kill_at, kill_rank=kill_rank, timeout_s=timeout)
    try:
        opts.check()
    except DemoError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None

    def on_term(*_: Any) -> None:
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        summary = run_demo(opts, console, state_dir=state_dir, keep=keep)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]: the control plane and every worker it started were stopped",
                  highlight=False)
        raise typer.Exit(130) from None
    except (DemoError, ApiError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(1) from None
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    console.print()
    console.print(summary_table(summary))
    if json_out:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        sys.stdout.flush()
    raise typer.Exit(0 if summary["ok"] else 1)

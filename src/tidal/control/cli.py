"""``tidal up`` and the client commands: submit, jobs, status, logs, cancel, pool, tenants, events.

The client commands talk to the API at ``$TIDAL_API_URL`` with ``$TIDAL_TOKEN``; on the machine
running ``tidal up`` both default to what it wrote into its state dir (``$TIDAL_STATE_DIR``,
default ``~/.tidal``), so ``tidal up --gpus 2 &`` then ``tidal submit job.yaml --wait`` just works.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tidal.control.client import ApiError, TidalClient, default_token, default_url

console = Console()
err = Console(stderr=True)
TERMINAL = ("succeeded", "failed", "cancelled")
STATE_STYLE = {"running": "green", "succeeded": "bold green", "failed": "bold red", "cancelled": "dim",
               "pending": "yellow", "backoff": "red", "preempting": "magenta", "resizing": "magenta",
               "cancelling": "magenta", "admitted": "cyan"}

tenants_app = typer.Typer(help="Tenants (admin): create, list.", no_args_is_help=True)


def _client() -> TidalClient:
    return TidalClient(default_url(), default_token())


def _fail(e: Exception) -> None:
    err.print(f"[red]error:[/red] {e}", highlight=False)
    raise typer.Exit(1)


def _state(s: str) -> str:
    return f"[{STATE_STYLE.get(s, 'white')}]{s}[/]"


def _num(v: Any, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


# ------------------------------------------------------------------------------------------- up
def up(host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
       port: Annotated[int, typer.Option(help="TCP port (0: any free port; see <state dir>/api.url)")] = 8470,
       gpus: Annotated[str, typer.Option(help="'auto' (NVIDIA GPUs) or N CPU slots")] = "auto",
       db: Annotated[str | None, typer.Option(help="SQLAlchemy URL (default: SQLite in the state dir)")] = None,
       state_dir: Annotated[Path | None, typer.Option(help="database, jobs, logs, tokens (default ~/.tidal)")] = None,
       config: Annotated[Path | None, typer.Option(help="YAML of control-plane knobs (docs/control.md)")] = None,
       executor: Annotated[str, typer.Option(help="'local' (this machine) or 'ray' (the nodes of a Ray cluster)")]
       = "local",
       ray_address: Annotated[str | None, typer.Option(help="with --executor ray: the cluster to join ('auto', "
                                                            "HOST:PORT); default: start a local Ray")] = None,
       ckpt_agents: Annotated[bool, typer.Option("--ckpt-agents", help="with --executor ray: run a checkpoint "
                                                 "agent (the peer-memory tier) on every node, in a buddy ring")]
       = False,
       ) -> None:
    """Run the control plane: REST API, reconcile loop and an executor (local or Ray), in one process."""
    import logging

    from tidal.control.client import state_dir as default_state_dir
    from tidal.control.config import ControlConfig
    from tidal.control.server import build, serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.umask(0o077)  # the database, logs, tokens and job directories: the plane's own, 0600/0700
    try:
        cfg = ControlConfig.load(config) if config else ControlConfig()
    except (OSError, ValueError, TypeError) as e:
        _fail(e)
    plane = build(state_dir or default_state_dir(), gpus, db, cfg, executor=executor, ray_address=ray_address,
                  ckpt_agents=ckpt_agents)

    def announce(line: str) -> None:
        console.print(line, highlight=False)
        sys.stdout.flush()

    serve(plane, host, port, announce=announce)


# --------------------------------------------------------------------------------------- submit
def load_spec_file(path: Path) -> dict:
    """Parse a job YAML; paths in it (workdir, a local checkpoint url) are relative to the file."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping (name, gpus, command, ...), got {type(doc).__name__}")
    base = path.resolve().parent
    wd = doc.get("workdir")
    if wd is None:
        doc["workdir"] = str(base)
    elif isinstance(wd, str) and not wd.startswith("/"):
        doc["workdir"] = str((base / wd).resolve())
    ck = doc.get("checkpoint")
    url = ck.get("url") if isinstance(ck, dict) else None
    if isinstance(url, str) and "://" not in url and not url.startswith(("/", "~")):
        ck["url"] = str((base / ck["url"]).resolve())
    if isinstance(ck, dict) and isinstance(ck.get("tiers"), list):
        for i, t in enumerate(ck["tiers"]):  # "./dir" and "../dir" (a bare word is refused as a likely typo)
            if isinstance(t, str) and t.startswith(("./", "../")):
                ck["tiers"][i] = str((base / t).resolve())
            elif isinstance(t, dict) and isinstance(t.get("url"), str) and t["url"].startswith(("./", "../")):
                t["url"] = str((base / t["url"]).resolve())
    return doc


def submit(file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
           wait: Annotated[bool, typer.Option("--wait", help="follow the job until it ends")] = False) -> None:
    """Submit a job; with --wait, show its progress until it ends (exit code 0 if it succeeded)."""
    try:
        spec = load_spec_file(file)
        job = _client().submit(spec)
    except ApiError as e:
        if e.errors:
            err.print(f"[red]error:[/red] {file}: the spec was refused:", highlight=False)
            for line in e.errors:
                err.print(f"  {line}", highlight=False)
            raise typer.Exit(1) from None
        _fail(e)
    except ValueError as e:
        _fail(e)
    console.print(f"submitted [bold]{job['id']}[/bold] ({job['kind']}, {job['gpus']['min']}"
                  f"{'-' + str(job['gpus']['max']) if job['gpus']['max'] != job['gpus']['min'] else ''} GPUs)")
    if wait:
        raise typer.Exit(_wait(job["id"]))


def _wait(job_id: str, poll_s: float = 1.0) -> int:
    from rich.live import Live

    c = _client()
    seen = 0
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        while True:
            try:
                j = c.job(job_id)
                for e in c.events(job_id, after=seen):
                    seen = e["id"]
                    live.console.print(f"[dim]{_clock(e['time_s'])}[/dim] {_event_line(e)}", highlight=False)
            except ApiError as e:
                live.console.print(f"[yellow]{e}; retrying[/yellow]")
                time.sleep(poll_s)
                continue
            live.update(_progress_line(j))
            if j["state"] in TERMINAL:
                break
            time.sleep(poll_s)
    _summary(j)
    return 0 if j["state"] == "succeeded" else 1


def _progress_line(j: dict) -> str:
    p = j.get("progress") or {}
    parts = [f"{j['id']}: {_state(j['state'])}"]
    if p.get("step") is not None:
        parts.append(f"step {p['step']}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4f}")
    if p.get("steps_per_s"):
        parts.append(f"{p['steps_per_s']:.2f} steps/s")
    if p.get("ckpt_step") is not None:
        parts.append(f"checkpoint {p['ckpt_step']}")
    return " | ".join(parts)


def _summary(j: dict) -> None:
    r = j["report"]
    console.print(f"{j['id']}: {_state(j['state'])} — {j['message']}", highlight=False)
    console.print(f"  attempts {j['attempt']}, restarts {r['restarts']}, preemptions {r['preemptions']}, "
                  f"lost work {r['lost_work_s']:.1f} s ({r['lost_steps']} steps), "
                  f"ETTR {_num(r['ettr'], '{:.2f}')}", highlight=False)


# ------------------------------------------------------------------------------------------ jobs
def jobs(state: Annotated[list[str] | None, typer.Option(help="only these states (repeat)")] = None,
         tenant: Annotated[str | None, typer.Option(help="admin: only this tenant's jobs")] = None) -> None:
    """List jobs (yours; the admin sees all)."""
    try:
        rows = _client().jobs(states=state, tenant=tenant)
    except ApiError as e:
        _fail(e)
    t = Table(box=None, header_style="bold")
    for col in ("JOB", "TENANT", "STATE", "KIND", "GPUS", "STEP", "STEPS/S", "CKPT", "RESTARTS", "ETTR"):
        t.add_column(col, no_wrap=True)
    for j in rows:
        p, r, g = j.get("progress") or {}, j["report"], j["gpus"]
        held = sum(j["placement"].values()) if j["placement"] else 0
        want = f"{g['min']}" if g["min"] == g["max"] else f"{g['min']}-{g['max']}"
        t.add_row(j["id"], j["tenant"], _state(j["state"]), j["kind"], f"{held}/{want}",
                  _num(p.get("step")), _num(p.get("steps_per_s"), "{:.1f}"), _num(j.get("ckpt_step")),
                  str(r["restarts"]), _num(r["ettr"], "{:.2f}"))
    console.print(t)


def status(job: Annotated[str, typer.Argument(help="job id")]) -> None:
    """One job: state, progress, checkpoints per tier, restarts, lost work, ETTR, recent events."""
    c = _client()
    try:
        j = c.job(job)
        evs = c.events(job)
        ck = c.checkpoints(job)
    except ApiError as e:
        _fail(e)
    p, g = j.get("progress") or {}, j["gpus"]
    console.print(f"[bold]{j['id']}[/bold]  {_state(j['state'])}  tenant {j['tenant']}, {j['kind']}, "
                  f"priority {j['priority']}, GPUs {g['min']}-{g['max']} (x{g['multiple_of']}), "
                  f"placement {j['placement'] or '-'}", highlight=False)
    console.print(f"  command: {j['spec']['command']}  (workdir {j['spec'].get('workdir') or '-'})", highlight=False)
    if j["message"]:
        console.print(f"  {j['message']}", highlight=False)
    if p:
        tiers = ", ".join(f"{k}: step {v[0]}" for k, v in (p.get("tiers") or {}).items()) or "none"
        console.print(f"  step {_num(p.get('step'))} (restored {_num(p.get('start_step'))}), loss "
                      f"{_num(p.get('loss'), '{:.4f}')}, {_num(p.get('steps_per_s'), '{:.2f}')} steps/s, "
                      f"heartbeat phase {p.get('phase') or '-'}; checkpoints: {tiers}", highlight=False)
    console.print(f"  {_ckpt_line(ck)}", highlight=False)
    if j.get("handle"):
        console.print(f"  attempt {j['attempt']}: pids {[r['pid'] for r in j['handle'].get('ranks', [])]}, "
                      f"devices {j['handle'].get('devices')}", highlight=False)
    _summary(j)
    for e in evs[-12:]:
        console.print(f"  [dim]{_clock(e['time_s'])}[/dim] {_event_line(e)}", highlight=False)


def _ckpt_line(ck: dict) -> str:
    """``checkpoints at URL: shm 40, 50; disk 10..50 (5); newest durable step 50, 3.2 s old``."""
    if ck.get("url") is None:
        return "checkpoints: location unknown"
    parts = []
    for t in ck["tiers"]:
        s = t["steps"]
        held = "none" if not s else ", ".join(map(str, s)) if len(s) <= 3 else f"{s[0]}..{s[-1]} ({len(s)})"
        parts.append(f"{t['name']} {held}{' (error: ' + t['error'] + ')' if t.get('error') else ''}")
    line = f"checkpoints at {ck['url']}: {'; '.join(parts) or 'none'}"
    if ck.get("newest_durable_step") is not None:
        line += f"; newest durable step {ck['newest_durable_step']}, {_num(ck.get('durable_age_s'), '{:.1f}')} s old"
    return line


def logs(job: Annotated[str, typer.Argument(help="job id")],
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False,
         rank: Annotated[int, typer.Option(help="which rank's log")] = 0) -> None:
    """A rank's output (stdout and stderr, every attempt)."""
    c = _client()
    offset = 0
    try:
        while True:
            chunk = c.logs(job, rank=rank, offset=offset)
            if chunk["data"]:
                sys.stdout.write(chunk["data"])
                sys.stdout.flush()
            offset = chunk["offset"]
            if not follow or (chunk["done"] and offset >= chunk["size"]):
                break
            if offset >= chunk["size"]:
                time.sleep(0.5)
    except ApiError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass


def cancel(job: Annotated[str, typer.Argument(help="job id")]) -> None:
    """Cancel a job: a pending one at once; a running one gets a notice (checkpoint, exit), then is cancelled."""
    try:
        j = _client().cancel(job)
    except ApiError as e:
        _fail(e)
    console.print(f"{j['id']}: cancel requested ({j['state']})")


def pool() -> None:
    """GPUs per node: who holds them, what is draining, what is free."""
    try:
        p = _client().pool()
    except ApiError as e:
        _fail(e)
    t = Table(box=None, header_style="bold")
    for col in ("NODE", "POOL", "GPUS", "ALLOCATED", "DRAINING", "FREE", "HELD BY"):
        t.add_column(col)
    for n in p["nodes"]:
        held = ", ".join(f"{h['job'] or h['tenant']} ({h['gpus']}{', ' + h['state'] if h['state'] != 'running' else ''})"
                         for h in n["jobs"]) or "-"
        t.add_row(n["name"], n["pool"], str(n["gpus"]), str(n["allocated"]), str(n["draining"]), str(n["free"]), held)
    console.print(t)
    console.print(f"{p['allocated']}/{p['gpus']} GPUs allocated, {p['free']} free, {p['pending']} jobs pending")


def events(job: Annotated[str | None, typer.Argument(help="job id (default: all you may see)")] = None,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False,
           last: Annotated[int, typer.Option(help="show the last N events")] = 50) -> None:
    """The event log: every transition, decision, adoption and restart."""
    c = _client()
    try:
        rows = c.events(job, limit=10000)
        for e in rows[-last:]:
            console.print(f"[dim]{_clock(e['time_s'])}[/dim] {_event_line(e, with_job=job is None)}", highlight=False)
        seen = rows[-1]["id"] if rows else 0
        while follow:
            time.sleep(0.5)
            for e in c.events(job, after=seen):
                seen = e["id"]
                console.print(f"[dim]{_clock(e['time_s'])}[/dim] {_event_line(e, with_job=job is None)}",
                              highlight=False)
    except ApiError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 10)}"


def _event_line(e: dict, with_job: bool = False) -> str:
    who = f"{e['job']} " if with_job and e.get("job") else ""
    if e["kind"] == "transition":
        arrow = f"{e['from'] or 'new'} -> {_state(e['to'])}"
        return f"{who}{arrow}: {e['message']}"
    return f"{who}[bold]{e['kind']}[/bold]: {e['message']}"


# --------------------------------------------------------------------------------------- tenants
@tenants_app.command("create")
def tenants_create(name: Annotated[str, typer.Argument(help="tenant name")],
                   quota: Annotated[int, typer.Option(help="training GPUs guaranteed to dedicated jobs")] = 0,
                   weight: Annotated[float, typer.Option(help="share of spot capacity")] = 1.0,
                   max_priority: Annotated[int, typer.Option(help="the highest priority its jobs may ask for")] = 0,
                   ) -> None:
    """Create a tenant and print its token (shown once; only its hash is stored)."""
    try:
        t = _client().create_tenant(name, quota_gpus=quota, weight=weight, max_priority=max_priority)
    except ApiError as e:
        _fail(e)
    err.print(f"tenant {t['name']}: quota {t['quota_gpus']} GPUs, weight {t['weight']:g}, max priority "
              f"{t['max_priority']}; its token (keep it, "
              "it is not shown again):", highlight=False)
    print(t["token"])


@tenants_app.command("list")
def tenants_list() -> None:
    """Tenants with their quotas and weights."""
    try:
        rows = _client().tenants()
    except ApiError as e:
        _fail(e)
    t = Table(box=None, header_style="bold")
    for col in ("TENANT", "QUOTA", "WEIGHT", "MAX PRIORITY", "ADMIN"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], str(r["quota_gpus"]), f"{r['weight']:g}", str(r.get("max_priority", 0)),
                  "yes" if r["admin"] else "")
    console.print(t)

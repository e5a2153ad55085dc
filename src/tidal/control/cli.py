"""``tidal up`` and the client commands: submit, jobs, status, logs, cancel, pool, tenants, events.

The client commands talk to ``$TIDAL_API_URL`` with ``$TIDAL_TOKEN``, both defaulting to what ``tidal up``
wrote into its state dir (``$TIDAL_STATE_DIR``, default ``~/.tidal``). ``-o json|yaml`` prints what the API
returned; ``-o wide`` adds columns.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from tidal.control import cli_show as show
from tidal.control.cli_show import Fmt
from tidal.control.client import ApiError, TidalClient, default_token, default_url, origin
from tidal.control.follow import LogFollower, Reconnecting
from tidal.control.jobfile import apply_overrides, load_spec_file

TERMINAL = ("succeeded", "failed", "cancelled")
T = TypeVar("T")

tenants_app = typer.Typer(help="Tenants (admin): create, list.", no_args_is_help=True)


OutputOpt = Annotated[Fmt, typer.Option("--output", "-o", help="table, wide (more columns), json or yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="the same as -o json")]


def _client() -> TidalClient:
    return TidalClient(default_url(), default_token())


def _fail(e: Exception | str) -> NoReturn:
    """One line on stderr, exit code 1. An error the client's set-up may explain (no server, a refused
    token) says where the API address and token came from."""
    msg = str(e)
    if isinstance(e, ApiError) and e.status in (0, 401):
        msg += f" [{origin()}]"
    show.console(stderr=True).print(Text.assemble(("error: ", "red"), msg), soft_wrap=True)
    raise typer.Exit(1)


def _call(f: Callable[[TidalClient], T]) -> T:
    """``f`` on a new client; an API error ends the command (:func:`_fail`)."""
    try:
        return f(_client())
    except ApiError as e:
        _fail(e)


def _reconnecting(con: Console, poll_s: float = 0.5) -> Reconnecting:
    """API calls that wait out a restart of ``tidal up``, saying so on ``con``."""
    return Reconnecting(_client, lambda m: con.print(Text(m, style="yellow"), soft_wrap=True), poll_s)


def up(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port; see <state dir>/api.url)")] = 8470,
    gpus: Annotated[str, typer.Option(help="'auto' (NVIDIA GPUs) or N CPU slots")] = "auto",
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL (default: SQLite in the state dir)")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="database, jobs, logs, tokens (default "
                                                        "~/.tidal)")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML of control-plane knobs (docs/control.md)")] = None,
    executor: Annotated[str, typer.Option(help="'local' (this machine), 'ray' (the nodes of a Ray "
                                                 "cluster) or 'virtual:NODESxGPUS' (fake nodes and ranks, "
                                                 "for scale tests)")] = "local",
    ray_address: Annotated[str | None, typer.Option(help="with --executor ray: the cluster to join ('auto', "
                                                          "HOST:PORT); default: start a local Ray")] = None,
    ckpt_agents: Annotated[bool, typer.Option("--ckpt-agents", help="with --executor ray: run a checkpoint "
                                              "agent (the peer-memory tier) on every node, in a buddy "
                                              "ring")] = False,
) -> None:
    """Run the control plane: REST API, reconcile loop and an executor (local, Ray or virtual), in one
    process."""
    import logging

    from tidal.control.client import state_dir as default_state_dir
    from tidal.control.config import ControlConfig
    from tidal.control.server import bind, build, serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.umask(0o077)  # the database, logs, tokens and job directories: the plane's own, 0600/0700
    try:
        cfg = ControlConfig.load(config) if config else ControlConfig()
        sock = bind(host, port)
    except (OSError, ValueError, TypeError) as e:
        _fail(e)
    plane = build(state_dir or default_state_dir(), gpus, db, cfg, executor=executor, ray_address=ray_address,
                  ckpt_agents=ckpt_agents)

    def announce(line: str) -> None:
        show.console().print(Text(line), soft_wrap=True)
        sys.stdout.flush()

    serve(plane, host, port, announce=announce, sock=sock)


def submit(
    file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    wait: Annotated[bool, typer.Option("--wait", help="follow the job until it ends")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="with --wait: events only, not the job's "
                                        "output")] = False,
    name: Annotated[str | None, typer.Option(help="override the spec's name")] = None,
    gpus: Annotated[str | None, typer.Option(help="override gpus: N, or MIN-MAX (elastic)")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="add or override K=V (repeat)")] = None,
    kind: Annotated[str | None, typer.Option(help="override the kind: spot or dedicated")] = None,
    priority: Annotated[int | None, typer.Option(help="override the priority")] = None) -> None:
    """Submit a job; with --wait, stream its output (rank 0) and events until it ends (exit code 0 if it
    succeeded; a failure shows the last lines of the failing rank's log).

    The spec (YAML): name; gpus (N, or min, max, multiple_of); command (an argument list, never run
    through a shell) or run (a shell script, run as bash -c); kind (spot or dedicated); priority; workdir
    (default: the YAML's folder); env; checkpoint (url or tiers, interval_s); max_restarts; grace_s.
    Every field is described in docs/control.md (The job spec). The options above override the file.
    """
    try:
        spec = apply_overrides(
            load_spec_file(file), name=name, gpus=gpus, env=env, kind=kind, priority=priority
        )
        job = _client().submit(spec)
    except ApiError as e:
        if e.errors:
            err = show.console(stderr=True)
            err.print(Text.assemble(("error: ", "red"), f"{file}: the spec was refused:"), soft_wrap=True)
            for line in e.errors:
                err.print(Text(f"  {line}"), soft_wrap=True)
            raise typer.Exit(1) from None
        _fail(e)
    except ValueError as e:
        _fail(e)
    con = show.console()
    con.print(f"submitted [bold]{escape(job['id'])}[/bold] ({escape(job['kind'])}, {show.gpus(job['gpus'])})")
    if wait:
        raise typer.Exit(_wait(job["id"], con, logs=not quiet))


def _events_after(job: str | None, after: int) -> Callable[[TidalClient], list[dict]]:
    """A call of the events of ``job`` (None: all jobs) after event ``after`` (its value now)."""
    return lambda c: c.events(job, after=after)


def _wait(job_id: str, con: Console, *, logs: bool = True, poll_s: float = 0.5) -> int:
    """Follow a job to its end: its events, rank 0's output and a progress line, through restarts of ``tidal
    up``. Returns the exit code: 0 if the job succeeded."""
    from rich.live import Live

    tty = con.is_terminal
    api = _reconnecting(con, poll_s)
    follower = LogFollower(job_id, [0])
    seen, shown, shown_at = 0, "", 0.0
    history: list[dict] = []
    live = Live(console=con, refresh_per_second=4, transient=True) if tty else None
    try:
        if live is not None:
            live.start()
        while True:
            try:
                j = api.call(lambda c: c.job(job_id))
                for e in api.call(_events_after(job_id, seen)):
                    seen = e["id"]
                    history.append(e)
                    con.print(f"[dim]{show.clock(e['time_s'])}[/dim] {show.event_line(e)}", soft_wrap=True)
                if logs:
                    for _, line in api.call(follower.poll):
                        con.print(Text(line), soft_wrap=True)
            except ApiError as e:
                _fail(e)
            line = show.progress_line(j)
            if live is not None:
                live.update(line)
            elif line != shown and time.monotonic() - shown_at >= show.PROGRESS_EVERY_S:
                con.print(line, soft_wrap=True)
                shown, shown_at = line, time.monotonic()
            if j["state"] in TERMINAL and (not logs or follower.done):
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        con.print(f"stopped following {escape(job_id)}; it goes on (tidal cancel {escape(job_id)} stops it)")
        return 130
    finally:
        if live is not None:
            live.stop()
    for _, line in follower.rest():
        con.print(Text(line), soft_wrap=True)
    show.summary(j, con, api.client, history)
    return 0 if j["state"] == "succeeded" else 1


def jobs(state: Annotated[list[str] | None, typer.Option(help="only these states (repeat)")] = None,
         tenant: Annotated[str | None, typer.Option(help="admin: only this tenant's jobs")] = None,
         output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """List jobs (yours; the admin sees all), with why each waiting or below-maximum job is so."""
    rows = _call(lambda c: c.jobs(states=state, tenant=tenant))
    fmt = show.fmt(output, as_json)
    if show.dump(rows, fmt):
        return
    wide = fmt == Fmt.wide
    cols = ["JOB", "TENANT", "STATE", "KIND", "GPUS", "STEP", "STEPS/S", "CKPT", "RESTARTS", "ETTR"]
    if wide:
        cols += ["PRIORITY", "PREEMPTIONS", "LOST STEPS", "PLACEMENT"]
    t = show.table(*cols, no_wrap=True)
    t.add_column("WHY")
    for j in rows:
        p, r, g = j.get("progress") or {}, j["report"], j["gpus"]
        held = sum(j["placement"].values()) if j["placement"] else 0
        want = f"{g['min']}" if g["min"] == g["max"] else f"{g['min']}-{g['max']}"
        cells = [escape(j["id"]), escape(j["tenant"]), show.state(j["state"]), j["kind"], f"{held}/{want}",
                 show.num(p.get("step")), show.num(p.get("steps_per_s"), "{:.1f}"),
                 show.num(j.get("ckpt_step")), str(r["restarts"]), show.num(r["ettr"], "{:.2f}")]
        if wide:
            cells += [str(j["priority"]), str(r["preemptions"]), str(r["lost_steps"]),
                      escape(show.placement(j["placement"]))]
        t.add_row(*cells, escape(show.waiting(j)))
    show.console().print(t)


def status(job: Annotated[str, typer.Argument(help="job id")], output: OutputOpt = Fmt.table,
           as_json: JsonOpt = False) -> None:
    """One job: state, why it waits, progress, checkpoints per tier, restarts, lost work, ETTR, recent
    events; a failed job's failing rank's last log lines. -o json: {job, checkpoints, events}."""
    c = _client()
    try:
        j = c.job(job)
        evs = c.events(job, limit=10000)
        ck = c.checkpoints(job)
    except ApiError as e:
        _fail(e)
    if show.dump({"job": j, "checkpoints": ck, "events": evs}, show.fmt(output, as_json)):
        return
    con = show.console()
    p, g = j.get("progress") or {}, j["gpus"]
    con.print(f"[bold]{escape(j['id'])}[/bold]  {show.state(j['state'])}  tenant {escape(j['tenant'])}, "
              f"{j['kind']}, priority {j['priority']}, GPUs {g['min']}-{g['max']} (x{g['multiple_of']}), "
              f"placement {escape(show.placement(j['placement']))}", soft_wrap=True)
    spec = j["spec"]
    what = spec.get("run") if spec.get("run") else spec.get("command")
    con.print(Text(f"  command: {what}  (workdir {spec.get('workdir') or '-'})"), soft_wrap=True)
    if show.waiting(j):
        con.print(Text(f"  {show.waiting(j)}", style="yellow"), soft_wrap=True)
    if j["message"]:
        con.print(Text(f"  {j['message']}"), soft_wrap=True)
    if p:
        tiers = ", ".join(f"{k}: step {v[0]}" for k, v in (p.get("tiers") or {}).items()) or "none"
        con.print(Text(f"  step {show.num(p.get('step'))} (restored {show.num(p.get('start_step'))}), loss "
                       f"{show.num(p.get('loss'), '{:.4f}')}, {show.num(p.get('steps_per_s'), '{:.2f}')} "
                       f"steps/s, heartbeat phase {p.get('phase') or '-'}; checkpoints: {tiers}"),
                  soft_wrap=True)
    con.print(Text(f"  {show.ckpt_line(ck)}; {show.cadence(j)}"), soft_wrap=True)
    if j.get("handle"):
        con.print(Text(f"  attempt {j['attempt']}: pids {[r['pid'] for r in j['handle'].get('ranks', [])]}, "
                       f"devices {j['handle'].get('devices')}"), soft_wrap=True)
    show.summary(j, con, c, evs)
    for ev in evs[-12:]:
        con.print(f"  [dim]{show.clock(ev['time_s'])}[/dim] {show.event_line(ev)}", soft_wrap=True)


def logs(job: Annotated[str, typer.Argument(help="job id")],
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends "
                                              "(through restarts of tidal up)")] = False,
         rank: Annotated[str, typer.Option(help="which rank's log: a number, or 'all' (each line prefixed "
                                           "with its rank)")] = "0") -> None:
    """A rank's output (stdout and stderr, every attempt), or all ranks' interleaved by line."""
    api = _reconnecting(show.console(stderr=True))
    try:
        if rank == "all":
            j = api.call(lambda c: c.job(job))
            ranks = list(range(max(j["gpus"]["max"], 1)))
        elif rank.isdigit():
            ranks = [int(rank)]
        else:
            _fail(f"--rank: expected a rank number or 'all', got {rank!r}")
        prefix = len(ranks) > 1
        follower = LogFollower(job, ranks)

        def emit(lines: list[tuple[int, str]], end: str = "\n") -> None:
            for r, line in lines:
                sys.stdout.write(f"[rank {r}] {line}{end}" if prefix else line + end)
            sys.stdout.flush()

        emit(api.call(follower.poll) if follow else follower.poll(api.client))
        while follow and not follower.done:
            time.sleep(0.5)
            emit(api.call(follower.poll))
        emit(follower.rest(), end="")
    except ApiError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass


def cancel(job: Annotated[str, typer.Argument(help="job id")]) -> None:
    """Cancel a job: a pending one at once; a running one gets a notice (checkpoint, exit), then is
    cancelled."""
    j = _call(lambda c: c.cancel(job))
    show.console().print(f"{escape(j['id'])}: cancel requested ({escape(j['state'])})")


def pool(output: OutputOpt = Fmt.table, as_json: JsonOpt = False,
         offset: int = typer.Option(0, min=0, help="the first node listed"),
         limit: int = typer.Option(512, min=1, max=4096, help="nodes listed (the totals count all)")) -> None:
    """GPUs per node: who holds them, what is draining, what is free."""
    p = _call(lambda c: c.pool(offset, limit))
    if show.dump(p, show.fmt(output, as_json)):
        return
    t = show.table("NODE", "POOL", "GPUS", "ALLOCATED", "DRAINING", "FREE", "HELD BY")
    for n in p["nodes"]:
        held = ", ".join(f"{h['job'] or h['tenant']} "
                         f"({h['gpus']}{', ' + h['state'] if h['state'] != 'running' else ''})"
                         for h in n["jobs"]) or "-"
        t.add_row(escape(n["name"]), n["pool"], str(n["gpus"]), str(n["allocated"]), str(n["draining"]),
                  str(n["free"]), escape(held))
    con = show.console()
    con.print(t)
    con.print(f"{p['allocated']}/{p['gpus']} GPUs allocated, {p['free']} free, "
              f"{show.plural(p['pending'], 'job')} pending")
    if len(p["nodes"]) < p["nodes_total"]:
        con.print(f"nodes {offset + 1}-{offset + len(p['nodes'])} of {p['nodes_total']} (--offset, --limit)")


def events(job: Annotated[str | None, typer.Argument(help="job id (default: all you may see)")] = None,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False,
           last: Annotated[int, typer.Option(help="show the last N events")] = 50,
           output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """The event log: every transition, decision, adoption and restart (-o json: one object per line
    with --follow)."""
    fmt = show.fmt(output, as_json)
    con = show.console()

    def emit(e: dict) -> None:
        if fmt in (Fmt.json, Fmt.yaml) and follow:
            sys.stdout.write(json.dumps(e, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        else:
            con.print(f"[dim]{show.clock(e['time_s'])}[/dim] {show.event_line(e, with_job=job is None)}",
                      soft_wrap=True)

    api = _reconnecting(show.console(stderr=True))
    try:
        rows = api.client.events(job, limit=10000)
        if not follow and show.dump(rows[-last:] if last else [], fmt):
            return
        for e in rows[-last:] if last else []:
            emit(e)
        seen = rows[-1]["id"] if rows else 0
        while follow:
            time.sleep(0.5)
            for e in api.call(_events_after(job, seen)):
                seen = e["id"]
                emit(e)
    except ApiError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="tenant name")],
    quota: Annotated[int, typer.Option(help="training GPUs guaranteed to dedicated jobs")] = 0,
    weight: Annotated[float, typer.Option(help="share of spot capacity")] = 1.0,
    max_priority: Annotated[int, typer.Option(help="the highest priority its jobs may ask for")] = 0) -> None:
    """Create a tenant and print its token on stdout (shown once; only its hash is stored)."""
    t = _call(lambda c: c.create_tenant(name, quota_gpus=quota, weight=weight, max_priority=max_priority))
    show.console(stderr=True).print(Text(
        f"tenant {t['name']}: quota {show.plural(t['quota_gpus'], 'GPU')}, weight {t['weight']:g}, "
        f"max priority {t['max_priority']}; its token (keep it, it is not shown again; give it to the "
        "tenant as TIDAL_TOKEN):"),
        soft_wrap=True)
    print(t["token"])


@tenants_app.command("list")
def tenants_list(output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """Tenants with their quotas and weights."""
    rows = _call(lambda c: c.tenants())
    if show.dump(rows, show.fmt(output, as_json)):
        return
    t = show.table("TENANT", "QUOTA", "WEIGHT", "MAX PRIORITY", "ADMIN")
    for r in rows:
        t.add_row(escape(r["name"]), str(r["quota_gpus"]), f"{r['weight']:g}", str(r.get("max_priority", 0)),
                  "yes" if r["admin"] else "")
    show.console().print(t)

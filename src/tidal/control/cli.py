"""``tidal up`` and the client commands: submit, jobs, status, logs, cancel, pool, tenants, events.

The client commands talk to the API at ``$TIDAL_API_URL`` with ``$TIDAL_TOKEN``; on the machine
running ``tidal up`` both default to what it wrote into its state dir (``$TIDAL_STATE_DIR``,
default ``~/.tidal``), so ``tidal up --gpus 2 &`` then ``tidal submit job.yaml --wait`` just works.

Text from users and from the server (job names, commands, messages, log lines, errors) is never read
as Rich markup: it is escaped (``escape``) or printed as a ``Text``, so ``[python, train.py]`` prints
as written. ``-o json|yaml`` prints what the API returned, for scripts; ``-o wide`` adds columns.
"""

from __future__ import annotations

import json
import os
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tidal.control.client import ApiError, TidalClient, default_token, default_url, origin
from tidal.control.follow import LogFollower, Reconnecting, failing_rank, log_tail

TERMINAL = ("succeeded", "failed", "cancelled")
STATE_STYLE = {"running": "green", "succeeded": "bold green", "failed": "bold red", "cancelled": "dim",
               "pending": "yellow", "backoff": "red", "preempting": "magenta", "resizing": "magenta",
               "cancelling": "magenta", "admitted": "cyan"}
TAIL_LINES = 12  # lines of the failing rank's log shown with a failure

tenants_app = typer.Typer(help="Tenants (admin): create, list.", no_args_is_help=True)


class Fmt(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


OutputOpt = Annotated[Fmt, typer.Option("--output", "-o", help="table, wide (more columns), json or yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="the same as -o json")]


def _console(stderr: bool = False) -> Console:
    """A terminal gets its width and colours; piped output is not cut at 80 columns (unless COLUMNS says)."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    width = None if tty or "COLUMNS" in os.environ else 200
    return Console(stderr=stderr, width=width, highlight=False)


def _client() -> TidalClient:
    return TidalClient(default_url(), default_token())


def _fail(e: Exception | str) -> None:
    """One line on stderr, exit code 1. An error the client's set-up may explain (no server, a refused
    token) says where the API address and token came from."""
    msg = str(e)
    if isinstance(e, ApiError) and e.status in (0, 401):
        msg += f" [{origin()}]"
    _console(stderr=True).print(Text.assemble(("error: ", "red"), msg), soft_wrap=True)
    raise typer.Exit(1)


def _fmt(output: Fmt, as_json: bool) -> Fmt:
    return Fmt.json if as_json else output


def _dump(doc: Any, fmt: Fmt) -> bool:
    """Print ``doc`` as JSON or YAML on stdout if ``fmt`` asks for it (then True)."""
    if fmt == Fmt.json:
        sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    elif fmt == Fmt.yaml:
        import yaml

        sys.stdout.write(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    else:
        return False
    sys.stdout.flush()
    return True


def _state(s: str) -> str:
    return f"[{STATE_STYLE.get(s, 'white')}]{escape(s)}[/]"


def _num(v: Any, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _gpus(g: dict) -> str:
    n = f"{g['min']}" if g["min"] == g["max"] else f"{g['min']}-{g['max']}"
    return f"{n} GPU" if g["max"] == 1 else f"{n} GPUs"


def _placement(p: dict | None) -> str:
    return ", ".join(f"{n}: {g}" for n, g in p.items()) if p else "none"


def _waiting(j: dict) -> str:
    """Why a pending job waits or a running one is below its maximum (the scheduler's own reason)."""
    w = j.get("waiting") or {}
    if not w.get("reason"):
        return ""
    until = w.get("until_s")
    return w["reason"] + (f" (until {_clock(until, tenths=False)})" if until else "")


# ------------------------------------------------------------------------------------------- up
def up(host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
       port: Annotated[int, typer.Option(help="TCP port (0: any free port; see <state dir>/api.url)")] = 8470,
       gpus: Annotated[str, typer.Option(help="'auto' (NVIDIA GPUs) or N CPU slots")] = "auto",
       db: Annotated[str | None, typer.Option(help="SQLAlchemy URL (default: SQLite in the state dir)")] = None,
       state_dir: Annotated[Path | None, typer.Option(help="database, jobs, logs, tokens (default ~/.tidal)")] = None,
       config: Annotated[Path | None, typer.Option(help="YAML of control-plane knobs (docs/control.md)")] = None,
       ) -> None:
    """Run the control plane: REST API, reconcile loop and local executor, in one process."""
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
    plane = build(state_dir or default_state_dir(), gpus, db, cfg)

    def announce(line: str) -> None:
        _console().print(Text(line), soft_wrap=True)
        sys.stdout.flush()

    serve(plane, host, port, announce=announce, sock=sock)


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
           wait: Annotated[bool, typer.Option("--wait", help="follow the job until it ends")] = False,
           quiet: Annotated[bool, typer.Option("--quiet", "-q", help="with --wait: events only, not the job's output")]
           = False,
           name: Annotated[str | None, typer.Option(help="override the spec's name")] = None,
           gpus: Annotated[str | None, typer.Option(help="override gpus: N, or MIN-MAX (elastic)")] = None,
           env: Annotated[list[str] | None, typer.Option("--env", "-e", help="add or override K=V (repeat)")] = None,
           kind: Annotated[str | None, typer.Option(help="override the kind: spot or dedicated")] = None,
           priority: Annotated[int | None, typer.Option(help="override the priority")] = None,
           ) -> None:
    """Submit a job; with --wait, stream its output (rank 0) and events until it ends (exit code 0 if it
    succeeded; a failure shows the last lines of the failing rank's log).

    The spec (YAML): name; gpus (N, or min, max, multiple_of); command (an argument list, never run
    through a shell) or run (a shell script, run as bash -c); kind (spot or dedicated); priority; workdir
    (default: the YAML's folder); env; checkpoint (url or tiers, interval_s); max_restarts; grace_s.
    Every field is described in docs/control.md (The job spec). The options above override the file.
    """
    try:
        spec = apply_overrides(load_spec_file(file), name=name, gpus=gpus, env=env, kind=kind, priority=priority)
        job = _client().submit(spec)
    except ApiError as e:
        if e.errors:
            err = _console(stderr=True)
            err.print(Text.assemble(("error: ", "red"), f"{file}: the spec was refused:"), soft_wrap=True)
            for line in e.errors:
                err.print(Text(f"  {line}"), soft_wrap=True)
            raise typer.Exit(1) from None
        _fail(e)
    except ValueError as e:
        _fail(e)
    con = _console()
    con.print(f"submitted [bold]{escape(job['id'])}[/bold] ({escape(job['kind'])}, {_gpus(job['gpus'])})")
    if wait:
        raise typer.Exit(_wait(job["id"], con, logs=not quiet))


def apply_overrides(doc: dict, *, name: str | None = None, gpus: str | None = None, env: list[str] | None = None,
                    kind: str | None = None, priority: int | None = None) -> dict:
    """The spec with the command line's overrides (``--gpus 4`` or ``2-8``, ``--env K=V``, ...); the
    server checks the result like any spec. ``ValueError`` names a malformed option."""
    out = dict(doc)
    if name is not None:
        out["name"] = name
    if kind is not None:
        out["kind"] = kind
    if priority is not None:
        out["priority"] = priority
    if gpus is not None:
        lo, sep, hi = gpus.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--gpus: expected N or MIN-MAX (e.g. 4 or 2-8), got {gpus!r}")
        g = out.get("gpus")
        keep = {"multiple_of": g["multiple_of"]} if isinstance(g, dict) and "multiple_of" in g else {}
        out["gpus"] = {"min": int(lo), "max": int(hi), **keep} if sep else (
            {"min": int(lo), **keep} if keep else int(lo))
    if env:
        merged = dict(out.get("env") or {}) if isinstance(out.get("env"), dict) else {}
        for item in env:
            k, eq, v = item.partition("=")
            if not eq or not k:
                raise ValueError(f"--env: expected K=V, got {item!r}")
            merged[k] = v
        out["env"] = merged
    return out


def _wait(job_id: str, con: Console, *, logs: bool = True, poll_s: float = 0.5) -> int:
    """Follow a job to its end: its events, rank 0's output (``logs``), a progress line (a live one on a
    terminal; elsewhere printed when it changes, at most every ``PROGRESS_EVERY_S``). Retries through
    restarts of ``tidal up``. Returns the exit code: 0 if the job succeeded."""
    from rich.live import Live

    tty = con.is_terminal
    api = Reconnecting(_client, lambda m: con.print(Text(m, style="yellow"), soft_wrap=True), poll_s)
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
                for e in api.call(lambda c, after=seen: c.events(job_id, after=after)):
                    seen = e["id"]
                    history.append(e)
                    con.print(f"[dim]{_clock(e['time_s'])}[/dim] {_event_line(e)}", soft_wrap=True)
                if logs:
                    for _, line in api.call(follower.poll):
                        con.print(Text(line), soft_wrap=True)
            except ApiError as e:
                _fail(e)
            line = _progress_line(j)
            if live is not None:
                live.update(line)
            elif line != shown and time.monotonic() - shown_at >= PROGRESS_EVERY_S:
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
    _summary(j, con, api.client, history)
    return 0 if j["state"] == "succeeded" else 1


PROGRESS_EVERY_S = 10.0


def _progress_line(j: dict) -> str:
    p = j.get("progress") or {}
    parts = [f"{escape(j['id'])}: {_state(j['state'])}"]
    if p.get("step") is not None:
        parts.append(f"step {p['step']}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4f}")
    if p.get("steps_per_s"):
        parts.append(f"{p['steps_per_s']:.2f} steps/s")
    if p.get("ckpt_step") is not None:
        parts.append(f"checkpoint {p['ckpt_step']}")
    if _waiting(j):
        parts.append(escape(_waiting(j)))
    return " | ".join(parts)


def _resizes(events: list[dict] | None) -> str:
    """``, shrinks 1, grows 2`` from the job's transitions to resizing (a shrink is not a preemption)."""
    if events is None:
        return ""
    to = [e["message"] for e in events if e.get("kind") == "transition" and e.get("to") == "resizing"]
    return (f", shrinks {sum(m.startswith('shrink') for m in to)}, grows {sum(m.startswith('grow') for m in to)}")


def _summary(j: dict, con: Console, c: TidalClient | None = None, events: list[dict] | None = None) -> None:
    r = j["report"]
    con.print(f"{escape(j['id'])}: {_state(j['state'])}" + (f" — {escape(j['message'])}" if j["message"] else ""),
              soft_wrap=True)
    con.print(f"  attempts {j['attempt']}, restarts {r['restarts']}, preemptions {r['preemptions']}{_resizes(events)}, "
              f"lost work {r['lost_work_s']:.1f} s ({_plural(r['lost_steps'], 'step')}), "
              f"ETTR {_num(r['ettr'], '{:.2f}')}", soft_wrap=True)
    if c is not None and j["state"] in ("failed", "backoff"):
        _failure_tail(j["id"], con, c, events)


def _failure_tail(job_id: str, con: Console, c: TidalClient, events: list[dict] | None = None) -> None:
    """The last lines of the failing rank's log: the cause a non-zero exit code does not tell."""
    try:
        evs = events if events is not None else c.events(job_id, limit=10000)
        rank = failing_rank(evs)
        if rank is None:
            return
        tail = log_tail(c, job_id, rank, TAIL_LINES)
    except ApiError:
        return
    if not tail:
        con.print(f"  rank {rank} wrote nothing to its log", soft_wrap=True)
        return
    con.print(f"  the last lines of rank {rank}'s log (tidal logs {escape(job_id)} --rank {rank}):", soft_wrap=True)
    for line in tail:
        con.print(Text(f"    {line}", style="dim"), soft_wrap=True)


# ------------------------------------------------------------------------------------------ jobs
def jobs(state: Annotated[list[str] | None, typer.Option(help="only these states (repeat)")] = None,
         tenant: Annotated[str | None, typer.Option(help="admin: only this tenant's jobs")] = None,
         output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """List jobs (yours; the admin sees all), with why each waiting or below-maximum job is so."""
    try:
        rows = _client().jobs(states=state, tenant=tenant)
    except ApiError as e:
        _fail(e)
    fmt = _fmt(output, as_json)
    if _dump(rows, fmt):
        return
    wide = fmt == Fmt.wide
    t = Table(box=None, header_style="bold")
    cols = ["JOB", "TENANT", "STATE", "KIND", "GPUS", "STEP", "STEPS/S", "CKPT", "RESTARTS", "ETTR"]
    if wide:
        cols += ["PRIORITY", "PREEMPTIONS", "LOST STEPS", "PLACEMENT"]
    for col in cols:
        t.add_column(col, no_wrap=True)
    t.add_column("WHY")
    for j in rows:
        p, r, g = j.get("progress") or {}, j["report"], j["gpus"]
        held = sum(j["placement"].values()) if j["placement"] else 0
        want = f"{g['min']}" if g["min"] == g["max"] else f"{g['min']}-{g['max']}"
        cells = [escape(j["id"]), escape(j["tenant"]), _state(j["state"]), j["kind"], f"{held}/{want}",
                 _num(p.get("step")), _num(p.get("steps_per_s"), "{:.1f}"), _num(j.get("ckpt_step")),
                 str(r["restarts"]), _num(r["ettr"], "{:.2f}")]
        if wide:
            cells += [str(j["priority"]), str(r["preemptions"]), str(r["lost_steps"]),
                      escape(_placement(j["placement"]))]
        t.add_row(*cells, escape(_waiting(j)))
    _console().print(t)


def status(job: Annotated[str, typer.Argument(help="job id")],
           output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """One job: state, why it waits, progress, checkpoints per tier, restarts, lost work, ETTR, recent
    events; a failed job's failing rank's last log lines. -o json: {job, checkpoints, events}."""
    c = _client()
    try:
        j = c.job(job)
        evs = c.events(job, limit=10000)
        ck = c.checkpoints(job)
    except ApiError as e:
        _fail(e)
    if _dump({"job": j, "checkpoints": ck, "events": evs}, _fmt(output, as_json)):
        return
    con = _console()
    p, g = j.get("progress") or {}, j["gpus"]
    con.print(f"[bold]{escape(j['id'])}[/bold]  {_state(j['state'])}  tenant {escape(j['tenant'])}, {j['kind']}, "
              f"priority {j['priority']}, GPUs {g['min']}-{g['max']} (x{g['multiple_of']}), "
              f"placement {escape(_placement(j['placement']))}", soft_wrap=True)
    spec = j["spec"]
    what = spec.get("run") if spec.get("run") else spec.get("command")
    con.print(Text(f"  command: {what}  (workdir {spec.get('workdir') or '-'})"), soft_wrap=True)
    if _waiting(j):
        con.print(Text(f"  {_waiting(j)}", style="yellow"), soft_wrap=True)
    if j["message"]:
        con.print(Text(f"  {j['message']}"), soft_wrap=True)
    if p:
        tiers = ", ".join(f"{k}: step {v[0]}" for k, v in (p.get("tiers") or {}).items()) or "none"
        con.print(Text(f"  step {_num(p.get('step'))} (restored {_num(p.get('start_step'))}), loss "
                       f"{_num(p.get('loss'), '{:.4f}')}, {_num(p.get('steps_per_s'), '{:.2f}')} steps/s, "
                       f"heartbeat phase {p.get('phase') or '-'}; checkpoints: {tiers}"), soft_wrap=True)
    con.print(Text(f"  {_ckpt_line(ck)}; {_cadence(j)}"), soft_wrap=True)
    if j.get("handle"):
        con.print(Text(f"  attempt {j['attempt']}: pids {[r['pid'] for r in j['handle'].get('ranks', [])]}, "
                       f"devices {j['handle'].get('devices')}"), soft_wrap=True)
    _summary(j, con, c, evs)
    for e in evs[-12:]:
        con.print(f"  [dim]{_clock(e['time_s'])}[/dim] {_event_line(e)}", soft_wrap=True)


def _cadence(j: dict) -> str:
    """Which checkpoint cadence is in effect: the job's own steps, the spec's seconds, or the platform's."""
    own = (j.get("progress") or {}).get("ckpt_every_steps")
    fixed = ((j.get("spec") or {}).get("checkpoint") or {}).get("interval_s", "auto")
    if own:
        return f"cadence: every {own} steps (the job's own)"
    if fixed != "auto":
        return f"cadence: every {_num(fixed)} s (the spec's interval_s)"
    if j.get("ckpt_interval_s"):
        return f"cadence: every {j['ckpt_interval_s']:.0f} s (the platform's, interval_s: auto)"
    return "cadence: the platform's (interval_s: auto), set once a save's stall is measured"


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
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends "
                                                                     "(through restarts of tidal up)")] = False,
         rank: Annotated[str, typer.Option(help="which rank's log: a number, or 'all' (each line prefixed "
                                                "with its rank)")] = "0") -> None:
    """A rank's output (stdout and stderr, every attempt), or all ranks' interleaved by line."""
    err = _console(stderr=True)
    api = Reconnecting(_client, lambda m: err.print(Text(m, style="yellow"), soft_wrap=True))
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

        def show(lines: list[tuple[int, str]], end: str = "\n") -> None:
            for r, line in lines:
                sys.stdout.write(f"[rank {r}] {line}{end}" if prefix else line + end)
            sys.stdout.flush()

        while True:
            if follow:
                show(api.call(follower.poll))
            else:
                try:
                    show(follower.poll(api.client))
                except ApiError as e:
                    _fail(e)
            if not follow or follower.done:
                break
            time.sleep(0.5)
        show(follower.rest(), end="")
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
    _console().print(f"{escape(j['id'])}: cancel requested ({escape(j['state'])})")


def pool(output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """GPUs per node: who holds them, what is draining, what is free."""
    try:
        p = _client().pool()
    except ApiError as e:
        _fail(e)
    if _dump(p, _fmt(output, as_json)):
        return
    t = Table(box=None, header_style="bold")
    for col in ("NODE", "POOL", "GPUS", "ALLOCATED", "DRAINING", "FREE", "HELD BY"):
        t.add_column(col)
    for n in p["nodes"]:
        held = ", ".join(f"{h['job'] or h['tenant']} ({h['gpus']}{', ' + h['state'] if h['state'] != 'running' else ''})"
                         for h in n["jobs"]) or "-"
        t.add_row(escape(n["name"]), n["pool"], str(n["gpus"]), str(n["allocated"]), str(n["draining"]),
                  str(n["free"]), escape(held))
    con = _console()
    con.print(t)
    con.print(f"{p['allocated']}/{p['gpus']} GPUs allocated, {p['free']} free, "
              f"{_plural(p['pending'], 'job')} pending")


def events(job: Annotated[str | None, typer.Argument(help="job id (default: all you may see)")] = None,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False,
           last: Annotated[int, typer.Option(help="show the last N events")] = 50,
           output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """The event log: every transition, decision, adoption and restart (-o json: one object per line
    with --follow)."""
    fmt = _fmt(output, as_json)
    con = _console()

    def show(e: dict) -> None:
        if fmt in (Fmt.json, Fmt.yaml) and follow:
            sys.stdout.write(json.dumps(e, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        else:
            con.print(f"[dim]{_clock(e['time_s'])}[/dim] {_event_line(e, with_job=job is None)}", soft_wrap=True)

    api = Reconnecting(_client, lambda m: _console(stderr=True).print(Text(m, style="yellow"), soft_wrap=True))
    try:
        rows = api.client.events(job, limit=10000)
        if not follow and _dump(rows[-last:] if last else [], fmt):
            return
        for e in rows[-last:] if last else []:
            show(e)
        seen = rows[-1]["id"] if rows else 0
        while follow:
            time.sleep(0.5)
            for e in api.call(lambda c, after=seen: c.events(job, after=after)):
                seen = e["id"]
                show(e)
    except ApiError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass


def _clock(t: float, tenths: bool = True) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + (f".{int(t % 1 * 10)}" if tenths else "")


def _event_line(e: dict, with_job: bool = False) -> str:
    who = f"{escape(e['job'])} " if with_job and e.get("job") else ""
    if e["kind"] == "transition":
        arrow = f"{escape(e['from'] or 'new')} -> {_state(e['to'])}"
        return f"{who}{arrow}: {escape(e['message'])}"
    return f"{who}[bold]{escape(e['kind'])}[/bold]: {escape(e['message'])}"


# --------------------------------------------------------------------------------------- tenants
@tenants_app.command("create")
def tenants_create(name: Annotated[str, typer.Argument(help="tenant name")],
                   quota: Annotated[int, typer.Option(help="training GPUs guaranteed to dedicated jobs")] = 0,
                   weight: Annotated[float, typer.Option(help="share of spot capacity")] = 1.0,
                   max_priority: Annotated[int, typer.Option(help="the highest priority its jobs may ask for")] = 0,
                   ) -> None:
    """Create a tenant and print its token on stdout (shown once; only its hash is stored)."""
    try:
        t = _client().create_tenant(name, quota_gpus=quota, weight=weight, max_priority=max_priority)
    except ApiError as e:
        _fail(e)
    _console(stderr=True).print(Text(
        f"tenant {t['name']}: quota {_plural(t['quota_gpus'], 'GPU')}, weight {t['weight']:g}, max priority "
        f"{t['max_priority']}; its token (keep it, it is not shown again; give it to the tenant as "
        "TIDAL_TOKEN):"), soft_wrap=True)
    print(t["token"])


@tenants_app.command("list")
def tenants_list(output: OutputOpt = Fmt.table, as_json: JsonOpt = False) -> None:
    """Tenants with their quotas and weights."""
    try:
        rows = _client().tenants()
    except ApiError as e:
        _fail(e)
    if _dump(rows, _fmt(output, as_json)):
        return
    t = Table(box=None, header_style="bold")
    for col in ("TENANT", "QUOTA", "WEIGHT", "MAX PRIORITY", "ADMIN"):
        t.add_column(col)
    for r in rows:
        t.add_row(escape(r["name"]), str(r["quota_gpus"]), f"{r['weight']:g}", str(r.get("max_priority", 0)),
                  "yes" if r["admin"] else "")
    _console().print(t)

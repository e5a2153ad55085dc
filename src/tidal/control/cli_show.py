"""How the client commands print: states, events, progress, summaries and the failing rank's last log lines.
Text from users and the server is never read as Rich markup (``escape`` or a ``Text``); ``dump`` prints what
the API returned as JSON or YAML."""

from __future__ import annotations

import json
import sys
import time
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tidal.console import console  # noqa: F401  (the commands' console, re-exported)
from tidal.control.client import ApiError, TidalClient
from tidal.control.follow import failing_rank, log_tail

STATE_STYLE = {"running": "green", "succeeded": "bold green", "failed": "bold red", "cancelled": "dim",
               "pending": "yellow", "backoff": "red", "preempting": "magenta", "resizing": "magenta",
               "cancelling": "magenta", "admitted": "cyan"}
TAIL_LINES = 12  # lines of the failing rank's log shown with a failure
PROGRESS_EVERY_S = 10.0  # how often ``--wait`` prints a changed progress line when not on a terminal


class Fmt(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


def fmt(output: Fmt, as_json: bool) -> Fmt:
    return Fmt.json if as_json else output


def dump(doc: Any, fmt: Fmt) -> bool:
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


def table(*columns: str, no_wrap: bool = False) -> Table:
    """The commands' table: no box, bold headers, these columns."""
    t = Table(box=None, header_style="bold")
    for col in columns:
        t.add_column(col, no_wrap=no_wrap)
    return t


def state(s: str) -> str:
    return f"[{STATE_STYLE.get(s, 'white')}]{escape(s)}[/]"


def num(v: Any, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def gpus(g: dict) -> str:
    n = f"{g['min']}" if g["min"] == g["max"] else f"{g['min']}-{g['max']}"
    return f"{n} GPU" if g["max"] == 1 else f"{n} GPUs"


def placement(p: dict | None) -> str:
    return ", ".join(f"{n}: {g}" for n, g in p.items()) if p else "none"


def waiting(j: dict) -> str:
    """Why a pending job waits or a running one is below its maximum (the scheduler's own reason)."""
    w = j.get("waiting") or {}
    if not w.get("reason"):
        return ""
    until = w.get("until_s")
    return w["reason"] + (f" (until {clock(until, tenths=False)})" if until else "")


def progress_line(j: dict) -> str:
    p = j.get("progress") or {}
    parts = [f"{escape(j['id'])}: {state(j['state'])}"]
    if p.get("step") is not None:
        parts.append(f"step {p['step']}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4f}")
    if p.get("steps_per_s"):
        parts.append(f"{p['steps_per_s']:.2f} steps/s")
    if p.get("ckpt_step") is not None:
        parts.append(f"checkpoint {p['ckpt_step']}")
    if waiting(j):
        parts.append(escape(waiting(j)))
    return " | ".join(parts)


def resizes(events: list[dict] | None) -> str:
    """``, shrinks 1, grows 2`` from the job's transitions to resizing (a shrink is not a preemption)."""
    if events is None:
        return ""
    to = [e["message"] for e in events if e.get("kind") == "transition" and e.get("to") == "resizing"]
    return (
        f", shrinks {sum(m.startswith('shrink') for m in to)}, grows {sum(m.startswith('grow') for m in to)}"
    )


def summary(j: dict, con: Console, c: TidalClient | None = None, events: list[dict] | None = None) -> None:
    r = j["report"]
    con.print(
        f"{escape(j['id'])}: {state(j['state'])}" + (f" — {escape(j['message'])}" if j["message"] else ""),
        soft_wrap=True)
    con.print(f"  attempts {j['attempt']}, restarts {r['restarts']}, preemptions {r['preemptions']}"
              f"{resizes(events)}, lost work {r['lost_work_s']:.1f} s ({plural(r['lost_steps'], 'step')}), "
              f"ETTR {num(r['ettr'], '{:.2f}')}", soft_wrap=True)
    if c is not None and j["state"] in ("failed", "backoff"):
        failure_tail(j["id"], con, c, events)


def failure_tail(job_id: str, con: Console, c: TidalClient, events: list[dict] | None = None) -> None:
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
    con.print(f"  the last lines of rank {rank}'s log (tidal logs {escape(job_id)} --rank {rank}):",
              soft_wrap=True)
    for line in tail:
        con.print(Text(f"    {line}", style="dim"), soft_wrap=True)


def cadence(j: dict) -> str:
    """Which checkpoint cadence is in effect: the job's own steps, the spec's seconds, or the platform's."""
    own = (j.get("progress") or {}).get("ckpt_every_steps")
    fixed = ((j.get("spec") or {}).get("checkpoint") or {}).get("interval_s", "auto")
    if own:
        return f"cadence: every {own} steps (the job's own)"
    if fixed != "auto":
        return f"cadence: every {num(fixed)} s (the spec's interval_s)"
    if j.get("ckpt_interval_s"):
        return f"cadence: every {j['ckpt_interval_s']:.0f} s (the platform's, interval_s: auto)"
    return "cadence: the platform's (interval_s: auto), set once a save's stall is measured"


def ckpt_line(ck: dict) -> str:
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
        age = num(ck.get("durable_age_s"), "{:.1f}")
        line += f"; newest durable step {ck['newest_durable_step']}, {age} s old"
    return line


def clock(t: float, tenths: bool = True) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + (f".{int(t % 1 * 10)}" if tenths else "")


def event_line(e: dict, with_job: bool = False) -> str:
    who = f"{escape(e['job'])} " if with_job and e.get("job") else ""
    if e["kind"] == "transition":
        arrow = f"{escape(e['from'] or 'new')} -> {state(e['to'])}"
        return f"{who}{arrow}: {escape(e['message'])}"
    return f"{who}[bold]{escape(e['kind'])}[/bold]: {escape(e['message'])}"

"""What ``tidal demo`` shows (:mod:`tidal.demo.single`): the live status panel, the one-line progress
for a pipe, event lines and the summary table. Job and summary documents in, Rich renderables out;
nothing here talks to the plane."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from tidal.control.cli_show import STATE_STYLE  # one palette for job states, CLI and demo
from tidal.demo.options import DemoOptions
from tidal.demo.plane import Kill


def _state(s: str) -> str:
    return f"[{STATE_STYLE.get(s, 'magenta')}]{s}[/]"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 10)}"


def event_line(e: dict) -> str:
    if e["kind"] == "transition":
        return f"{e['from'] or 'new'} -> {_state(e['to'])}: {escape(e['message'])}"
    return f"[bold]{escape(e['kind'])}[/bold]: {escape(e['message'])}"


def _tiers(p: dict) -> str:
    tiers = p.get("tiers") or {}
    shm_first = sorted(tiers.items(), key=lambda kv: kv[0] != "shm")
    return " · ".join(f"{t} step {v[0]}" for t, v in shm_first) or "none yet"


def _fmt(v: Any, fmt: str = "{:g}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def status_panel(j: dict, opts: DemoOptions, elapsed_s: float, kill: Kill | None, initial_loss: float | None
                 ) -> Panel:
    p, r = j.get("progress") or {}, j["report"]
    now_step = p.get("step")
    step: int = now_step if now_step is not None else (p.get("start_step") or 0)
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column()
    g.add_row("job",
              f"{j['id']}: spot, {opts.gpus} ranks ({opts.parallel.upper()} over gloo), tenant {j['tenant']}")
    g.add_row("state", f"{_state(j['state'])}, attempt {j['attempt']}")
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=opts.steps, completed=step, width=40), f"step {step}/{opts.steps}")
    g.add_row("progress", bar)
    loss = _fmt(p.get("loss"), "{:.3f}")
    g.add_row("loss", loss + (f"  (first step {initial_loss:.3f})" if initial_loss is not None else ""))
    sps = p.get("steps_per_s")
    g.add_row("throughput", f"{sps * opts.global_batch:.0f} samples/s ({sps:.1f} steps/s)" if sps else "-")
    g.add_row("checkpoint", f"{_tiers(p)}   (every {opts.ckpt_every} steps)")
    g.add_row("restarts", f"{r['restarts']}   lost {r['lost_steps']} steps ({r['lost_work_s']:.1f} s)   "
                          f"ETTR {_fmt(r['ettr'], '{:.2f}')}")
    if kill is not None:
        g.add_row("killed", f"rank {kill.rank} (pid {kill.pid}, child of shim pid {kill.shim_pid}) when step "
                            f"{kill.at_step} was last reported; newest checkpoint then: step "
                            f"{kill.ckpt_step}")
    g.add_row("elapsed", f"{elapsed_s:.0f} s")
    return Panel(g, title="[bold]tidal demo[/bold]", border_style="cyan", expand=False)


def progress_line(j: dict, opts: DemoOptions) -> str:
    p, r = j.get("progress") or {}, j["report"]
    sps = p.get("steps_per_s")
    return (
        f"  {j['state']} | attempt {j['attempt']} | step {_fmt(p.get('step'))}/{opts.steps} | loss "
        f"{_fmt(p.get('loss'), '{:.3f}')} | {_fmt(sps and sps * opts.global_batch, '{:.0f}')} samples/s | "
        f"checkpoint {_tiers(p)} | restarts {r['restarts']}"
    )


def summary_table(s: dict) -> Table:
    t = Table(title=f"tidal demo: {s['job']} {s['state']}", show_header=False, title_style="bold")
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    t.add_row("steps",
              f"{_fmt(s['final_step'])} of {s['steps']} ({s['parallel'].upper()} on {s['ranks']} ranks)")
    t.add_row("loss", f"{_fmt(s['initial_loss'], '{:.3f}')} at the first step -> "
                      f"{_fmt(s['final_loss'], '{:.3f}')} at the last")
    k = s["killed"]
    t.add_row("killed", "nothing" if k is None else f"rank {k['rank']} (pid {k['pid']}, child of shim pid "
                        f"{k['shim_pid']}; SIGKILL) in attempt {k['attempt']}, which had reached step "
                        f"{_fmt(k['reached_step'])} (step {k['at_step']} was the last reported)")
    t.add_row("restarts", f"{s['restarts']} ({s['attempts']} attempts)")
    how = (f" (tier {s['restore_tier']}, read in {s['restore_s']:.2f} s)" if s["restore_tier"]
           else " (nothing restored)")
    resumed = "-" if s["resumed_from_step"] is None else f"checkpoint step {s['resumed_from_step']}{how}"
    t.add_row("resumed from", resumed)
    t.add_row("time to recover",
              f"{_fmt(s['recovery_s'], '{:.1f} s')} (kill -> first step of the next attempt)")
    t.add_row("steps recomputed", f"{_fmt(s['steps_recomputed'])} (reached - resumed); the platform's "
                                  f"lost-work account: {s['lost_steps']} steps, {s['lost_work_s']:.1f} s")
    t.add_row("ETTR", f"{_fmt(s['ettr'], '{:.2f}')} (productive {s['productive_s']:.1f} s of "
                      f"{s['held_s']:.1f} s holding GPUs)")
    for tier, steps in s["checkpoints"].items():
        t.add_row(f"checkpoints ({tier})", f"{len(steps)}: steps {', '.join(map(str, steps))}")
    t.add_row("checkpoint stall", _fmt(s["ckpt_stall_median_s"] and s["ckpt_stall_median_s"] * 1000,
                                       "median {:.0f} ms a save"))
    t.add_row("wall time", f"{s['wall_s']:.0f} s")
    if s["state_dir"]:
        t.add_row("state dir", s["state_dir"])
    verdict = ("[bold green]recovered from a checkpoint and finished[/bold green]" if s["ok"]
               else "[bold red]FAILED[/bold red]: " + "; ".join(s["problems"]))
    t.add_row("verdict", verdict)
    return t

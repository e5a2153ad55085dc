"""``tidal demo cycle``: a day of lending and reclaiming serving GPUs, live, on this machine, set beside the
same day through the simulator (docs/loaning.md, README)."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

import tidal.serving
from tidal.control.auth import ADMIN_TOKEN_FILE
from tidal.control.client import TidalClient
from tidal.control.dashboard import dashboard_url
from tidal.demo.options import SIZES, example_script, gpt_job
from tidal.demo.plane import PLANE_CONFIG, DemoError, EmbeddedPlane, uninterrupted
from tidal.serving.watch import WatchConfig

PROFILE = Path(tidal.serving.__file__).parent / "data" / "daily-profile.csv"
DAY = 86400.0
NARRATED = frozenset({"loan", "reclaim", "return", "serving_action_failed"})  # event kinds the view prints


@dataclass(frozen=True)
class CycleOptions:
    speedup: float = 240.0
    hours: float = 24.0
    start_hour: float = 18.0
    history_days: int = 3
    serving_nodes: str = "8x2"
    jobs: int = 2
    max_ranks: int = 3
    grace_s: float = 8.0
    final_checkpoint_s: float = 4.0
    release_s: float = 2.0
    warmup_s: float = 6.0
    restart_cost_s: float = 10.0
    shortfall_budget: float = 0.005
    ckpt_every: int = 10
    size: str = "tiny"
    trace: str | None = None

    def check(self) -> None:
        if not 1 <= self.speedup <= 10000:
            raise DemoError(f"--speedup {self.speedup:g}: expected 1 to 10000")
        if not 0 < self.hours <= 72:
            raise DemoError(f"--hours {self.hours:g}: expected more than 0, at most 72")
        if not 0 <= self.start_hour < 24:
            raise DemoError(f"--start-hour {self.start_hour:g}: expected 0 to 24")
        if not 1 <= self.jobs <= 8 or not 1 <= self.max_ranks <= 4:
            raise DemoError("--jobs must be 1 to 8 and --max-ranks 1 to 4")
        if SIZES[self.size]["global-batch"] % math.lcm(*range(1, self.max_ranks + 1)):
            raise DemoError(f"--max-ranks {self.max_ranks}: the global batch must split over every size")

    @property
    def start_s(self) -> float:
        """Serving time (the profile's axis) where the live day starts."""
        return self.history_days * DAY + self.start_hour * 3600.0

    @property
    def wall_s(self) -> float:
        return self.hours * 3600.0 / self.speedup

    def serving(self) -> WatchConfig:
        return WatchConfig(trace=self.trace or str(PROFILE), nodes=self.serving_nodes, speedup=self.speedup,
                           start_s=self.start_s, history_days=float(self.history_days),
                           shortfall_budget=self.shortfall_budget, grace_s=self.grace_s,
                           final_checkpoint_s=self.final_checkpoint_s, release_s=self.release_s,
                           warmup_s=self.warmup_s, restart_cost_s=self.restart_cost_s)


def job_spec(opts: CycleOptions, script: Path, shm_dir: Path | None, i: int) -> dict[str, Any]:
    """The i-th spot job of the cycle: elastic 1..``max_ranks``, a checkpoint every ``ckpt_every`` steps
    (node memory in ``shm_dir`` when given)."""
    args = ["--parallel", "ddp", "--steps", "10000000", "--ckpt-every", str(opts.ckpt_every), "--log-every",
            "50", "--warmup", "10", "--micro-batch=1", "--step-pause-s=0.05"]
    return gpt_job(script, f"spot-{i}", opts.size, args, shm_dir, gpus={"min": 1, "max": opts.max_ranks},
                   max_restarts=20, grace_s=opts.grace_s)


def _hhmm(serving_s: float) -> str:
    t = serving_s % DAY
    return f"day {int(serving_s // DAY)} {int(t // 3600):02d}:{int(t % 3600 // 60):02d}"


def view(s: dict, jobs: list[dict], opts: CycleOptions, elapsed: float, title: str = "tidal demo cycle",
         extra: tuple[tuple[str, str], ...] = ()) -> Panel:
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column()
    if s.get("serving_time_s") is not None:
        g.add_row("serving clock", f"{_hhmm(s['serving_time_s'])} ({opts.speedup:g}x; {elapsed:.0f} of "
                                   f"{opts.wall_s:.0f} s)")
    n = s.get("serving_gpus", 0)
    up = (s.get("forecast") or {}).get("upper_gpus") or []
    band = f"{min(up):.1f}-{max(up):.1f}" if up else "-"
    demand = s.get("demand_gpus")
    g.add_row("demand", f"{demand if demand is not None else 'unknown'} GPUs of {n}; "
                        f"forecast bound over the horizon {band}; margin {s.get('margin_gpus', 0):.2f}")
    g.add_row("serving", f"lent {s.get('lent_gpus', 0)}, warming {s.get('warming_gpus', 0)}, serving "
                         f"{s.get('serving_capacity_gpus', n)} (plan may lend {s.get('lendable_gpus', 0)})")
    loans = ", ".join(f"{ln['node']}:{ln['gpus']}" for ln in s.get("loans", ())) or "none"
    g.add_row("loans", loans)
    rec = s.get("reclaims") or []
    now = s.get("now_s") or time.time()
    nxt = min(rec, key=lambda r: r["by_s"]) if rec else None
    if nxt is None:
        g.add_row("next reclaim", "none")
    else:
        at = nxt["notice_s"]
        notice = "now" if at is None or at <= now else f"+{at - now:.0f} s"
        g.add_row("next reclaim", f"{nxt['gpus']} GPUs by +{nxt['by_s'] - now:.0f} s (notice {notice})")
    st = s.get("stats") or {}
    worst = s.get("worst_margin_s")
    g.add_row("returns", f"{st.get('reclaims_met', 0)} met, {st.get('reclaims_missed', 0)} missed; worst "
                         f"margin {worst:.1f} s" if worst is not None else "none yet")
    for k, v in extra:
        g.add_row(k, v)
    t = Table(box=None, padding=(0, 1))
    for c in ("job", "state", "ranks", "where", "step", "ckpt"):
        t.add_column(c)
    for j in jobs:
        p = j.get("progress") or {}
        where = ", ".join(f"{k}:{v}" for k, v in sorted((j.get("placement") or {}).items()))
        t.add_row(j["id"], j["state"], str(sum((j.get("placement") or {}).values())), where or "-",
                  str(p.get("step", "-")), str(j.get("ckpt_step") if j.get("ckpt_step") is not None else "-"))
    return Panel(Group(g, t), title=f"[bold]{title}[/bold]", border_style="cyan", expand=False)


def simulate_same_day(opts: CycleOptions, training_gpus: int, demand_gpus: np.ndarray | None = None
                      ) -> dict[str, Any]:
    """The same day (profile, pool, timing in serving seconds, policy, jobs) through the simulator;
    ``demand_gpus``: the demand on the profile's step from its first row (default: the scaled profile)."""
    from tidal.serving.traces import load_trace
    from tidal.sim.config import make_config
    from tidal.sim.engine import simulate
    from tidal.sim.jobs import JobSpec
    from tidal.sim.policies import PolicySpec

    trace = load_trace(opts.trace or str(PROFILE))
    nodes = opts.serving()
    gpus = nodes.serving_gpus or 0
    days = (opts.start_s + opts.hours * 3600.0) / DAY
    reps = int(math.ceil(days * DAY / (len(trace.load) * trace.step_s))) + 1
    demand = np.tile(gpus * trace.load / trace.peak_load, reps) if demand_gpus is None else np.asarray(
        demand_gpus, dtype=float)
    x = opts.speedup
    per_node = int(opts.serving_nodes.split("x")[-1]) if "x" in opts.serving_nodes else 1
    cfg = make_config(serving_gpus=gpus, training_gpus=training_gpus, gpus_per_node=per_node, days=days,
                      warmup_days=opts.start_s / DAY, restart_s=opts.restart_cost_s * x, stage_s=0.5 * x,
                      persist_s=2.0 * x, notice_s=opts.grace_s * x,
                      final_checkpoint_s=opts.final_checkpoint_s * x,
                      release_s=opts.release_s * x, warmup_s=opts.warmup_s * x, failure_rate_per_gpu_hour=0.0,
                      step_s=trace.step_s, sched_period_s=PLANE_CONFIG.loop_interval_s * x,
                      record_timeline=False)
    cfg = dataclasses.replace(cfg, release_when_captured=True)  # as the live runtime: out once captured
    jobs = [JobSpec(f"spot-{i}", "demo", "spot", 0, 1, opts.max_ranks, 1e12, opts.start_s)
            for i in range(opts.jobs)]
    m = simulate(demand, step_s=trace.step_s, policy=PolicySpec("tidal", opts.shortfall_budget), config=cfg,
                 jobs=jobs).metrics
    return {"loaned_gpu_hours": m["loaned_gpu_hours"], "used_gpu_hours": m["trained_on_loans_held_gpu_hours"],
            "shortfall_gpu_hours": m["serving_shortfall_gpu_hours"], "shortfall_ratio": m["shortfall_ratio"],
            "reclaims": m["reclaims"], "demanded_gpu_hours": m["demanded_gpu_hours"]}


def with_simulator(summary: dict[str, Any], opts: CycleOptions, console: Console, training_gpus: int,
                   demand_gpus: np.ndarray | None = None) -> dict[str, Any]:
    """``summary`` with the same day through the simulator and the live/simulated ratios added."""
    console.print("[dim]running the same day through the simulator...[/dim]")
    summary["simulator"] = sim = simulate_same_day(opts, training_gpus, demand_gpus)
    summary["live_vs_sim"] = {k: _ratio(summary["live"][k], sim[k])
                              for k in ("loaned_gpu_hours", "used_gpu_hours", "shortfall_gpu_hours")}
    return summary


def play_day(opts: CycleOptions, console: Console, client: TidalClient, admin: TidalClient, ids: list[str],
             title: str = "tidal demo cycle", kinds: frozenset[str] = NARRATED,
             on_poll: Callable[[dict, list[dict], list[dict]], None] | None = None,
             extra: Callable[[], tuple[tuple[str, str], ...]] = tuple) -> tuple[dict, list[dict], list[str]]:
    """Poll the plane for the day's wall time: the live view, the events of ``kinds`` (and resizes and
    preemptions) printed, GPUs counted twice collected; ``on_poll(status, jobs, new events)`` after each
    poll. Returns the last serving status, the jobs and the double counts."""
    t0 = time.monotonic()
    s: dict = {}
    jobs: list[dict] = []
    checks: list[str] = []
    seen = 0
    with Live(view({}, [], opts, 0.0, title), console=console, refresh_per_second=2,
              auto_refresh=console.is_terminal) as live:
        while time.monotonic() - t0 < opts.wall_s:
            s = client.serving()
            jobs = [client.job(i) for i in ids]
            checks += _double_counted(s, jobs)
            events = admin.events(after=seen)
            for e in events:
                seen = e["id"]
                if e["kind"] in kinds or (e["kind"] == "transition"
                                          and e.get("to") in ("resizing", "preempting")):
                    console.print(f"[dim]{_hhmm(s.get('serving_time_s') or 0)}[/dim] "
                                  f"{e.get('job') or ''} {e['message']}", highlight=False)
            if on_poll is not None:
                on_poll(s, jobs, events)
            live.update(view(s, jobs, opts, time.monotonic() - t0, title, extra()))
            time.sleep(0.5)
    return s, jobs, checks


def run_cycle(opts: CycleOptions, console: Console, *, keep: bool = False,
              on_poll: Callable[[dict, list[dict], list[dict]], None] | None = None) -> dict[str, Any]:
    opts.check()
    script = example_script()
    sdir = Path(tempfile.mkdtemp(prefix="tidal-cycle-"))
    shm_base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else sdir
    shm_dir = Path(tempfile.mkdtemp(prefix="tidal-cycle-shm-", dir=shm_base))
    plane: EmbeddedPlane | None = None
    try:
        plane = EmbeddedPlane(sdir, 1, dataclasses.replace(PLANE_CONFIG, serving=opts.serving()))
        url = plane.start()
        console.print(f"[bold cyan]cycle[/bold cyan] control plane up at {url} ({plane.plane.describe})",
                      highlight=False)
        console.print(f"[dim]  watch the day on the dashboard: {dashboard_url(url)}#/serving (sign in with "
                      f"the token in {sdir / ADMIN_TOKEN_FILE})[/dim]", highlight=False)
        admin = TidalClient(url, plane.admin_token)
        client = TidalClient(url, admin.create_tenant("research")["token"])
        ids = [client.submit(job_spec(opts, script, shm_dir, i))["id"] for i in range(opts.jobs)]
        t0 = time.monotonic()
        s, jobs, checks = play_day(opts, console, client, admin, ids, on_poll=on_poll)
        return with_simulator(_summary(opts, s, jobs, admin, checks, time.monotonic() - t0), opts, console, 1)
    finally:
        with uninterrupted():  # a second Ctrl-C must not cut the clean-up short
            if plane is not None:
                plane.stop()
            shutil.rmtree(shm_dir, ignore_errors=True)
            if not keep:
                shutil.rmtree(sdir, ignore_errors=True)
            else:
                console.print(f"state kept in {sdir}")


def _double_counted(s: dict, jobs: list[dict]) -> list[str]:
    """Serving nodes where jobs hold more GPUs than are lent, as the plane saw them at the end of its
    newest step (one consistent view: the store's placements against the ledger)."""
    lent = {ln["node"]: ln["gpus"] for ln in s.get("loans", ())}
    return [f"{n}: jobs hold {g}, lent {lent.get(n, 0)}" for n, g in (s.get("held_gpus") or {}).items()
            if g > lent.get(n, 0)]


def _ratio(a: float, b: float) -> float | None:
    return None if not b else round(a / b, 3)


def _summary(opts: CycleOptions, s: dict, jobs: list[dict], client: TidalClient, checks: list[str],
             wall_s: float) -> dict[str, Any]:
    st = s.get("stats") or {}
    h = 3600.0
    x = opts.speedup
    events, after = [], 0
    while True:
        page = client.events(after=after, limit=10000)
        events += page
        if len(page) < 10000:
            break
        after = page[-1]["id"]
    stops = [e for e in events if e["kind"] == "transition" and "(reclaim" in (e.get("message") or "")]
    tiers: set[str] = set()
    for j in jobs:
        tiers |= set((j.get("progress") or {}).get("tiers") or {})
    lost = sum(j["report"]["lost_steps"] for j in jobs)
    demand = st.get("demand_gpu_s")
    live = {
        "loaned_gpu_hours": st.get("lent_gpu_s", 0.0) * x / h, "used_gpu_hours": st.get("used_gpu_s",
                                                                                        0.0) * x / h,
        "shortfall_gpu_hours": st.get("shortfall_gpu_s", 0.0) / h,
        "shortfall_ratio": st.get("shortfall_gpu_s", 0.0) / demand if demand else None,
        "demanded_gpu_hours": st.get("demand_gpu_s", 0.0) / h, "reclaim_notices": len(stops),
        "returns_met": st.get("reclaims_met", 0), "returns_missed": st.get("reclaims_missed", 0),
        "worst_margin_s": s.get("worst_margin_s"), "returned_gpus": st.get("returned_gpus", 0),
        "lent_gpus_total": st.get("lent_total_gpus", 0), "lost_steps": lost,
        "checkpoint_tiers": sorted(tiers),
        "jobs": [{"id": j["id"], "state": j["state"], "step": (j.get("progress") or {}).get("step"),
                  "ckpt_step": j.get("ckpt_step"), "preemptions": j["report"]["preemptions"],
                  "restarts": j["report"]["restarts"]} for j in jobs],
        "release_failures": st.get("release_failures", 0), "restore_failures": st.get("restore_failures", 0),
        "double_counted_steps": st.get("double_counted_steps", 0),
    }
    ok = (live["lent_gpus_total"] > 0 and live["returns_missed"] == 0 and not checks
          and not live["double_counted_steps"])
    return {"ok": ok, "wall_s": round(wall_s, 1), "speedup": x, "hours": opts.hours, "live": live,
            "double_counted": checks[:20]}


def print_summary(console: Console, out: dict) -> None:
    lv, sim = out["live"], out["simulator"]
    t = Table(title=f"{out['hours']:g} h of serving time at {out['speedup']:g}x ({out['wall_s']:.0f} s)")
    t.add_column("")
    t.add_column("live", justify="right")
    t.add_column("simulator", justify="right")
    t.add_column("live / sim", justify="right")
    for k, label in (("loaned_gpu_hours", "GPU-hours lent"), ("used_gpu_hours", "GPU-hours used by jobs"),
                     ("shortfall_gpu_hours", "serving shortfall, GPU-hours")):
        r = out["live_vs_sim"][k]
        t.add_row(label, f"{lv[k]:.2f}", f"{sim[k]:.2f}", "-" if r is None else f"{r:.2f}")
    t.add_row("reclaim notices", str(lv["reclaim_notices"]), str(sim["reclaims"]), "")
    console.print(t)
    wm = lv["worst_margin_s"]
    console.print(f"returns to serving: {lv['returns_met']} before the deadline, {lv['returns_missed']} "
                  f"late; worst margin {'-' if wm is None else f'{wm:.1f} s'}; steps lost to reclaims "
                  f"{lv['lost_steps']}; checkpoint tiers {', '.join(lv['checkpoint_tiers']) or '-'}",
                  highlight=False)
    if out["double_counted"]:
        console.print(f"[red]GPU held by serving and a job at once: {out['double_counted'][:3]}[/red]")
    console.print("[bold green]ok[/bold green]" if out["ok"] else "[bold red]NOT ok[/bold red]")

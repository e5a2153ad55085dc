"""``tidal plan``: how much of the serving pool could train, by hour of day, and the lead time to plan
for (the columns: docs/simulator.md and the text ``tidal plan`` prints under its table)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tidal.policy.loan import LoanContext, LoanTiming, TidalPolicy
from tidal.sim.config import sim_timing
from tidal.sim.report import pyplot, save_figure


def plan_report(demand: np.ndarray, step_s: float, serving_gpus: int, *, risk: float = 0.005,
                timing: LoanTiming | None = None, clients: np.ndarray | None = None) -> dict[str, Any]:
    """The numbers of ``tidal plan``. ``demand``: GPUs per step, NaN = gap; ``clients``: per client."""
    timing = timing or sim_timing()
    if not 0 < risk < 1:
        raise ValueError(f"risk must be in (0, 1), got {risk}")
    n = serving_gpus
    d = np.asarray(demand, dtype=float)
    steps = len(d)
    lead = max(1, math.ceil(timing.lead_time_s / step_s - 1e-9))
    days = steps * step_s / 86400.0
    hour = (np.arange(steps) * step_s // 3600 % 24).astype(int)
    # demand over the step and the lead after it (what a GPU lent at this step must not be needed for)
    ahead = np.full(steps, np.nan)
    for i in range(steps):
        w = d[i: i + lead + 1]
        ahead[i] = np.nanmax(w) if np.isfinite(w).any() else np.nan
    lent, forecaster = _tidal_fluid(d, step_s, n, risk, timing, clients)
    away = np.array([lent[max(0, u - lead): u].max() if u else 0 for u in range(steps)])
    ok = np.isfinite(d)
    short = np.where(ok, np.maximum(0.0, np.nan_to_num(d) - (n - away)), 0.0)
    rows = []
    for h in range(24):
        m = (hour == h) & ok
        if not m.any():
            continue
        dd = d[m]
        seen = m & np.isfinite(ahead)
        q = float(np.nanquantile(ahead[seen], 1 - risk)) if seen.any() else n
        rows.append({
            "hour": h,
            "mean_demand_gpus": float(dd.mean()),
            "p99_demand_gpus": float(np.quantile(dd, 0.99)),
            "idle_gpu_hours_per_day": float(np.maximum(0.0, n - dd).sum() * step_s / 3600.0 / days),
            "lendable_gpus_at_risk": int(max(0, math.floor(n - q + 1e-9))),
            "tidal_lent_gpu_hours_per_day": float(lent[hour == h].sum() * step_s / 3600.0 / days),
        })
    rises = np.array([np.nanmax(d[i + 1: i + lead + 1]) - d[i] for i in range(steps - lead)
                      if np.isfinite(d[i]) and np.isfinite(d[i + 1: i + lead + 1]).any()])
    idle_total = sum(r["idle_gpu_hours_per_day"] for r in rows)
    return {
        "serving_gpus": n, "step_s": step_s, "days": days, "risk": risk,
        "lead_time_s": timing.lead_time_s,
        "lead_time_parts_s": {"notice": timing.notice_s, "final_checkpoint": timing.final_checkpoint_s,
                              "release": timing.release_s, "serving_warmup": timing.warmup_s},
        "min_loan_window_s": timing.min_loan_window_s,
        "p99_rise_within_lead_gpus": float(np.quantile(rises, 0.99)) if rises.size else math.nan,
        "mean_demand_over_pool": float(np.nanmean(d) / n),
        "idle_gpu_hours_per_day": idle_total,
        "lendable_gpu_hours_per_day_at_risk": float(sum(r["lendable_gpus_at_risk"] for r in rows)),
        "tidal_lent_gpu_hours_per_day": float(sum(r["tidal_lent_gpu_hours_per_day"] for r in rows)),
        "forecaster": forecaster,
        "tidal_shortfall_ratio": float(short.sum() / np.nansum(d)) if np.nansum(d) > 0 else math.nan,
        "by_hour": rows,
    }


def _tidal_fluid(d: np.ndarray, step_s: float, n: int, budget: float, timing: LoanTiming,
                 clients: np.ndarray | None) -> tuple[np.ndarray, str]:
    """What the policy lent per step, and the forecaster that made most of its plans."""
    pol = TidalPolicy.build(budget, step_s, timing, horizon_s=None)
    state = pol.initial_state()
    lent = np.zeros(len(d), dtype=int)
    prev, by_clients = 0, 0
    for i, y in enumerate(d):
        ctx = LoanContext(now_s=i * step_s, serving_gpus=n, demand_gpus=float(y), lent_gpus=prev,
                          client_gpus=None if clients is None else clients[i])
        plan, state = pol(ctx, state)
        lent[i] = prev = plan.lendable_gpus
        by_clients += plan.forecaster == "clients"
    return lent, "clients" if 2 * by_clients > len(d) else "aggregate"


FORECASTERS = {"aggregate": "forecast of the total", "clients": "forecast of the total widened by each heavy "
               "client's risk of switching on"}


def render_plan(rep: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"serving pool of {rep['serving_gpus']} GPUs over {rep['days']:.1f} days, "
                    f"risk {rep['risk']:g}")
    for col in ("hour", "mean demand", "p99 demand", "idle GPU-h/day", f"lendable @ {rep['risk']:g}",
                "tidal lent GPU-h/day"):
        t.add_column(col, justify="right")
    for r in rep["by_hour"]:
        t.add_row(f"{r['hour']:02d}", f"{r['mean_demand_gpus']:.1f}", f"{r['p99_demand_gpus']:.1f}",
                  f"{r['idle_gpu_hours_per_day']:.1f}", str(r["lendable_gpus_at_risk"]),
                  f"{r['tidal_lent_gpu_hours_per_day']:.1f}")
    t.add_section()
    mean = rep["mean_demand_over_pool"] * rep["serving_gpus"]
    t.add_row("day", f"{mean:.1f}", "", f"{rep['idle_gpu_hours_per_day']:.0f}",
              f"{rep['lendable_gpu_hours_per_day_at_risk']:.0f} GPU-h",
              f"{rep['tidal_lent_gpu_hours_per_day']:.0f}")
    console.print(t)
    risk = rep["risk"]
    console.print(f"columns: idle GPU-h/day = the pool less its demand in that hour; lendable @ {risk:g} = "
                  "GPUs a fixed daily schedule could lend for that hour (they come back a lead time later) "
                  f"with demand above what is left at most {risk:.1%} of the time, chosen with hindsight "
                  "over the whole trace; tidal lent GPU-h/day = what the tidal policy lent in that hour "
                  "replaying the trace, knowing only the past (its forecast), at the same risk budget.",
                  highlight=False)
    p = rep["lead_time_parts_s"]
    console.print(
        f"recommended lead time: {rep['lead_time_s']:g} s (notice {p['notice']:g} + final checkpoint "
        f"{p['final_checkpoint']:g} + release {p['release']:g} + serving warm-up {p['serving_warmup']:g}); "
        f"loans shorter than {rep['min_loan_window_s']:g} s are not worth a restart. Within one lead time "
        f"demand rose by up to {rep['p99_rise_within_lead_gpus']:.1f} GPUs (p99): the margin a policy "
        "without a forecast needs.",
        highlight=False,
    )
    console.print(
        f"tidal (budget {rep['risk']:g}, causal replay, every lendable GPU lent; "
        f"{FORECASTERS[rep['forecaster']]}): "
        f"{rep['tidal_lent_gpu_hours_per_day']:.0f} GPU-h/day of {rep['idle_gpu_hours_per_day']:.0f} idle, "
        f"realized shortfall {rep['tidal_shortfall_ratio']:.4f}.",
        highlight=False,
    )


def plot_plan(rep: dict[str, Any], path: str) -> Path:
    plt = pyplot()
    rows = rep["by_hour"]
    h = np.array([r["hour"] for r in rows])
    fig, ax = plt.subplots(figsize=(12.5, 4.5))
    n = rep["serving_gpus"]
    ax.axhline(n, color="0.6", ls=":", lw=0.8, label=f"pool N={n}")
    ax.plot(h, [r["mean_demand_gpus"] for r in rows], marker="o", ms=3, label="mean demand")
    ax.plot(h, [r["p99_demand_gpus"] for r in rows], marker="o", ms=3, ls="--", label="p99 demand")
    ax.bar(h - 0.2, [r["lendable_gpus_at_risk"] for r in rows], width=0.4, alpha=0.5,
           label=f"lendable at risk {rep['risk']:g} (fixed schedule)")
    ax.bar(h + 0.2, [r["tidal_lent_gpu_hours_per_day"] for r in rows], width=0.4, alpha=0.5,
           label="tidal: mean GPUs lent")
    ax.set_xlabel("hour of day (from the trace start)")
    ax.set_ylabel("GPUs")
    ax.set_xticks(range(0, 24, 2))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"idle {rep['idle_gpu_hours_per_day']:.0f} GPU-h/day; lead time {rep['lead_time_s']:g} s",
                 fontsize=10)
    return save_figure(plt, fig, path)

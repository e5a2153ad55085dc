"""``python -m lab forecast-rotate``: does Tidal keep its budget wherever the bursts fall?

    python -m lab forecast-rotate                  # ../shared/traces/servegen-*.csv, every rotation
    python -m lab forecast-rotate T.csv --budget 0.005 --rotations 0,2,5 --json

A 14-day trace is one history: where its few large bursts fall (in the warm-up, where they teach the
policy, or early in the scored period, where they weigh on a small denominator) decides whether a
small shortfall budget is met. This program replays each trace **rotated by whole days** (day k first,
the days before it appended at the end: one artificial seam where the original end meets its start)
through :class:`~tidal.policy.loan.TidalPolicy` and the oracle, in the fluid model of
:mod:`lab.forecast.study` (restart cost 0, strict shortfall, scored after the warm-up), and reports
per trace and budget: how many rotations meet the budget, the worst realized shortfall, and harvest
× oracle (lowest, median). Rotation 0 is the trace as recorded. No hindsight anywhere; nothing tuned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lab.forecast.study import DEFAULT_TRACES_DIR, fluid_score, grid_steps, load_demand, run_policy
from tidal.policy import forecast as fc
from tidal.policy.baselines import OraclePolicy
from tidal.policy.loan import LoanTiming, TidalConfig, TidalPolicy


def rotate_days(demand: np.ndarray, days: int, day_steps: int) -> np.ndarray:
    """``demand`` starting at day ``days`` (whole days of ``day_steps``), the earlier days appended."""
    if day_steps <= 0 or len(demand) < day_steps:
        raise ValueError(f"need at least one whole day of {day_steps} steps, got {len(demand)} steps")
    return np.roll(demand, -int(days) * day_steps)


def evaluate(times_s: np.ndarray, demand: np.ndarray, *, n: int, step_s: float, lead: int, warmup: int,
             budgets: tuple[float, ...], rotations: list[int]) -> dict[str, Any]:
    """Per rotation and budget: Tidal's strict shortfall and harvest over the oracle's."""
    day_steps = round(86400.0 / step_s)
    timing = LoanTiming(notice_s=0.0, final_checkpoint_s=0.0, release_s=0.0, warmup_s=lead * step_s,
                        restart_cost_s=0.0)
    horizon_s = max(6 * 3600.0, timing.lead_time_s + step_s)
    fcfg = fc.ForecastConfig(step_s=step_s, horizon_s=horizon_s)
    runs: list[dict[str, Any]] = []
    for k in rotations:
        d = rotate_days(demand, k, day_steps)
        oracle_lent, _ = run_policy(
            OraclePolicy(step_s=step_s, horizon_s=horizon_s, timing=timing), times_s, d, n, future=True
        )
        oracle = fluid_score(oracle_lent, d, n, lead, warmup)["harvest"]
        for b in budgets:
            lent, _ = run_policy(TidalPolicy(TidalConfig(shortfall_budget=b, forecast=fcfg, timing=timing)),
                                 times_s, d, n)
            s = fluid_score(lent, d, n, lead, warmup)
            runs.append({"rotation": k, "budget": b, "shortfall_strict": s["shortfall_strict"],
                         "harvest_over_oracle": s["harvest"] / oracle if oracle > 0 else float("nan"),
                         "meets_budget": s["shortfall_strict"] <= b + 1e-12, "worst_day": s["worst_day"]})
    summary = {}
    for b in budgets:
        rs = [r for r in runs if r["budget"] == b]
        h = np.array([r["harvest_over_oracle"] for r in rs])
        summary[str(b)] = {
            "rotations": len(rs),
            "met": sum(r["meets_budget"] for r in rs),
            "worst_shortfall": max(r["shortfall_strict"] for r in rs),
            "worst_rotation": max(rs, key=lambda r: r["shortfall_strict"])["rotation"],
            "harvest_over_oracle_min": float(h.min()),
            "harvest_over_oracle_median": float(np.median(h)),
        }
    return {"runs": runs, "summary": summary}


def run(traces: list[Path], *, serving_gpus: int = 128, step_s: float = 600.0, lead_s: float = 1200.0,
        budgets: tuple[float, ...] = (0.001, 0.002, 0.005), rotations: list[int] | None = None,
        warmup_days: float = 2.0, as_json: bool = False) -> dict[str, Any]:
    """Evaluate each trace (every whole-day rotation unless ``rotations``); print a table; return the
    result."""
    from rich.console import Console
    from rich.table import Table

    if not traces:
        raise ValueError(f"no trace given and none found in {DEFAULT_TRACES_DIR}")
    lead, warmup = grid_steps(lead_s, step_s, warmup_days)
    result: dict[str, Any] = {"config": {"serving_gpus": serving_gpus, "step_s": step_s, "lead_s": lead_s,
                                         "budgets": list(budgets), "warmup_days": warmup_days}, "traces": {}}
    for path in traces:
        trace, times, demand = load_demand(path, serving_gpus, step_s, warmup + lead)
        days = int(len(demand) * step_s // 86400)
        if days < 1:
            raise ValueError(f"trace {trace.name!r} is shorter than a day")
        rots = list(range(days)) if rotations is None else rotations
        bad = [k for k in rots if not 0 <= k < days]
        if bad:
            raise ValueError(f"--rotations {bad}: trace {trace.name!r} has days 0..{days - 1}")
        result["traces"][trace.name] = evaluate(times, demand, n=serving_gpus, step_s=step_s, lead=lead,
                                                warmup=warmup, budgets=budgets, rotations=rots)
    console = Console(stderr=as_json, width=150)
    table = Table(
        title=f"Tidal on whole-day rotations of each trace (fluid model, {serving_gpus} serving GPUs, "
        f"lead {lead_s / 60:g} min, {warmup_days:g} warm-up days)"
    )
    for col in ("trace", "budget", "rotations meeting it", "worst shortfall (rotation)", "× oracle: lowest",
                "median"):
        table.add_column(col, justify="left" if col in ("trace", "budget") else "right")
    for name, tr in result["traces"].items():
        for b, s in tr["summary"].items():
            table.add_row(name, b, f"{s['met']} of {s['rotations']}",
                          f"{s['worst_shortfall']:.5f} ({s['worst_rotation']})",
                          f"{s['harvest_over_oracle_min']:.3f}", f"{s['harvest_over_oracle_median']:.3f}")
        table.add_section()
    console.print(table)
    if as_json:
        print(json.dumps(result, indent=2))
    return result


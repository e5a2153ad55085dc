"""``python -m lab clients``: does client-level information lend more at the same budget?

    python -m lab clients --json                        # ../shared/traces/servegen-*-clients.csv.gz
    python -m lab clients T-clients.csv.gz --serving-gpus 2048 --online-rotations 0,7 --json

Per-client traces (:mod:`tidal.serving.client_traces`), the pool sized for the total's peak, in the fluid
model of :mod:`lab.forecast.study` (restart cost 0, strict shortfall, scored after the warm-up days: the
model learns on the first days and is scored on the later ones; nothing is tuned on them). For each whole-day
rotation and budget:

* the **ceiling** of each forecast: the hindsight-best constant ``z`` over the aggregate forecast
  (``center + z * scale``) and over the client-level one (the same center, the scale widened by the
  switch-on risk of the clients that are off, :func:`tidal.policy.clients.client_forecast`);
* (``--online-rotations``) the policy, :class:`~tidal.policy.loan.TidalPolicy`, fed the total only, fed
  the per-client demand too with the tail reserve following the switch-on risk (``--reserve-floor``), and
  that with budget pacing (``--pacing-gain``).

``--shift`` changes the traffic from day ``--shift-day`` on, a regime nobody tuned on: ``double-client``
(a new client twice the largest appears), ``peak-3h`` (every client's day 3 hours later), ``no-weekend``
(Saturday and Sunday are the Friday before them; days counted from the trace start, a Thursday in Unix
time as the client model reads it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lab.forecast.bound import _tune_z
from lab.forecast.fluid import fluid_score, lent_from_upper, run_policy
from lab.forecast.study import DEFAULT_TRACES_DIR, grid_steps
from tidal.policy import forecast as fc
from tidal.policy.baselines import OraclePolicy
from tidal.policy.clients import ClientConfig, client_forecast, initial_clients, observe_clients
from tidal.policy.loan import LoanContext, LoanTiming, TidalConfig, TidalPolicy
from tidal.serving.client_traces import load_client_trace

KEYS = ("ceiling_aggregate", "ceiling_clients", "tidal_aggregate", "tidal_clients", "tidal_clients_paced")
SHIFTS = ("none", "double-client", "peak-3h", "no-weekend")


def shifted(rates: np.ndarray, kind: str, at: int, day: int) -> np.ndarray:
    """Per-client rates (windows x clients, the tail last) with the regime ``kind`` from window ``at``."""
    r = np.array(rates)
    if kind == "double-client":
        new = np.zeros(len(r))
        new[at:] = 2 * np.nan_to_num(r[at:, 0])
        r = np.insert(r, 0, new, axis=1)
    elif kind == "peak-3h":
        k = round(3 * day / 24)
        r[at + k:] = rates[at: len(r) - k]
    elif kind == "no-weekend":
        for d in range(at // day, len(r) // day):
            back = {2: 1, 3: 2}.get(d % 7)  # day 0 is a Thursday: days 2 and 3 are Saturday and Sunday
            if back:
                r[d * day: (d + 1) * day] = r[(d - back) * day: (d - back + 1) * day]
    elif kind != "none":
        raise ValueError(f"shift {kind!r}: expected one of {', '.join(SHIFTS)}")
    return r
DEFAULT = ("servegen-language-m-large-clients.csv.gz", "servegen-language-m-mid-clients.csv.gz")


def default_traces() -> list[Path]:
    return [DEFAULT_TRACES_DIR / n for n in DEFAULT if (DEFAULT_TRACES_DIR / n).exists()]


def paths(times_s: np.ndarray, demand: np.ndarray, clients: np.ndarray, fcfg: fc.ForecastConfig,
          ccfg: ClientConfig, lead: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(center, aggregate scale, client-level scale), each (steps, lead), made causally."""
    fs, cs = fc.initial_state(fcfg), initial_clients(ccfg)
    out = np.full((3, len(demand), lead), np.nan)
    for i, t in enumerate(times_s):
        fs = fc.observe(fcfg, fs, float(t), float(demand[i]))
        cs = observe_clients(ccfg, fcfg, cs, float(t), clients[i])
        if fs.n_obs:
            f = fc.forecast(fcfg, fs)
            out[0, i], out[1, i] = f.center_gpus[:lead], f.scale_gpus[:lead]
            out[2, i] = client_forecast(ccfg, fcfg, cs, f).scale_gpus[:lead]
    return out[0], out[1], out[2]


def online(times_s: np.ndarray, demand: np.ndarray, clients: np.ndarray | None, n: int,
           cfg: TidalConfig) -> np.ndarray:
    """What the shipped policy lends per step, given the per-client demand or not."""
    pol = TidalPolicy(cfg)
    st, lent, prev = pol.initial_state(), np.zeros(len(demand), dtype=int), 0
    for i, t in enumerate(times_s):
        ctx = LoanContext(now_s=float(t), serving_gpus=n, demand_gpus=float(demand[i]), lent_gpus=prev,
                          client_gpus=None if clients is None else clients[i])
        plan, st = pol(ctx, st)
        lent[i] = prev = plan.lendable_gpus
    return lent


def evaluate(path: Path, *, n: int, step_s: float, lead: int, warmup: int, budgets: tuple[float, ...],
             rotations: list[int] | None, online_rotations: list[int], heavy: int, pacing_gain: float = 1.0,
             shift: str = "none", shift_day: int = 7, reserve_floor: float = 0.7) -> dict[str, Any]:
    ct = load_client_trace(path, max_clients=heavy)
    day = round(86400.0 / ct.step_s)
    rates = shifted(ct.rates, shift, shift_day * day, day)
    load = np.nansum(rates, axis=1)
    gap = ct.total().gap
    demand = n * load / load[~gap].max()
    demand[gap] = np.nan
    per_client = rates * (n / load[~gap].max())
    per_client[gap] = np.nan
    days = len(demand) // day
    timing = LoanTiming(notice_s=0.0, final_checkpoint_s=0.0, release_s=0.0, warmup_s=lead * step_s,
                        restart_cost_s=0.0)
    fcfg = fc.ForecastConfig(step_s=step_s, horizon_s=max(6 * 3600.0, timing.lead_time_s + step_s))
    ccfg = ClientConfig(heavy=heavy, reserve_floor=reserve_floor)
    times = ct.times_s
    runs = []
    for k in range(days) if rotations is None else rotations:
        d, c = np.roll(demand, -k * day), np.roll(per_client, -k * day, axis=0)
        center, agg_scale, cli_scale = paths(times, d, c, fcfg, ccfg, lead)
        oracle_policy = OraclePolicy(step_s=step_s, horizon_s=fcfg.horizon_s, timing=timing)
        o_lent, _ = run_policy(oracle_policy, times, d, n, future=True)
        oracle = fluid_score(o_lent, d, n, lead, warmup)["harvest"]
        for b in budgets:
            row: dict[str, Any] = {"rotation": k, "budget": b}
            for name, s in (("ceiling_aggregate", agg_scale), ("ceiling_clients", cli_scale)):
                z = _tune_z(d, center, s, n, lead, warmup, b)
                sc = fluid_score(lent_from_upper(d, center + z * s, n), d, n, lead, warmup)
                row[name] = {"z": z, "harvest_over_oracle": sc["harvest"] / oracle,
                             "shortfall": sc["shortfall_strict"]}
            if k in online_rotations:
                cfg = TidalConfig(shortfall_budget=b, forecast=fcfg, timing=timing, clients=ccfg)
                paced = replace(cfg, pacing_gain=pacing_gain)
                for name, cl, cf in (("tidal_aggregate", None, cfg), ("tidal_clients", c, cfg),
                                     ("tidal_clients_paced", c, paced)):
                    sc = fluid_score(online(times, d, cl, n, cf), d, n, lead, warmup)
                    row[name] = {"harvest_over_oracle": sc["harvest"] / oracle,
                                 "shortfall": sc["shortfall_strict"],
                                 "meets_budget": sc["shortfall_strict"] <= b + 1e-12}
            runs.append(row)
    summary: dict[str, Any] = {}
    for b in budgets:
        rs = [r for r in runs if r["budget"] == b]
        summary[str(b)] = {key: {"rotations": len(got), "median_over_oracle": float(np.median(got)),
                                 "first_rotation_over_oracle": got[0],
                                 **({"met": sum(r[key]["meets_budget"] for r in rs if key in r),
                                     "worst_shortfall": max(r[key]["shortfall"] for r in rs if key in r)}
                                    if key.startswith("tidal") else {})}
                           for key in KEYS
                           if (got := [r[key]["harvest_over_oracle"] for r in rs if key in r])}
    return {"clients": list(ct.clients), "runs": runs, "summary": summary}


def run(traces: list[Path], *, serving_gpus: int = 128, step_s: float = 600.0, lead_s: float = 1200.0,
        budgets: tuple[float, ...] = (0.002, 0.005, 0.01), rotations: list[int] | None = None,
        online_rotations: tuple[int, ...] = (0,), heavy: int = 32, warmup_days: float = 2.0,
        pacing_gain: float = 1.0, shift: str = "none", shift_day: int = 7, reserve_floor: float = 0.7,
        as_json: bool = False) -> dict[str, Any]:
    """Evaluate each per-client trace; print a table (stderr with ``as_json``); return the result."""
    from rich.console import Console
    from rich.table import Table

    if not traces:
        raise ValueError(f"no trace given and none found in {DEFAULT_TRACES_DIR}")
    lead, warmup = grid_steps(lead_s, step_s, warmup_days)
    result: dict[str, Any] = {"config": {"serving_gpus": serving_gpus, "step_s": step_s, "lead_s": lead_s,
                                         "budgets": list(budgets), "warmup_days": warmup_days, "heavy": heavy,
                                         "online_rotations": list(online_rotations),
                                         "pacing_gain": pacing_gain, "shift": shift, "shift_day": shift_day,
                                         "reserve_floor": reserve_floor},
                              "traces": {}}
    for p in traces:
        result["traces"][p.name.split(".")[0]] = evaluate(
            p, n=serving_gpus, step_s=step_s, lead=lead, warmup=warmup, budgets=budgets, rotations=rotations,
            online_rotations=list(online_rotations), heavy=heavy, pacing_gain=pacing_gain, shift=shift,
            shift_day=shift_day, reserve_floor=reserve_floor)
    table = Table(title=f"client-level against aggregate forecast (fluid model, {serving_gpus} serving GPUs, "
                        f"lead {lead_s / 60:g} min): harvest x oracle")
    for col in ("trace", "budget", "what", "rotations", "first rotation", "median", "held", "worst short"):
        table.add_column(col)
    for name, tr in result["traces"].items():
        for b, rows in tr["summary"].items():
            for what, s in rows.items():
                table.add_row(name, b, what, str(s["rotations"]), f"{s['first_rotation_over_oracle']:.3f}",
                              f"{s['median_over_oracle']:.3f}", str(s.get("met", "")),
                              f"{s['worst_shortfall']:.5f}" if "worst_shortfall" in s else "")
        table.add_section()
    Console(stderr=as_json, width=160).print(table)
    if as_json:
        print(json.dumps(result, indent=2))
    return result

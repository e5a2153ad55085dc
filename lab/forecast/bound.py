"""``python -m lab forecast-bound``: how far could *any* margin over Tidal's forecast go?

    python -m lab forecast-bound                   # ../shared/traces/servegen-*.csv
    python -m lab forecast-bound T.csv --budget 0.005 --json

Tidal's loan plan lends ``N - upper`` with ``upper = center + margin`` over the lead time
(:mod:`tidal.policy.loan`). This program separates the forecast's *shape* (its center and error scale,
made causally, exactly as the policy makes them) from the *calibration* of the margin, by tuning the
margin **with hindsight** on the scored period, in the fluid model of :mod:`lab.forecast.study`
(restart cost 0, strict shortfall):

* ``constant z`` — one ``z`` for the whole run, ``upper = center + z * scale`` (bisection to the budget);
* ``per-context z`` — one ``z`` per context (level bucket of the demand now relative to its mean, times
  a time-of-day bucket), chosen together by a Lagrangian search on the scored period itself. Tuned
  in-sample with ``contexts`` free parameters, it overfits by design: it is what a margin rule over
  this forecast could reach if it knew the period in advance. The search is a heuristic (the best it
  finds, not a proven optimum); the row reports the better of it and ``constant z``.

Next to them: ``tidal`` (calibrated online, no hindsight: the policy as shipped), the reactive
policy tuned with hindsight, and the oracle. If even ``per-context z`` stays below a harvest target,
no causal calibration of the margin over this forecast reaches it; only a better forecast could.

How much better, the last row says (``--target``, default 0.85× the oracle): Tidal's own center with each
error ``y(t + h) - center_h(t)`` multiplied by ``k`` (a forecast that knew part of the future), under a
constant ``z`` tuned with hindsight as above. ``k`` is the largest that reaches the target (bisection to
0.005): the forecast's 20-minute errors must be ``1 - k`` smaller, everywhere, for a margin tuned with
hindsight and the whole budget spent to reach it; a causal calibration that holds other orderings of the
same days needs more.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab.forecast.fluid import lent_from_upper
from lab.forecast.rotate import rotate_days
from lab.forecast.study import (
    DEFAULT_TRACES_DIR,
    _reactive_lent,
    _tune_margin,
    fluid_score,
    grid_steps,
    load_demand,
    run_policy,
)
from tidal.policy import forecast as fc
from tidal.policy.baselines import OraclePolicy
from tidal.policy.loan import LoanTiming, TidalConfig, TidalPolicy


def forecast_paths(times_s: np.ndarray, demand: np.ndarray, config: fc.ForecastConfig,
                   lead: int) -> tuple[np.ndarray, np.ndarray]:
    """(center, scale), each (steps, lead): the forecast made at each step for the next ``lead`` steps,
    causally (the same ``observe``/``forecast`` calls as :class:`~tidal.policy.loan.TidalPolicy`).
    NaN rows before the first observation."""
    state = fc.initial_state(config)
    center = np.full((len(demand), lead), np.nan)
    scale = np.full((len(demand), lead), np.nan)
    for i, (t, y) in enumerate(zip(times_s, demand, strict=True)):
        state = fc.observe(config, state, float(t), float(y))
        if state.n_obs:
            f = fc.forecast(config, state)
            center[i], scale[i] = f.center_gpus[:lead], f.scale_gpus[:lead]
    return center, scale


def contexts(times_s: np.ndarray, demand: np.ndarray, level_edges: tuple[float, ...],
             tod_buckets: int) -> np.ndarray:
    """Context id per step: level bucket of the demand now over its running mean (causal) x
    time-of-day bucket. Gaps hold the last observation."""
    last = demand.copy()
    for i in range(1, len(last)):
        if math.isnan(last[i]):
            last[i] = last[i - 1]
    seen = np.cumsum(np.nan_to_num(demand))
    count = np.maximum(np.cumsum(~np.isnan(demand)), 1)
    lvl = np.nan_to_num(last / np.maximum(seen / count, 1e-9), nan=1.0)
    tod = ((times_s % 86400.0) * tod_buckets // 86400.0).astype(int)
    return np.searchsorted(np.asarray(level_edges, float), lvl, side="right") * tod_buckets + tod


def per_context_z(
    demand: np.ndarray,
    center: np.ndarray,
    scale: np.ndarray,
    ctx: np.ndarray,
    n: int,
    lead: int,
    warmup: int,
    budget: float,
    grid: np.ndarray,
) -> tuple[np.ndarray, dict[str, Any]] | None:
    """Per-context margins (in ``grid`` units of the scale) by a Lagrangian search with hindsight: for a
    price ``lam`` on shortfall, each context takes the z maximising ``lent - lam * shortfall`` over its
    scored steps (shortfall approximated per decision as the demand over the lead after it above
    ``N - lent``); the best combination whose true strict shortfall is within ``budget`` wins."""
    steps = len(demand)
    ahead = np.full(steps, np.nan)
    for h in range(1, lead + 1):
        ahead[:-h] = np.fmax(ahead[:-h], demand[h:])
    ahead = np.nan_to_num(ahead)
    scored = np.arange(steps) >= warmup - lead
    lent_z = np.stack([lent_from_upper(demand, center + z * scale, n) for z in grid])
    short_z = np.maximum(0.0, ahead[None, :] - (n - lent_z)) * scored
    gain = lent_z * scored
    ids = np.unique(ctx)
    best: tuple[np.ndarray, dict[str, Any]] | None = None
    for lam in np.geomspace(0.1, 1000.0, 80):
        obj = gain - lam * short_z
        pick = np.zeros(steps, dtype=int)
        zs = np.zeros(int(ctx.max()) + 1)
        for c in ids:
            sel = ctx == c
            k = int(np.argmax(obj[:, sel].sum(axis=1)))
            pick[sel] = k
            zs[c] = grid[k]
        s = fluid_score(lent_z[pick, np.arange(steps)], demand, n, lead, warmup)
        if s["shortfall_strict"] <= budget and (best is None or s["harvest"] > best[1]["harvest"]):
            best = (zs, s)
    return best


def _tune_z(demand: np.ndarray, center: np.ndarray, scale: np.ndarray, n: int, lead: int, warmup: int,
            budget: float) -> float:
    """Smallest constant z (to 0.01) whose strict shortfall is within ``budget``."""
    lo, hi = 0.0, 50.0
    def short(z: float) -> float:
        return fluid_score(lent_from_upper(demand, center + z * scale, n), demand, n, lead, warmup)[
            "shortfall_strict"
        ]

    if short(lo) <= budget:
        return lo
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if short(mid) <= budget else (mid, hi)
    return hi


def _truth(demand: np.ndarray, lead: int) -> np.ndarray:
    """(steps, lead): the demand each forecast step was about, NaN past the end and at gaps."""
    truth = np.full((len(demand), lead), np.nan)
    for h in range(1, lead + 1):
        truth[:-h, h - 1] = demand[h:]
    return truth


def shrink_errors(center: np.ndarray, truth: np.ndarray, k: float) -> np.ndarray:
    """The center with each error ``truth - center`` times ``k`` (no truth: the forecast as made)."""
    return np.where(np.isnan(truth), center, truth - k * (truth - center))


def largest_k(reaches: Callable[[float], bool], tol: float = 0.005) -> float | None:
    """The largest ``k`` in [0, 1] (to ``tol``) at which ``reaches(k)`` (monotone in ``k``); None when
    ``reaches(1)`` (the forecast as made is enough), NaN when not even ``reaches(0)`` (the center is the
    truth)."""
    if reaches(1.0):
        return None
    if not reaches(0.0):
        return math.nan  # not even a center that is the truth reaches it (integer GPUs, the lead window)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reaches(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Rotation:
    """One whole-day rotation of a trace ("Where the bursts fall") with the forecast made on it."""

    days: int
    demand: np.ndarray
    center: np.ndarray
    scale: np.ndarray
    truth: np.ndarray
    oracle: dict[str, Any]  # the oracle's fluid_score on it


def robust_z(rotations: list[Rotation], n: int, lead: int, warmup: int, budget: float,
             k: float = 1.0) -> tuple[float, list[float], list[float]]:
    """One constant ``z`` chosen with hindsight of *every* rotation: the smallest that holds ``budget`` on
    all of them (the largest of their own). (z, harvest x oracle per rotation, shortfall per rotation)."""
    centers = [shrink_errors(r.center, r.truth, k) for r in rotations]
    z = max(_tune_z(r.demand, ck, r.scale, n, lead, warmup, budget)
            for r, ck in zip(rotations, centers, strict=True))
    scores = [fluid_score(lent_from_upper(r.demand, ck + z * r.scale, n), r.demand, n, lead, warmup)
              for r, ck in zip(rotations, centers, strict=True)]
    return (z, [sc["harvest"] / r.oracle["harvest"] for sc, r in zip(scores, rotations, strict=True)],
            [sc["shortfall_strict"] for sc in scores])


def evaluate(times_s: np.ndarray, demand: np.ndarray, *, n: int, step_s: float, lead: int, warmup: int,
             budgets: tuple[float, ...], level_edges: tuple[float, ...], tod_buckets: int,
             target: float = 0.85, rotate: bool = True) -> dict[str, Any]:
    """The rows of the module docstring for one trace, per budget."""
    timing = LoanTiming(notice_s=0.0, final_checkpoint_s=0.0, release_s=0.0, warmup_s=lead * step_s,
                        restart_cost_s=0.0)
    horizon_s = max(6 * 3600.0, timing.lead_time_s + step_s)
    fcfg = fc.ForecastConfig(step_s=step_s, horizon_s=horizon_s)
    day_steps = round(86400.0 / step_s)
    rotations = []
    for days in range(len(demand) // day_steps if rotate else 1):
        d = rotate_days(demand, days, day_steps)
        c, sc = forecast_paths(times_s, d, fcfg, lead)
        o_lent, _ = run_policy(OraclePolicy(step_s=step_s, horizon_s=horizon_s, timing=timing), times_s, d, n,
                               future=True)
        rotations.append(Rotation(days, d, c, sc, _truth(d, lead), fluid_score(o_lent, d, n, lead, warmup)))
    center, scale, truth, oracle = (rotations[0].center, rotations[0].scale, rotations[0].truth,
                                    rotations[0].oracle)  # rotation 0: the trace as recorded
    ctx = contexts(times_s, demand, level_edges, tod_buckets)
    grid = np.arange(0.0, 12.0001, 0.25)
    out: dict[str, Any] = {
        "oracle_harvest": oracle["harvest"],
        "contexts": int(len(np.unique(ctx))),
        "budgets": {},
    }

    def row(score: dict[str, Any], margin: str) -> dict[str, Any]:
        return {"harvest": score["harvest"], "harvest_over_oracle": score["harvest"] / oracle["harvest"],
                "shortfall_strict": score["shortfall_strict"], "margin": margin}

    for b in budgets:
        rows: dict[str, Any] = {}
        tcfg = TidalConfig(shortfall_budget=b, forecast=fcfg, timing=timing)
        lent, state = run_policy(TidalPolicy(tcfg), times_s, demand, n)
        rows["tidal (online)"] = row(fluid_score(lent, demand, n, lead, warmup), f"z={state.z:.2f} at end")
        m = _tune_margin(lambda mg: _reactive_lent(demand, n, mg), demand, n, lead, warmup, b)
        rows["reactive (hindsight)"] = row(fluid_score(_reactive_lent(demand, n, m), demand, n, lead, warmup),
                                           f"{m:.2f} GPUs")
        z = _tune_z(demand, center, scale, n, lead, warmup, b)
        const = fluid_score(lent_from_upper(demand, center + z * scale, n), demand, n, lead, warmup)
        rows["constant z (hindsight)"] = row(const, f"z={z:.2f}")
        found = per_context_z(demand, center, scale, ctx, n, lead, warmup, b, grid)
        if found is None or found[1]["harvest"] < const["harvest"]:
            rows["per-context z (hindsight, in-sample)"] = row(
                const, f"constant z={z:.2f} (search found no better)"
            )
        else:
            zs, s = found
            used = zs[np.unique(ctx)]
            rows["per-context z (hindsight, in-sample)"] = row(s, f"z in [{used.min():g}, {used.max():g}]")
        def at(k: float, b: float = b) -> tuple[dict[str, Any], float]:
            ck = shrink_errors(center, truth, k)
            zk = _tune_z(demand, ck, scale, n, lead, warmup, b)
            return fluid_score(lent_from_upper(demand, ck + zk * scale, n), demand, n, lead, warmup), zk

        k = largest_k(lambda k: at(k)[0]["harvest"] >= target * oracle["harvest"])
        label = f"constant z, errors x k to reach {target:g}x (hindsight)"
        if k is None:
            rows[label] = row(const, "k=1: the forecast as made reaches it")
        elif math.isnan(k):
            rows[label] = row(at(0.0)[0], "not reached even with the truth as the center (k=0)")
        else:
            sk, zk = at(k)
            rows[label] = row(sk, f"k={k:.3f} (errors {100 * (1 - k):.0f} % smaller), z={zk:.2f}")
        if rotate:
            mr = max(_tune_margin(lambda mg, d=r.demand: _reactive_lent(d, n, mg), r.demand, n, lead,
                                  warmup, b) for r in rotations)
            over = [fluid_score(_reactive_lent(r.demand, n, mr), r.demand, n, lead, warmup)["harvest"]
                    / r.oracle["harvest"] for r in rotations]
            rows[f"reactive holding all {len(rotations)} rotations (hindsight)"] = {
                **row(fluid_score(_reactive_lent(demand, n, mr), demand, n, lead, warmup),
                      f"{mr:.2f} GPUs; rotations: median {float(np.median(over)):.3f}x, "
                      f"lowest {min(over):.3f}x"),
                "rotations_over_oracle": over}
            zr, over, short = robust_z(rotations, n, lead, warmup, b)
            spread = f"rotations: median {float(np.median(over)):.3f}x, lowest {min(over):.3f}x"
            rows[f"constant z holding all {len(rotations)} rotations (hindsight)"] = {
                **row(fluid_score(lent_from_upper(demand, center + zr * scale, n), demand, n, lead, warmup),
                      f"z={zr:.2f}; {spread}"),
                "rotations_over_oracle": over, "rotations_shortfall": short}
            kr = largest_k(lambda k, b=b: robust_z(rotations, n, lead, warmup, b, k)[1][0] >= target,
                           tol=0.01)
            label = f"the same, errors x k to reach {target:g}x (hindsight)"
            if kr is None or math.isnan(kr):
                rows[label] = {**rows[f"constant z holding all {len(rotations)} rotations (hindsight)"],
                               "margin": "k=1: the forecast as made reaches it" if kr is None
                               else "not reached even with the truth as the center (k=0)"}
            else:
                zk, over, _ = robust_z(rotations, n, lead, warmup, b, kr)
                ck = shrink_errors(center, truth, kr)
                rows[label] = row(fluid_score(lent_from_upper(demand, ck + zk * scale, n), demand, n, lead,
                                              warmup),
                                  f"k={kr:.2f} (errors {100 * (1 - kr):.0f} % smaller), z={zk:.2f}; "
                                  f"median {float(np.median(over)):.3f}x")
        rows["oracle"] = row(oracle, "0")
        out["budgets"][str(b)] = rows
    return out


def run(
    traces: list[Path],
    *,
    serving_gpus: int = 128,
    step_s: float = 600.0,
    lead_s: float = 1200.0,
    budgets: tuple[float, ...] = (0.001, 0.002, 0.005),
    warmup_days: float = 2.0,
    level_edges: tuple[float, ...] = (0.8, 1.2),
    tod_buckets: int = 6,
    target: float = 0.85,
    as_json: bool = False,
) -> dict[str, Any]:
    """Evaluate each trace; print a Rich table (stderr with ``as_json``); return the result."""
    from rich.console import Console
    from rich.table import Table

    if not traces:
        raise ValueError(f"no trace given and none found in {DEFAULT_TRACES_DIR}")
    lead, warmup = grid_steps(lead_s, step_s, warmup_days)
    result: dict[str, Any] = {"config": {"serving_gpus": serving_gpus, "step_s": step_s, "lead_s": lead_s,
                                         "budgets": list(budgets), "warmup_days": warmup_days,
                                         "level_edges": list(level_edges), "tod_buckets": tod_buckets,
                                         "target": target},
                              "traces": {}}
    for path in traces:
        trace, times, demand = load_demand(path, serving_gpus, step_s, warmup + lead)
        result["traces"][trace.name] = evaluate(times, demand, n=serving_gpus, step_s=step_s, lead=lead,
                                                warmup=warmup, budgets=budgets, level_edges=level_edges,
                                                tod_buckets=tod_buckets, target=target)
    console = Console(stderr=as_json, width=150)
    table = Table(
        title=f"margin over Tidal's forecast, tuned with hindsight (fluid model, {serving_gpus} serving "
        f"GPUs, lead {lead_s / 60:g} min)"
    )
    for col in ("trace", "budget", "margin rule", "margin"):
        table.add_column(col)
    for col in ("shortfall strict", "harvest", "× oracle"):
        table.add_column(col, justify="right")
    for name, tr in result["traces"].items():
        for b, rows in tr["budgets"].items():
            for rule, r in rows.items():
                table.add_row(
                    name,
                    b,
                    rule,
                    r["margin"],
                    f"{r['shortfall_strict']:.5f}",
                    f"{r['harvest']:.3f}",
                    f"{r['harvest_over_oracle']:.3f}",
                )
            table.add_section()
    console.print(table)
    if as_json:
        print(json.dumps(result, indent=2))
    return result


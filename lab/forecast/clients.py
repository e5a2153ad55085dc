"""``python -m lab clients``: does client-level information lend more at the same budget, and does the
online promise hold it?

    python -m lab clients --workers 2 --json           # the whole table, ../shared/traces/servegen-*-clients
    python -m lab clients --days 7 --rotations 0 --serving-gpus 128 --variants before,loosen  # chosen on
    python -m lab clients --shift double-client --rotations 0 --json

Per-client traces (:mod:`tidal.serving.client_traces`), the pool sized for the total's peak, in the fluid
model of :mod:`lab.forecast.study` (restart cost 0, strict shortfall, scored after the warm-up days: the
model learns on the first days and is scored on the later ones; nothing is tuned on them). For each whole-day
rotation, pool size (``--serving-gpus``, repeatable) and budget:

* the **ceiling** of each forecast: the hindsight-best constant ``z`` over the aggregate forecast
  (``center + z * scale``) and over the client-level one (the same center, the scale widened by the
  switch-on risk of the clients that are off, :func:`tidal.policy.clients.client_forecast`);
* the policy, :class:`~tidal.policy.loan.TidalPolicy`, in the variants of ``VARIANTS`` (``--variants``).

``--mix SEED`` (repeatable) adds a **recomposed service** per seed, traffic nobody tuned on
(:func:`recomposed`): a random share of the clients of both shared traces, each rescaled, moved by whole
days and some by hours (another region), the two services mixed in a random proportion; its heavy clients
and tail as in a file. The rule that decides whether the promise with a week's window becomes the default
was fixed before any recomposed service was scored: on seeds 1-8, rotations 0 and 7, 128 and 2,048 GPUs,
budgets 0.2, 0.5 and 1 %, it must hold the budget on every cell where ``before`` holds it, and its harvest
over ``before``'s must have a median of at least 0.98 over the cells.

``--shift`` changes the traffic from day ``--shift-day`` on, a regime nobody tuned on: ``double-client``
(a new client twice the largest appears), ``peak-3h`` (every client's day 3 hours later), ``no-weekend``
(Saturday and Sunday are the Friday before them; days counted from the trace start, a Thursday in Unix
time as the client model reads it). ``--days`` keeps the first days only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from multiprocessing import Pool
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
from tidal.serving.client_traces import ClientTrace, load_client_trace

SHIFTS = ("none", "double-client", "peak-3h", "no-weekend")
CEILINGS = ("ceiling_aggregate", "ceiling_clients")


PROMISE = {"pacing_gain": 2.0, "pacing_half_life_s": 86400.0}
"""The online promise, tightening only, with a day's window (the default has a week's)."""
LOOSEN = {**PROMISE, "pacing_floor": 0.5}
"""The promise loosening the reserve by the budget left (chosen on m-large's first 7 days; not kept)."""


def _before(c: TidalConfig) -> TidalConfig:
    """The policy before the online promise: no pacing, the usual reserve."""
    return replace(c, pacing_gain=0.0, pacing_floor=1.0, clients=ClientConfig(heavy=c.clients.heavy))


def _clients(c: TidalConfig) -> TidalConfig:
    """The promise with the tail reserve following the switch-on risk (within the budget left)."""
    return replace(_before(c), **PROMISE, clients=replace(c.clients, reserve_floor=0.7))


VARIANTS: dict[str, tuple[bool, Callable[[TidalConfig], TidalConfig]]] = {
    "before": (False, _before),  # the aggregate policy before the promise: the total only
    "tighten": (False, lambda c: replace(_before(c), **PROMISE)),  # with the promise, the total only
    # the promise as shipped: a week's window
    "week": (False, lambda c: replace(_before(c), pacing_gain=2.0, pacing_half_life_s=7 * 86400.0)),
    "clients": (True, _clients),  # with the promise and the reserve by risk, per client
    "loosen": (True, lambda c: replace(_before(c), **LOOSEN)),  # the promise loosening by the budget left
    "floor": (True, lambda c: replace(_before(c), clients=replace(c.clients, reserve_floor=0.7))),
}
"""name: (fed per client, the config from the default's)."""


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
    """What the policy lends per step, given the per-client demand or not."""
    pol = TidalPolicy(cfg)
    st, lent, prev = pol.initial_state(), np.zeros(len(demand), dtype=int), 0
    for i, t in enumerate(times_s):
        ctx = LoanContext(now_s=float(t), serving_gpus=n, demand_gpus=float(demand[i]), lent_gpus=prev,
                          client_gpus=None if clients is None else clients[i])
        plan, st = pol(ctx, st)
        lent[i] = prev = plan.lendable_gpus
    return lent


MIX = "mix-"
"""A source named ``mix-<seed>`` is the recomposed service of that seed (:func:`recomposed`)."""


def _filled(rates: np.ndarray, day: int) -> np.ndarray:
    """A trace's gap windows (no client listed) filled with the nearest day's same window."""
    r = np.array(rates)
    gap = np.isnan(r).all(axis=1)
    for i in np.flatnonzero(gap):
        near = [j for k in range(1, len(r) // day + 1) for j in (i - k * day, i + k * day)
                if 0 <= j < len(r) and not gap[j]]
        r[i] = r[near[0]] if near else 0.0
    return np.nan_to_num(r)


def recomposed(seed: int, heavy: int, sources: tuple[Path, ...] | None = None
               ) -> tuple[np.ndarray, np.ndarray, float]:
    """(times, per-client rates with the tail last, step) of a service made from the clients of the
    ``sources`` (the two shared traces), drawn by ``seed``: each client kept with a probability drawn in
    [0.2, 0.8]; rescaled by a log-normal factor (sigma 0.5); moved by a whole number of days (0-13), and one
    in four also by 1-6 hours either way; the second source's clients weighted to send 0.3-3 times the
    first's. The ``heavy`` largest keep a column each."""
    rng = np.random.default_rng(seed)
    cols, times, step = [], None, 0.0
    for k, path in enumerate(sources or tuple(default_traces())):
        ct = load_client_trace(path, max_clients=100_000)
        if times is not None and (len(ct.times_s) != len(times) or ct.step_s != step):
            raise ValueError(f"{path}: a recomposed service needs sources on one grid")
        times, step = ct.times_s, ct.step_s
        day = round(86400.0 / step)
        r = _filled(ct.rates[:, :-1], day)
        keep = rng.random(r.shape[1]) < rng.uniform(0.2, 0.8)
        r = r[:, keep] * rng.lognormal(0.0, 0.5, keep.sum())
        hours = np.where(rng.random(r.shape[1]) < 0.25, rng.integers(1, 7, r.shape[1])
                         * rng.choice([-1, 1], r.shape[1]), 0)
        moves = rng.integers(0, 14, r.shape[1]) * day + hours * round(3600.0 / step)
        r = np.stack([np.roll(r[:, j], int(m)) for j, m in enumerate(moves)], axis=1)
        if k and cols:
            r *= rng.uniform(0.3, 3.0) * sum(float(c.sum()) for c in cols) / max(float(r.sum()), 1e-12)
        cols.append(r)
    if times is None:
        raise ValueError("a recomposed service needs the shared per-client traces")
    r = np.concatenate(cols, axis=1)
    order = np.argsort(-r.sum(axis=0), kind="stable")
    rates = np.concatenate([r[:, order[:heavy]], r[:, order[heavy:]].sum(axis=1, keepdims=True)], axis=1)
    return times, rates, step


@lru_cache(maxsize=4)
def _load(path: Path, heavy: int, shift: str, shift_day: int, days: int | None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(times, total load, per-client load with gaps NaN, windows a day) of a trace, shifted, cut."""
    if path.name.startswith(MIX):
        t, r, step = recomposed(int(path.name[len(MIX):]), heavy)
        ct = ClientTrace(path.name, t, r, (*(f"c{i}" for i in range(heavy)), "other"), step)
    else:
        ct = load_client_trace(path, max_clients=heavy)
    day = round(86400.0 / ct.step_s)
    rates = shifted(ct.rates, shift, shift_day * day, day)
    load = np.nansum(rates, axis=1)
    gap = ct.total().gap
    load[gap] = np.nan
    rates[gap] = np.nan
    m = len(load) if days is None else min(len(load), days * day)
    return ct.times_s[:m], load[:m], rates[:m], day


def evaluate_rotation(path: Path, *, n: int, rotation: int, step_s: float, lead: int, warmup: int,
                      budgets: tuple[float, ...], variants: tuple[str, ...], heavy: int = 32,
                      shift: str = "none", shift_day: int = 7, days: int | None = None
                      ) -> list[dict[str, Any]]:
    """One row per budget: harvest / oracle and shortfall of the ceilings and of each variant."""
    times, load, rates, day = _load(path, heavy, shift, shift_day, days)
    peak = float(np.nanmax(load))
    d = np.roll(n * load / peak, -rotation * day)
    c = np.roll(rates * (n / peak), -rotation * day, axis=0)
    timing = LoanTiming(notice_s=0.0, final_checkpoint_s=0.0, release_s=0.0, warmup_s=lead * step_s,
                        restart_cost_s=0.0)
    fcfg = fc.ForecastConfig(step_s=step_s, horizon_s=max(6 * 3600.0, timing.lead_time_s + step_s))
    ccfg = ClientConfig(heavy=heavy)
    center, agg_scale, cli_scale = paths(times, d, c, fcfg, ccfg, lead)
    o_lent, _ = run_policy(OraclePolicy(step_s=step_s, horizon_s=fcfg.horizon_s, timing=timing), times, d, n,
                           future=True)
    oracle = fluid_score(o_lent, d, n, lead, warmup)["harvest"]
    rows = []
    for b in budgets:
        row: dict[str, Any] = {"rotation": rotation, "budget": b}
        for name, s in zip(CEILINGS, (agg_scale, cli_scale), strict=True):
            z = _tune_z(d, center, s, n, lead, warmup, b)
            sc = fluid_score(lent_from_upper(d, center + z * s, n), d, n, lead, warmup)
            row[name] = {"z": z, "harvest_over_oracle": sc["harvest"] / oracle,
                         "shortfall": sc["shortfall_strict"]}
        base = TidalConfig(shortfall_budget=b, forecast=fcfg, timing=timing, clients=ccfg)
        for name in variants:
            per_client, make = VARIANTS[name]
            sc = fluid_score(online(times, d, c if per_client else None, n, make(base)), d, n, lead, warmup)
            row[name] = {"harvest_over_oracle": sc["harvest"] / oracle, "shortfall": sc["shortfall_strict"],
                         "meets_budget": sc["shortfall_strict"] <= b + 1e-12}
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]], budgets: tuple[float, ...],
              keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in budgets:
        rs = [r for r in rows if r["budget"] == b]
        out[str(b)] = {k: {"rotations": len(rs), "median_over_oracle": float(np.median(
                               [r[k]["harvest_over_oracle"] for r in rs])),
                           "first_rotation_over_oracle": rs[0][k]["harvest_over_oracle"],
                           "worst_shortfall": max(r[k]["shortfall"] for r in rs),
                           **({"met": sum(r[k]["meets_budget"] for r in rs)} if k not in CEILINGS else {})}
                       for k in keys}
    return out


def _task(a: tuple[Path, dict[str, Any]]) -> list[dict[str, Any]]:
    return evaluate_rotation(a[0], **a[1])


def run(traces: list[Path], *, serving_gpus: tuple[int, ...] = (128, 2048), step_s: float = 600.0,
        lead_s: float = 1200.0, budgets: tuple[float, ...] = (0.002, 0.005, 0.01),
        rotations: list[int] | None = None,
        variants: tuple[str, ...] = ("before", "tighten", "clients"), heavy: int = 32,
        warmup_days: float = 2.0,
        shift: str = "none", shift_day: int = 7, days: int | None = None, workers: int = 1,
        as_json: bool = False) -> dict[str, Any]:
    """Evaluate each per-client trace at each pool size; print the table (stderr with ``as_json``)."""
    from rich.console import Console
    from rich.table import Table

    if not traces:
        raise ValueError(f"no trace given and none found in {DEFAULT_TRACES_DIR}")
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise ValueError(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    lead, warmup = grid_steps(lead_s, step_s, warmup_days)
    tasks, keys = [], (*variants, *CEILINGS)
    for p in traces:
        n_days = len(_load(p, heavy, shift, shift_day, days)[1]) // round(86400.0 / step_s)
        for n in serving_gpus:
            for k in range(n_days) if rotations is None else rotations:
                tasks.append((p, dict(n=n, rotation=k, step_s=step_s, lead=lead, warmup=warmup,
                                      budgets=budgets, variants=variants, heavy=heavy, shift=shift,
                                      shift_day=shift_day, days=days)))
    if workers > 1:
        with Pool(workers) as pool:
            done = pool.map(_task, tasks, chunksize=1)
    else:
        done = [_task(t) for t in tasks]
    result: dict[str, Any] = {"config": {
        "serving_gpus": list(serving_gpus), "step_s": step_s, "lead_s": lead_s, "budgets": list(budgets),
        "warmup_days": warmup_days, "heavy": heavy, "variants": list(variants), "shift": shift,
        "shift_day": shift_day, "days": days, "promise": PROMISE, "loosen": LOOSEN}, "traces": {}}
    for (p, kw), rows in zip(tasks, done, strict=True):
        tr = result["traces"].setdefault(p.name.split(".")[0], {}).setdefault(str(kw["n"]), {"runs": []})
        tr["runs"] += rows
    for tr in result["traces"].values():
        for sized in tr.values():
            sized["summary"] = summarize(sized["runs"], budgets, keys)
    con = Console(stderr=as_json, width=200)
    for title, summary_only in (("every rotation", False), ("rotation 0 / median, held, worst", True)):
        table = Table(title=f"{title} (fluid model, lead {lead_s / 60:g} min, shift {shift}): harvest x "
                            "oracle @ shortfall")
        for col in ("trace", "GPUs", "budget", "rotation", *keys):
            table.add_column(col)
        for name, tr in result["traces"].items():
            for n_s, sized in tr.items():
                if summary_only:
                    for b, s in sized["summary"].items():
                        table.add_row(name, n_s, b, f"{s[keys[0]]['rotations']} rot.", *(
                            f"{s[k]['first_rotation_over_oracle']:.3f} / {s[k]['median_over_oracle']:.3f}"
                            + (f", {s[k]['met']} held, {s[k]['worst_shortfall']:.5f}" if "met" in s[k]
                               else "")
                            for k in keys))
                else:
                    for r in sized["runs"]:
                        table.add_row(name, n_s, str(r["budget"]), str(r["rotation"]), *(
                            ("[bold]" if not r[k].get("meets_budget", True) else "")
                            + f"{r[k]['harvest_over_oracle']:.3f} @ {r[k]['shortfall']:.5f}" for k in keys))
                table.add_section()
        con.print(table)
    if as_json:
        print(json.dumps(result, indent=2))
    return result

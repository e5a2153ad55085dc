"""``python -m lab generalize``: the loan policies on traffic they were not tuned on.

    python -m lab generalize                                   # both ServeGen traces + stress traces
    python -m lab generalize A.csv B.csv --serving-gpus 2048 --budget 0.005 --json

The protocol (fluid model of :mod:`lab.forecast.study`: restart cost 0, strict shortfall, scored
after ``--warmup-days``, telemetry gaps not scored):

* **Leave one trace out.** Each real trace given is in turn the *tuning* trace: the baselines'
  settings are chosen on it **with hindsight** (the reactive margin and the night window's hours and
  margin: the largest harvest whose strict shortfall is within the budget, on its scored period as
  recorded) and then applied, unchanged, to every other trace. Tidal's settings are its defaults
  (``--tidal KEY=VALUE`` overrides one for every trace); it is not tuned on any trace here.
* **Every whole-day rotation** of each held-out trace (:func:`~lab.forecast.rotate.rotate_days`):
  where the bursts fall decides small budgets. The table shows rotation 0 (as recorded) and the worst
  over rotations (highest shortfall, lowest harvest x oracle, how many rotations kept the budget).
* **Synthetic stress traces** (:mod:`lab.forecast.stress`, seeded): a burst larger than any in the
  history, a level shift, a week of holidays, a pool of models peaking at different hours. They are
  held out from every tuning trace; their rotations step by ``--stress-rotation-step`` days.

The oracle knows the future (margin 0): ``x oracle`` divides each harvest by its harvest on the same
rotation.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from lab.forecast.rotate import rotate_days
from lab.forecast.stress import GENERATORS, stress_traces
from lab.forecast.study import (
    DEFAULT_TRACES_DIR,
    _night_lent,
    _reactive_lent,
    _tune_margin,
    fluid_score,
    grid_steps,
    load_demand,
    night_window,
    run_policy,
)
from tidal.policy import forecast as fc
from tidal.policy.baselines import NightWindowPolicy
from tidal.policy.loan import LoanTiming, TidalConfig, TidalPolicy

DAY_S = 86400.0


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["ledger_fraction=0.8", "forecast.errors.noise_exponent=0.5", ...]`` -> TidalConfig keyword
    arguments (numbers; ``forecast.KEY`` a ForecastConfig setting as
    :func:`~tidal.policy.forecast.with_settings` names it, under the key ``forecast``); clear errors."""
    known = {f.name for f in fields(TidalConfig)} - {"shortfall_budget", "forecast", "timing"}
    known_fc = {f"forecast.{name}" for name in fc.setting_names()} - {
        "forecast.step_s",
        "forecast.horizon_s",
    }
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in known | known_fc:
            raise ValueError(f"--tidal {item!r}: expected KEY=NUMBER with KEY one of {sorted(known)} or "
                             "forecast.<a ForecastConfig setting>")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--tidal {item!r}: {value!r} is not a number") from None
        if key in known_fc:
            out.setdefault("forecast", {})[key.removeprefix("forecast.")] = number
        else:
            out[key] = number
    checked = dict(out)
    try:  # a value the config refuses (ledger_fraction=5) fails here, with its message
        TidalConfig(forecast=fc.with_settings(fc.ForecastConfig(), checked.pop("forecast", {})), **checked)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--tidal: {e}") from None
    return out


def _timing(lead: int, step_s: float) -> LoanTiming:
    return LoanTiming(
        notice_s=0.0, final_checkpoint_s=0.0, release_s=0.0, warmup_s=lead * step_s, restart_cost_s=0.0
    )


def tune_baselines(demand: np.ndarray, times_s: np.ndarray, *, n: int, step_s: float, lead: int, warmup: int,
                   budgets: tuple[float, ...], night_hours: float) -> dict[str, Any]:
    """The baselines' settings chosen with hindsight on one (tuning) trace, per budget."""
    start_s, end_s = night_window(demand, step_s, night_hours)
    t0 = float(times_s[0])
    night = NightWindowPolicy(start_s=(start_s + t0) % DAY_S, end_s=(end_s + t0) % DAY_S, step_s=step_s)
    out: dict[str, Any] = {"night_window_s": [night.start_s, night.end_s], "budgets": {}}
    for b in budgets:
        out["budgets"][str(b)] = {
            "reactive_margin": _tune_margin(
                lambda m: _reactive_lent(demand, n, m), demand, n, lead, warmup, b
            ),
            "night_margin": _tune_margin(
                lambda m: _night_lent(night, times_s, n, m, lead), demand, n, lead, warmup, b
            ),
        }
    return out


def oracle_lent(demand: np.ndarray, n: int, lead: int) -> np.ndarray:
    """Vectorized :class:`~tidal.policy.baselines.OraclePolicy` with no minimum loan window (restart cost 0):
    ``min(N - demand(t + j) for j = 1..lead, N - demand(t))`` in whole GPUs; unknown or past-the-end
    future demand counts as the whole pool, unknown demand now is no limit."""
    m = len(demand)
    fut = np.full(m + lead, float(n))
    fut[:m] = np.where(np.isnan(demand), float(n), demand)
    free = np.minimum(np.maximum(np.floor(n - fut + 1e-9), 0), n)
    ahead = np.min(np.stack([free[j: j + m] for j in range(1, lead + 1)]), axis=0)
    now_cap = np.where(np.isnan(demand), n, np.maximum(np.floor(n - np.nan_to_num(demand) + 1e-9), 0))
    return np.minimum(ahead, now_cap).astype(int)


def short(name: str) -> str:
    """A trace's name for the table: ``servegen-language-m-large`` -> ``m-large``."""
    return name.removeprefix("servegen-language-")


def _score(
    lent: np.ndarray, demand: np.ndarray, n: int, lead: int, warmup: int, oracle: float
) -> dict[str, float]:
    s = fluid_score(lent, demand, n, lead, warmup)
    return {"shortfall": s["shortfall_strict"],
            "x_oracle": s["harvest"] / oracle if oracle > 0 else math.nan}


def evaluate_rotation(job: dict[str, Any]) -> dict[str, Any]:
    """One held-out trace at one rotation: tidal at each budget, the baselines of each tuning trace,
    oracle."""
    n, step_s, lead, warmup = job["n"], job["step_s"], job["lead"], job["warmup"]
    times, demand = job["times_s"], job["demand"]
    timing = _timing(lead, step_s)
    horizon_s = max(6 * 3600.0, timing.lead_time_s + step_s)
    oracle = fluid_score(oracle_lent(demand, n, lead), demand, n, lead, warmup)["harvest"]
    tidal = dict(job["tidal"])
    fcfg = fc.with_settings(fc.ForecastConfig(step_s=step_s, horizon_s=horizon_s), tidal.pop("forecast", {}))
    rows: dict[str, dict[str, Any]] = {}
    for b in job["budgets"]:
        r: dict[str, Any] = {}
        cfg = TidalConfig(shortfall_budget=b, forecast=fcfg, timing=timing, **tidal)
        lent, state = run_policy(TidalPolicy(cfg), times, demand, n)
        r["tidal"] = {
            **_score(lent, demand, n, lead, warmup, oracle),
            "ledger_gpu_h": state.ledger_gpu_s / 3600.0,
        }
        for tuned_on, tb in job["tuned"].items():
            knobs = tb["budgets"][str(b)]
            night = NightWindowPolicy(
                start_s=tb["night_window_s"][0], end_s=tb["night_window_s"][1], step_s=step_s
            )
            r[f"reactive (tuned: {short(tuned_on)})"] = _score(
                _reactive_lent(demand, n, knobs["reactive_margin"]), demand, n, lead, warmup, oracle
            )
            r[f"night-window (tuned: {short(tuned_on)})"] = _score(
                _night_lent(night, times, n, knobs["night_margin"], lead), demand, n, lead, warmup, oracle)
        rows[str(b)] = r
    return {"trace": job["trace"], "rotation": job["rotation"], "oracle_harvest": oracle, "budgets": rows}


def _summarize(runs: list[dict[str, Any]], budgets: tuple[float, ...]) -> dict[str, Any]:
    """Per budget and policy: rotation 0, and the worst over rotations."""
    out: dict[str, Any] = {}
    for b in budgets:
        per: dict[str, Any] = {}
        for pol in runs[0]["budgets"][str(b)]:
            xs = [(r["rotation"], r["budgets"][str(b)][pol]) for r in runs]
            r0 = next((v for k, v in xs if k == 0), xs[0][1])
            worst = max(xs, key=lambda kv: kv[1]["shortfall"])
            per[pol] = {"rotation0": r0, "rotations": len(xs),
                        "held": sum(v["shortfall"] <= b + 1e-12 for _, v in xs),
                        "worst_shortfall": worst[1]["shortfall"], "worst_rotation": worst[0],
                        "min_x_oracle": min(v["x_oracle"] for _, v in xs)}
        out[str(b)] = per
    return out


def run(traces: list[Path], *, serving_gpus: int = 128, step_s: float = 600.0, lead_s: float = 1200.0,
        budgets: tuple[float, ...] = (0.005, 0.01), warmup_days: float = 2.0, night_hours: float = 8.0,
        rotations: bool = True, stress: tuple[str, ...] = tuple(GENERATORS), stress_rotation_step: int = 2,
        seed: int = 0, tidal: dict[str, Any] | None = None, workers: int | None = None,
        as_json: bool = False, log: Any = None) -> dict[str, Any]:
    """Run the protocol (module docstring); print the table (stderr with ``as_json``); return the result."""
    from rich.console import Console

    started = time.perf_counter()
    tidal = dict(tidal or {})
    checked = dict(tidal)  # a bad override fails here, once, with the config's own message
    TidalConfig(forecast=fc.with_settings(fc.ForecastConfig(), checked.pop("forecast", {})), **checked)
    if len(traces) < 2:
        raise ValueError(
            "leave-one-trace-out needs at least two real traces (tune on one, report on the others)"
        )
    if stress_rotation_step < 1:
        raise ValueError(f"--stress-rotation-step must be >= 1, got {stress_rotation_step}")
    lead, warmup = grid_steps(lead_s, step_s, warmup_days)
    day = round(DAY_S / step_s)
    series: dict[str, tuple[np.ndarray, np.ndarray, str]] = {}
    for path in traces:
        trace, times, demand = load_demand(Path(path), serving_gpus, step_s, warmup + lead)
        if trace.name in series:
            raise ValueError(f"two traces named {trace.name!r}")
        series[trace.name] = (times, demand, "real")
    for name, (times, load) in stress_traces(seed, step_s, stress).items():
        series[f"stress:{name}"] = (times, serving_gpus * load / float(load.max()), "stress")
    real = [k for k, v in series.items() if v[2] == "real"]

    say = log or (lambda s: None)
    tuned: dict[str, Any] = {}
    for name in real:
        times, demand, _ = series[name]
        say(f"tuning the baselines on {name} (hindsight)")
        tuned[name] = tune_baselines(demand, times, n=serving_gpus, step_s=step_s, lead=lead, warmup=warmup,
                                     budgets=budgets, night_hours=night_hours)

    jobs = []
    for name, (times, demand, kind) in series.items():
        days = len(demand) // day
        if days < 1 or len(demand) <= warmup + lead:
            raise ValueError(f"trace {name!r} is shorter than a day plus the warm-up")
        rots = list(range(days)) if kind == "real" else list(range(0, days, stress_rotation_step))
        if not rotations:
            rots = [0]
        held_out_from = {t: tuned[t] for t in real if t != name}
        for k in rots:
            jobs.append({"trace": name, "rotation": k, "n": serving_gpus, "step_s": step_s, "lead": lead,
                         "warmup": warmup, "times_s": times, "demand": rotate_days(demand, k, day),
                         "budgets": budgets, "tidal": tidal, "tuned": held_out_from})
    say(f"{len(jobs)} trace rotations, {len(budgets)} budgets each")
    workers = workers or min(2, os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(evaluate_rotation, jobs))
    else:
        results = [evaluate_rotation(j) for j in jobs]
    result: dict[str, Any] = {
        "config": {"serving_gpus": serving_gpus, "step_s": step_s, "lead_s": lead_s, "budgets": list(budgets),
                   "warmup_days": warmup_days, "night_hours": night_hours, "seed": seed, "tidal": tidal,
                   "stress_rotation_step": stress_rotation_step, "rotations": rotations},
        "tuned": tuned, "traces": {}}
    for name in series:
        runs = [r for r in results if r["trace"] == name]
        result["traces"][name] = {"kind": series[name][2], "summary": _summarize(runs, budgets), "runs": runs}
    result["elapsed_s"] = time.perf_counter() - started
    console = Console(stderr=as_json, width=170)
    render(result, console)
    if as_json:
        print(json.dumps(result, indent=2))
    return result


def render(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    c = result["config"]
    table = Table(
        title=f"unseen traffic: fluid model, {c['serving_gpus']} serving GPUs, "
        f"lead {c['lead_s'] / 60:g} min, "
        f"{c['warmup_days']:g} warm-up days; baselines tuned with hindsight on the other trace"
    )
    for col in ("trace", "budget", "policy"):
        table.add_column(col)
    for col in (
        "× oracle",
        "shortfall",
        "held",
        "rotations held",
        "worst shortfall (rot)",
        "lowest × oracle",
    ):
        table.add_column(col, justify="right")
    for name, tr in result["traces"].items():
        for b, per in tr["summary"].items():
            for pol, s in per.items():
                r0 = s["rotation0"]
                ok = r0["shortfall"] <= float(b) + 1e-12
                all_ok = s["held"] == s["rotations"]
                table.add_row(
                    short(name),
                    f"{float(b):.1%}",
                    pol,
                    f"{r0['x_oracle']:.3f}",
                    f"{r0['shortfall']:.5f}",
                    "[green]yes[/]" if ok else "[red]no[/]",
                    f"{'[green]' if all_ok else '[red]'}{s['held']} of {s['rotations']}[/]",
                    f"{s['worst_shortfall']:.5f} ({s['worst_rotation']})",
                    f"{s['min_x_oracle']:.3f}",
                )
            table.add_section()
    console.print(table)
    console.print(
        f"× oracle and shortfall: rotation 0 (as recorded); held: shortfall ≤ budget. tidal settings: "
        f"{c['tidal'] or 'defaults'}. elapsed {result['elapsed_s']:.0f} s",
        highlight=False,
    )


__all__ = [
    "evaluate_rotation",
    "oracle_lent",
    "parse_overrides",
    "run",
    "tune_baselines",
    "DEFAULT_TRACES_DIR",
]

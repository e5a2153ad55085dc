"""Running policies side by side on one scenario (same demand, jobs and seed), sweeping their risk knobs
(:data:`SWEEP_GRID`), and tuning a baseline's margin to a budget with hindsight (:func:`tune_margin`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tidal.model import Tenant
from tidal.sim.config import CkptMode, ResizeMode, SimConfig, with_modes
from tidal.sim.engine import SimResult, simulate
from tidal.sim.jobs import JobSpec, SpotBacklog
from tidal.sim.policies import PolicySpec, knob_label, knob_of

SWEEP_GRID: dict[str, tuple[float | None, ...]] = {
    "tidal": (0.001, 0.002, 0.005, 0.01, 0.02, 0.05),
    "reactive": (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.45),  # x serving pool (GPUs)
    "night-window": (0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8),  # x serving pool (GPUs)
    "oracle": (0.0,),
    "none": (None,),
}

Log = Callable[[str], None]


@dataclass(frozen=True)
class Scenario:
    """What every policy of a comparison runs on. ``demand``: GPUs per ``step_s`` step from time 0;
    ``clients``: the same per client (the tail last), when the trace has them."""

    demand: np.ndarray
    step_s: float
    config: SimConfig
    jobs: tuple[JobSpec, ...] = ()
    backlog: SpotBacklog | None = None
    tenants: tuple[Tenant, ...] = ()
    night_hours: float = 8.0
    name: str = ""
    clients: np.ndarray | None = None

    def run(self, spec: PolicySpec, config: SimConfig | None = None, check: bool = False) -> SimResult:
        res = simulate(self.demand, step_s=self.step_s, policy=spec, config=config or self.config,
                       jobs=list(self.jobs), backlog=self.backlog, tenants=list(self.tenants) or None,
                       check=check, night_hours=self.night_hours, clients=self.clients)
        res.metrics["knob"] = knob_of(spec, self.config.serving_gpus)
        res.metrics["knob_label"] = knob_label(spec, self.config.serving_gpus)
        return res


def result_key(name: str, ckpt: str, resize: str, several_modes: bool) -> str:
    return f"{name}[{ckpt},{resize}]" if several_modes else name


def compare(scenario: Scenario, specs: Sequence[PolicySpec],
            modes: Sequence[tuple[CkptMode, ResizeMode]] = (),
            log: Log = lambda s: None) -> dict[str, SimResult]:
    """Every policy under every (checkpoint mode, resize mode); keys from :func:`result_key`."""
    cfg = scenario.config
    modes = list(modes) or [(cfg.ckpt.mode, cfg.resize)]
    out: dict[str, SimResult] = {}
    for ckpt, resize in modes:
        c = with_modes(cfg, ckpt, resize)
        for spec in specs:
            key = result_key(spec.name, ckpt, resize, len(modes) > 1)
            log(f"{key}: {scenario.config.days:g} days ...")
            out[key] = scenario.run(spec, c)
            m = out[key].metrics
            log(f"{key}: harvest {m['harvest_ratio']:.3f}, shortfall {m['shortfall_ratio']:.4f}, "
                f"{m['wall_s']:.1f} s")
    return out


def sweep_knobs(name: str, serving_gpus: int) -> list[float | None]:
    grid = SWEEP_GRID[name]
    if name in ("reactive", "night-window"):
        return [round(f * serving_gpus, 2) for f in grid if f is not None]  # (these grids hold no None)
    return list(grid)


def sweep(scenario: Scenario, names: Sequence[str], log: Log = lambda s: None) -> list[dict[str, Any]]:
    """One point per (policy, knob): the policy, the knob and the run's metrics."""
    cfg = replace(scenario.config, record_timeline=False)
    points = []
    for name in names:
        for knob in sweep_knobs(name, cfg.serving_gpus):
            spec = PolicySpec(name, knob)
            r = scenario.run(spec, cfg)
            m = r.metrics
            log(f"sweep {name} {knob_label(spec, cfg.serving_gpus)}: harvest {m['harvest_ratio']:.3f}, "
                f"shortfall {m['shortfall_ratio']:.4f}")
            points.append({"policy": name, **m})
    return points


def best_within(points: Sequence[dict[str, Any]], name: str, budget: float) -> dict[str, Any] | None:
    """The point of ``name`` with the most harvest among those within ``budget`` (hindsight)."""
    ok = [p for p in points if p["policy"] == name and (p["shortfall_ratio"] or 0.0) <= budget + 1e-12]
    return max(ok, key=lambda p: p["harvest_ratio"] or 0.0) if ok else None


def tune_margin(scenario: Scenario, name: str, budget: float, *, steps: int = 7,
                log: Log = lambda s: None) -> dict[str, Any]:
    """Smallest margin (GPUs) for ``name`` (``reactive`` or ``night-window``) whose realized shortfall
    is within ``budget``, by bisection over whole runs (hindsight). Returns that run's metrics."""
    if name not in ("reactive", "night-window"):
        raise ValueError(f"only reactive and night-window have a margin to tune, not {name!r}")
    cfg = replace(scenario.config, record_timeline=False)
    n = float(cfg.serving_gpus)

    def run(margin: float) -> dict[str, Any]:
        m = scenario.run(PolicySpec(name, round(margin, 2)), cfg).metrics
        log(f"tune {name} margin {margin:.2f}: shortfall {m['shortfall_ratio']:.4f}, "
            f"harvest {m['harvest_ratio']:.3f}")
        return m

    lo, hi = 0.0, n
    best = run(lo)
    if (best["shortfall_ratio"] or 0.0) <= budget:
        return best
    best = run(hi)
    for _ in range(steps):
        mid = (lo + hi) / 2
        m = run(mid)
        if (m["shortfall_ratio"] or 0.0) <= budget:
            hi, best = mid, m
        else:
            lo = mid
    return best


def headline(scenario: Scenario, budget: float, log: Log = lambda s: None, steps: int = 7) -> dict[str, Any]:
    """``tidal`` at ``budget`` vs ``reactive`` and ``night-window`` tuned with hindsight to it, vs
    ``oracle``: harvest ratios, realized shortfalls and ratios to the oracle."""
    cfg = replace(scenario.config, record_timeline=False)
    rows: dict[str, dict[str, Any]] = {}
    log("headline: tidal")
    rows["tidal"] = scenario.run(PolicySpec("tidal", budget), cfg).metrics
    for name in ("reactive", "night-window"):
        log(f"headline: {name} (hindsight)")
        rows[f"{name} (hindsight)"] = tune_margin(scenario, name, budget, steps=steps, log=log)
    log("headline: oracle")
    rows["oracle"] = scenario.run(PolicySpec("oracle"), cfg).metrics
    o = rows["oracle"]["harvested_gpu_hours"]
    for r in rows.values():
        r["x_oracle"] = r["harvested_gpu_hours"] / o if o > 0 else math.nan
        r["meets_budget"] = (r["shortfall_ratio"] or 0.0) <= budget + 1e-12
    return rows

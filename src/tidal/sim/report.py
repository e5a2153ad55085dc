"""Showing results: the Rich table, the JSON object, the timeline and sweep plots (PNG, matplotlib).
Nothing here simulates."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tidal.sim.metrics import METRIC_KEYS

TABLE_COLUMNS = (
    ("harvest_ratio", "harvest", "{:.3f}"), ("x_oracle", "× oracle", "{:.3f}"),
    ("harvested_gpu_hours", "harvested GPU-h", "{:,.0f}"), ("loaned_gpu_hours", "loaned GPU-h", "{:,.0f}"),
    ("shortfall_ratio", "shortfall", "{:.4f}"), ("reclaims", "reclaims", "{:,}"),
    ("lost_gpu_hours", "lost GPU-h", "{:,.1f}"), ("pool_goodput", "goodput", "{:.3f}"),
    ("ettr_mean", "ETTR", "{:.3f}"), ("ettr_p10", "ETTR p10", "{:.3f}"), ("jain_fairness", "Jain", "{:.3f}"),
    ("mean_queue_s", "queue s", "{:,.0f}"), ("mean_jct_s", "JCT s", "{:,.0f}"),
    ("decision_p99_ms", "p99 ms", "{:.1f}"), ("wall_s", "wall s", "{:.1f}"))


def clean(x: Any) -> Any:
    """JSON-safe: NaN and infinities become ``None``; numpy scalars become Python numbers."""
    if isinstance(x, Mapping):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def with_oracle_ratio(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each result plus ``x_oracle`` (its harvested GPU-hours over the oracle's, when one ran)."""
    oracle = next((r for k, r in results.items() if k.split("[")[0] == "oracle"), None)
    o = oracle["harvested_gpu_hours"] if oracle else math.nan
    return {k: {**r, "x_oracle": r["harvested_gpu_hours"] / o if o and o > 0 else math.nan}
            for k, r in results.items()}


def to_json(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One JSON object keyed by policy, each holding every key of ``METRIC_KEYS`` (and extras)."""
    for k, r in results.items():
        missing = [m for m in METRIC_KEYS if m not in r]
        if missing:
            raise AssertionError(f"result {k!r} lacks {missing}")
    return json.dumps(clean(dict(results)), indent=2)


def _fmt(fmt: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return fmt.format(v)


def render_table(results: Mapping[str, Mapping[str, Any]], console: Any, title: str = "") -> None:
    """The results as one Rich table, a row per policy (every metric is in the JSON)."""
    from rich.table import Table

    results = with_oracle_ratio(results)
    t = Table(title=title or None)
    t.add_column("policy", no_wrap=True)
    t.add_column("knob", no_wrap=True)
    for _, head, _ in TABLE_COLUMNS:
        t.add_column(head, justify="right")
    for name, r in results.items():
        t.add_row(name, str(r.get("knob_label", "")), *(_fmt(f, r.get(k)) for k, _, f in TABLE_COLUMNS))
    console.print(t)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def serving_bands(tl: Mapping[str, np.ndarray], serving_gpus: int, mask: Any = slice(None)
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(serving capacity, capacity + warming GPUs) per step: where the plot's warming and lent bands start."""
    cap = serving_gpus - np.asarray(tl["lent_gpus"])[mask] - np.asarray(tl["warming_gpus"])[mask]
    return cap, cap + np.asarray(tl["warming_gpus"])[mask]


def plot_timeline(timelines: Mapping[str, Mapping[str, np.ndarray]], path: str | Path, *, serving_gpus: int,
                  start_day: float = 0.0, days: float = 2.0, title: str = "") -> Path:
    """One panel per policy over ``[start_day, start_day + days)``: demand, the plan's bound, serving
    capacity, lent and warming bands, training on loans. Returns the path written."""
    plt = pyplot()
    names = [n for n, tl in timelines.items() if len(tl.get("t_s", ()))]
    if not names:
        raise ValueError("no timeline recorded (record_timeline=False?)")
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 2.6 * len(names) + 0.6), sharex=True, squeeze=False)
    lo, hi = start_day * 86400.0, (start_day + days) * 86400.0
    for ax, name in zip(axes[:, 0], names, strict=True):
        tl = timelines[name]
        t = np.asarray(tl["t_s"])
        m = (t >= lo) & (t < hi)
        if not m.any():
            raise ValueError(f"the window {start_day:g}+{days:g} days holds no step of the run")
        x = t[m] / 86400.0
        ax.axhline(serving_gpus, color="0.6", lw=0.8, ls=":", label=f"serving pool N={serving_gpus}")
        ax.step(x, tl["demand_gpus"][m], where="post", color="C0", lw=1.2, label="demand")
        if np.isfinite(tl["upper_gpus"][m]).any():
            ax.step(x, tl["upper_gpus"][m], where="post", color="C1", lw=1.0, ls="--",
                    label="forecast (plan's bound)")
        cap, warm_top = serving_bands(tl, serving_gpus, m)
        # Lent and warming GPUs are bands between serving's capacity and the pool; training on loans dotted.
        ax.fill_between(x, warm_top, serving_gpus, step="post", color="C2", alpha=0.22, lw=0,
                        label="lent to training (pool - capacity)")
        ax.fill_between(x, cap, warm_top, step="post", color="C4", alpha=0.3, lw=0,
                        label="warming up after a return")
        ax.step(x, cap, where="post", color="C3", lw=1.0, label="serving capacity")
        ax.step(x, tl["training_on_loans_gpus"][m], where="post", color="C2", lw=1.0, ls=":",
                label="training on loans (GPUs)")
        ax.set_ylabel("GPUs")
        ax.set_ylim(0, 1.35 * serving_gpus)  # a forecast bound far above the pool is clipped
        ax.set_title(name, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    axes[0, 0].legend(handles.values(), handles.keys(), loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("day")
    if title:
        fig.suptitle(textwrap.fill(title, 120), fontsize=10)
    return save_figure(plt, fig, path)


def plot_sweep(points: Sequence[Mapping[str, Any]], path: str | Path, *, budgets: Sequence[float] = (),
               title: str = "") -> Path:
    """Harvest ratio against shortfall ratio, one curve per policy across its knob."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    by: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        by.setdefault(p["policy"], []).append(p)
    for i, (name, ps) in enumerate(by.items()):
        ps = sorted(ps, key=lambda p: p["shortfall_ratio"] or 0.0)
        xs = [max(p["shortfall_ratio"] or 0.0, 1e-5) for p in ps]
        ys = [p["harvest_ratio"] or 0.0 for p in ps]
        ax.plot(xs, ys, marker="o", ms=4, color=f"C{i}", label=name)
        for p, x, y in zip(ps, xs, ys, strict=True):
            if p.get("knob") is not None and name != "oracle":
                ax.annotate(f"{p['knob']:g}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for b in budgets:
        ax.axvline(b, color="0.5", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("serving shortfall ratio (unmet / demanded GPU-hours; 0 drawn at 1e-5)")
    ax.set_ylabel("harvest ratio (kept training on loans / idle serving GPU-hours)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    if title:
        ax.set_title(textwrap.fill(title, 90), fontsize=9)
    return save_figure(plt, fig, path)


def save_figure(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (its layout tightened) and free it."""
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Prometheus metrics (``GET /metrics``; every series in docs/control.md, Metrics): the pool's and the
per-job series from the reconcile loop's newest step (:mod:`tidal.control.read_view`; without a loop, from
the store at scrape time). Per-job series exist for jobs holding GPUs only; the pool's GPUs are summed by
pool, state and tenant, so a scrape follows the running jobs and the tenants, not the nodes or the history
(``GET /v1/pool`` lists nodes, a page at a time)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from tidal.control.accounting import job_report
from tidal.control.node_watch import totals as node_totals
from tidal.control.read_view import PlaneView
from tidal.control.states import State
from tidal.control.store import HeldJob, Store
from tidal.model import Node


class PlaneCollector:
    """The plane's series. ``view``: the pool as the reconcile loop's newest step left it
    (:mod:`tidal.control.read_view`), which the pool's and the per-job series are read from (built once per
    step, as of its time, with the series ``tidal_plane_view_time_seconds``); None, or no view yet: read from
    the store at the scrape."""

    def __init__(self, store: Store, nodes: list[Node], clock: Callable[[], float], advisor: Any = None,
                 loans: Any = None, view: Callable[[], PlaneView | None] | None = None) -> None:
        self.store, self.nodes, self.clock, self.advisor, self.loans = store, nodes, clock, advisor, loans
        self.view = view
        self._held = threading.local()  # .jobs, .view: what this thread's collect() read, for job_text()

    def collect(self) -> Iterator[Metric]:
        view = self.view() if self.view is not None else None
        self._held.view = view
        if view is None:
            jobs: Sequence[HeldJob] = self.store.held(accounting=True)
            by = _pool_gpus(self.nodes, jobs)
            counts = self.store.count_by_state()
        else:
            jobs = view.held
            by = view.memo(("metrics", "pool"), lambda v: _pool_gpus(v.nodes, v.held))
            counts = view.by_state(self.store.submitted)
        pool = GaugeMetricFamily("tidal_pool_gpus", "GPUs of the pool (training or serving nodes) by state "
                                 "and owning tenant", labels=["pool", "state", "tenant"])
        for key, g in by:
            pool.add_metric(list(key), g)
        yield pool
        by_state = GaugeMetricFamily("tidal_jobs", "Jobs by state", labels=["state"])
        for s, c in ({s.value: 0 for s in State} | counts).items():
            by_state.add_metric([s], c)
        yield by_state
        if view is not None:
            yield GaugeMetricFamily("tidal_plane_view_time_seconds", "Unix time of the reconcile step the "
                                    "pool's and the per-job series were read at", value=view.as_of_s)
        self._held.jobs = jobs
        yield from _node_loss_metrics(node_totals(self.store))
        if self.loans is not None:
            yield from _loan_metrics(self.loans.view())
            return
        latest = self.advisor.latest if self.advisor is not None else None
        if latest is not None:
            yield from _serving_metrics(latest)


    def job_text(self, now: float) -> str:
        """The per-job series of the jobs :meth:`collect` read, in the text format, written directly (a line
        each, thousands of jobs); labels ``job_id`` and ``tenant`` (not ``job``: Prometheus sets that). From a
        view: as of its step, built once."""
        view = getattr(self._held, "view", None)
        if view is not None:
            return view.memo(("metrics", "jobs"), lambda v: _job_text(v.held, v.as_of_s))
        return _job_text(getattr(self._held, "jobs", ()), now)


def _pool_gpus(nodes: Sequence[Node], jobs: Sequence[HeldJob]) -> list[tuple[tuple[str, str, str], int]]:
    """``tidal_pool_gpus``' samples: (pool, state, tenant) -> GPUs, summed over the nodes."""
    kind = {n.name: n.pool for n in nodes}
    by: Counter[tuple[str, str, str]] = Counter({(k, "free", ""): 0 for k in sorted(set(kind.values()))})
    for n in nodes:
        by[n.pool, "free", ""] += n.gpus
    for j in jobs:
        stopping = j.state in (State.PREEMPTING, State.CANCELLING)
        for node, g in (j.placement or {}).items():
            k, d = kind.get(node), g if stopping else (j.releasing or {}).get(node, 0)
            if k is not None:
                by[k, "free", ""] -= g
                by[k, "allocated", j.tenant] += g - d
                by[k, "draining", j.tenant] += d
    return [(key, g) for key, g in sorted(by.items()) if g or key[1] == "free"]


def _job_text(jobs: Iterable[HeldJob], now: float) -> str:
    """:meth:`PlaneCollector.job_text` of ``jobs`` at ``now``."""
    out: dict[str, list[str]] = {k: [] for k in _JOB_SERIES}
    for j in jobs:
        lv = f'job_id="{_esc(j.id)}",tenant="{_esc(j.tenant)}"'
        p = j.progress or {}
        vals = {"tidal_job_gpus": j.gpus, "tidal_job_step": p.get("step"),
                "tidal_job_steps_per_second": p.get("steps_per_s") or None,
                "tidal_job_ettr_ratio": job_report(j, now)["ettr"], "tidal_job_restarts": j.restarts,
                "tidal_job_preemptions": j.preemptions, "tidal_job_lost_work_seconds": j.lost_s}
        for k, v in vals.items():
            if v is not None:
                out[k].append(f"{k}{_JOB_SERIES[k][1]}{{{lv}}} {float(v)!r}\n")
        for tier, (_, captured_s) in sorted((p.get("tiers") or {}).items()):
            out["tidal_job_checkpoint_age_seconds"].append(
                f'tidal_job_checkpoint_age_seconds{{{lv},tier="{_esc(str(tier))}"}} '
                f"{max(0.0, now - captured_s)!r}\n")
    return "".join(f"# HELP {k} {h}\n# TYPE {k} {'counter' if t else 'gauge'}\n" + "".join(out[k])
                   for k, (h, t) in _JOB_SERIES.items())


_JOB_SERIES = {  # name: (help, suffix: "_total" for a counter)
    "tidal_job_gpus": ("GPUs a job holds", ""),
    "tidal_job_step": ("Newest completed training step", ""),
    "tidal_job_steps_per_second": ("Training steps per second (this attempt)", ""),
    "tidal_job_checkpoint_age_seconds": ("Seconds since the newest checkpoint of a tier was captured", ""),
    "tidal_job_ettr_ratio": ("Effective training time ratio", ""),
    "tidal_job_restarts": ("Restarts after failures", "_total"),
    "tidal_job_preemptions": ("Preemptions", "_total"),
    "tidal_job_lost_work_seconds": ("Seconds of training re-run after failures", "_total"),
}


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _node_loss_metrics(t: dict) -> Iterator[Metric]:
    yield CounterMetricFamily("tidal_node_losses", "Jobs that lost ranks with a node", value=t["losses"])
    yield SummaryMetricFamily("tidal_node_loss_heartbeat_age_seconds",
                              "Age of the lost ranks' newest heartbeat when the loss was detected",
                              count_value=t["heartbeat_age_count"], sum_value=t["heartbeat_age_sum_s"])
    yield SummaryMetricFamily("tidal_node_loss_recovery_seconds",
                              "From a node loss detected to the job training again",
                              count_value=t["recoveries"], sum_value=t["recovery_sum_s"])


def _plan_metrics(demand_gpus: float | None, lendable_gpus: float, margin_gpus: float) -> Iterator[Metric]:
    """The newest loan plan's gauges, advised or lent by; demand is absent while unknown (None or NaN)."""
    demand = GaugeMetricFamily("tidal_serving_demand_gpus", "Serving demand at the newest plan, GPUs")
    if demand_gpus is not None and demand_gpus == demand_gpus:
        demand.add_metric([], demand_gpus)
    yield demand
    yield GaugeMetricFamily("tidal_serving_lendable_gpus", "Serving GPUs the newest loan plan could lend",
                            value=lendable_gpus)
    yield GaugeMetricFamily("tidal_serving_margin_gpus", "Safety margin of the newest plan at the lead time",
                            value=margin_gpus)


def _serving_metrics(s: Any) -> Iterator[Metric]:
    """Gauges of the newest loan plan (a :class:`tidal.serving.watch.Step`)."""
    yield from _plan_metrics(s.demand_gpus, s.plan.lendable_gpus, s.plan.margin_gpus)
    due = GaugeMetricFamily("tidal_serving_reclaim_gpus", "Lent GPUs the newest plan wants back within",
                            labels=["within"])
    for label, horizon in (("1h", 3600.0), ("6h", 6 * 3600.0)):
        due.add_metric([label], sum(r.gpus for r in s.plan.reclaims if r.deadline_s <= s.now_s + horizon)
                       + s.plan.reclaim_now_gpus)
    yield due


def _loan_metrics(v: dict[str, Any]) -> Iterator[Metric]:
    """Live lending (:meth:`tidal.control.loans.LiveLoans.view`)."""
    st = v.get("stats") or {}
    yield from _plan_metrics(v.get("demand_gpus"), v.get("lendable_gpus", 0), v.get("margin_gpus", 0.0))
    yield GaugeMetricFamily("tidal_loan_lent_gpus", "Serving GPUs lent to spot training now",
                            value=v.get("lent_gpus", 0))
    yield GaugeMetricFamily("tidal_loan_warming_gpus", "Returned GPUs warming up (neither lent nor serving)",
                            value=v.get("warming_gpus", 0))
    yield GaugeMetricFamily("tidal_loan_reclaim_gpus", "Lent GPUs owed back (outstanding reclaims)",
                            value=sum(r["gpus"] for r in v.get("reclaims", ())))
    rec = CounterMetricFamily("tidal_loan_reclaims", "GPU returns to serving, by whether before the deadline",
                              labels=["outcome"])
    rec.add_metric(["met"], st.get("reclaims_met", 0))
    rec.add_metric(["missed"], st.get("reclaims_missed", 0))
    yield rec
    if v.get("worst_margin_s") is not None:
        yield GaugeMetricFamily("tidal_loan_worst_return_margin_seconds",
                                "Smallest margin before a reclaim deadline at a return",
                                value=v["worst_margin_s"])
    yield CounterMetricFamily("tidal_serving_shortfall_gpu_seconds",
                              "Serving demand unmet, GPU-seconds of serving time",
                              value=st.get("shortfall_gpu_s", 0.0))
    yield CounterMetricFamily("tidal_loan_lent_gpu_seconds", "GPU-seconds lent",
                              value=st.get("lent_gpu_s", 0.0))
    fails = CounterMetricFamily("tidal_serving_action_failures", "Serving adapter actions that failed",
                                labels=["action"])
    fails.add_metric(["release"], st.get("release_failures", 0))
    fails.add_metric(["restore"], st.get("restore_failures", 0))
    yield fails
    yield CounterMetricFamily("tidal_serving_unknown_demand_steps", "Plan steps with unknown serving demand",
                              value=st.get("unknown_demand_steps", 0))
    yield GaugeMetricFamily("tidal_serving_pool_gpus", "Serving GPUs in the pool now (lost nodes are not)",
                            value=v.get("serving_gpus", 0))
    yield CounterMetricFamily("tidal_serving_node_losses", "Serving nodes lost",
                              value=st.get("nodes_lost", 0))


class _Registry(CollectorRegistry):
    plane: PlaneCollector


def registry(store: Store, nodes: list[Node], clock: Callable[[], float], advisor: Any = None,
             loans: Any = None, view: Callable[[], PlaneView | None] | None = None) -> CollectorRegistry:
    reg = _Registry(auto_describe=False)
    reg.plane = PlaneCollector(store, nodes, clock, advisor, loans, view)
    reg.register(reg.plane)
    return reg


def render(reg: CollectorRegistry) -> bytes:
    """The text format: the registry's series, then the plane's per-job ones."""
    out = generate_latest(reg)
    plane = getattr(reg, "plane", None)
    return out + plane.job_text(plane.clock()).encode() if isinstance(plane, PlaneCollector) else out

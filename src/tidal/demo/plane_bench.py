"""The live plane at pool scale: one workload through the real store, reconcile loop and scheduler over the
virtual executor (:func:`run_plane`) and through the simulator (:func:`run_sim`), and ``tidal bench plane``
(:func:`bench_plane`: step, submit, read and ``/metrics`` latencies, memory, database size, restart after a
kill -9, and parity with the simulator). A face: it drives the control plane and the simulator, which never
import each other. Figures and commands: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import typer

from tidal.bench import cli as _bench_cli
from tidal.model import Admit, Grow, Preempt, ReturnGpus, Shrink, Tenant
from tidal.policy.loan import LoanTiming
from tidal.policy.scheduler import SchedulerConfig
from tidal.serving.sources import TraceReplay
from tidal.serving.traces import Trace
from tidal.sim.jobs import JobSpec

T0 = 1_700_000_000.0  # the plane's clock at simulated time 0
SIZES = (1, 2, 4, 8, 8, 16, 32, 64, 128, 256, 512)
TRACE = Path("../shared/traces/servegen-language-m-large.csv")  # `--traffic`'s default (next to the repo)


@dataclass(frozen=True)
class Workload:
    """Jobs (the simulator's :class:`JobSpec`), their tenants and the pool they run on."""

    jobs: tuple[JobSpec, ...]
    tenants: tuple[Tenant, ...]
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def workload(n_jobs: int, nodes: int, gpus_per_node: int, *, span_s: float = 4 * 3600.0,
             tenants: int = 8, minutes: tuple[float, float] = (10.0, 120.0), dedicated: float = 0.25,
             skew: float = 0.0, seed: int = 0) -> Workload:
    """``n_jobs`` submitted uniformly over ``span_s``: sizes 1..512 GPUs (within the pool; a size's odds
    ``size ** -skew``: 0 uniform, 0.5 mostly small jobs as in the Philly trace), durations log-uniform in
    ``minutes``, a ``dedicated`` fraction at priority 1 (fixed size), the rest spot and elastic (half to all
    of their size); each tenant's quota is an equal share of the pool."""
    rng = np.random.default_rng(seed)
    total = nodes * gpus_per_node
    sizes = [s for s in SIZES if s <= total] or [1]
    odds = np.array(sizes, float) ** -skew
    out = []
    for i, t in enumerate(np.sort(rng.uniform(0.0, span_s, n_jobs))):
        g = int(sizes[rng.integers(len(sizes))] if not skew else rng.choice(sizes, p=odds / odds.sum()))
        dur_s = 60.0 * math.exp(rng.uniform(math.log(minutes[0]), math.log(minutes[1])))
        ded = bool(rng.random() < dedicated)
        out.append(JobSpec(id=f"j{i:06d}", tenant=f"team{rng.integers(tenants)}", kind="dedicated" if ded
                           else "spot", priority=1 if ded else 0, min_gpus=g if ded else max(1, g // 2),
                           max_gpus=g, work_gpu_s=round(g * dur_s), submit_s=float(t)))
    teams = tuple(Tenant(f"team{k}", total // tenants, 1.0) for k in range(tenants))
    return Workload(tuple(out), teams, nodes, gpus_per_node)


def loan_timing(notice_s: float, step_s: float) -> LoanTiming:
    """The loans' timing for a plane stepped every ``step_s`` whose jobs answer a notice ``notice_s`` later:
    grace ``notice_s``; the final checkpoint two steps, the most the plane takes to send a notice whose time
    fell between steps and to see the exit (so that a reclaim is back by its deadline, which the
    simulator's jobs meet to the second); tear-down, warm-up and a loan's cost at their usual 60, 900 and
    300 s."""
    return LoanTiming(notice_s=notice_s, final_checkpoint_s=2 * step_s, release_s=60.0, warmup_s=900.0,
                      restart_cost_s=300.0)


@dataclass(frozen=True)
class Serving:
    """A serving pool lent to spot jobs by the Tidal policy: ``nodes`` x ``gpus_per_node`` GPUs whose demand
    follows ``trace`` (its peak = the pool), simulated time 0 at ``start_s`` seconds after the trace's first
    row (it repeats), the forecast having learned the ``history_days`` before (where the trace has them).
    ``timing`` in seconds of the simulated clock; ``budget``: the policy's shortfall budget."""

    trace: Trace
    nodes: int
    gpus_per_node: int
    timing: LoanTiming
    start_s: float = 0.0
    history_days: float = 7.0
    budget: float = 0.005

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def step_s(self) -> float:
        """The serving grid: the trace's step."""
        return self.trace.step_s

    def replay(self) -> TraceReplay:
        """The demand on the simulated clock (serving time = simulated time)."""
        return TraceReplay(self.trace, self.gpus, start_s=-self.start_s)

    def demand(self, horizon_s: float) -> np.ndarray:
        """GPUs per ``step_s`` from simulated time 0 over ``horizon_s`` and the forecast's horizon after it
        (the simulator's input), as the replay answers them."""
        r = self.replay()
        return np.array([r.demand_gpus(k * self.step_s)
                         for k in range(math.ceil((horizon_s + 2 * 86400.0) / self.step_s))])

    def history(self) -> list[tuple[float, float]]:
        """(simulated time, GPUs) on the grid over the ``history_days`` before time 0, where the trace has
        them: what the forecast learns first, in the plane and in the simulator."""
        r, step = self.replay(), self.step_s
        k0 = min(math.floor(self.history_days * 86400.0 / step), math.floor(self.start_s / step))
        return [(-k * step, r.demand_gpus(-k * step)) for k in range(k0, 0, -1)]


def serving_of(shape: str, traffic: Path, *, notice_s: float, step_s: float, days: float = 7.0) -> Serving:
    """``--serving NODESxGPUS --traffic FILE``: the trace's ``days`` first days are the forecast's history,
    simulated time 0 the start of the next (``ValueError`` naming what is wrong)."""
    from tidal.exec.virtual import parse_shape
    from tidal.sim.traffic import read_serving_trace

    n, g = parse_shape(shape)
    trace, _ = read_serving_trace(traffic)
    return Serving(trace, n, g, loan_timing(notice_s, step_s), start_s=days * 86400.0, history_days=days)


def check_shapes(w: Workload, serving: Serving | None) -> None:
    """``ValueError`` unless the serving nodes have as many GPUs as the training ones (the simulator's
    nodes all have ``gpus_per_node``)."""
    if serving is not None and serving.gpus_per_node != w.gpus_per_node:
        raise ValueError(f"serving nodes of {serving.gpus_per_node} GPUs: the simulator's have the training "
                         f"nodes' {w.gpus_per_node}")


def scheduler_for(notice_s: float, serving: Serving | None) -> SchedulerConfig:
    """The scheduler both sides run: preemptions' grace ``notice_s``; with lending, loans no shorter than
    the plan's shortest worthwhile one (as ``tidal up`` sets it)."""
    if serving is None:
        return SchedulerConfig(preempt_grace_s=notice_s)
    return SchedulerConfig(preempt_grace_s=notice_s, min_loan_left_s=serving.timing.min_loan_window_s)


def spec_of(j: JobSpec, interval_s: float) -> dict[str, Any]:
    """The job spec (as submitted to the API) of a workload's job, its work in the virtual executor's env."""
    from tidal.exec.virtual import WORK_ENV

    return {"name": j.id, "command": ["virtual"], "kind": j.kind, "priority": j.priority,
            "gpus": {"min": j.min_gpus, "max": j.max_gpus}, "env": {WORK_ENV: f"{j.work_gpu_s:g}"},
            "checkpoint": {"interval_s": interval_s}}


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def run_plane(w: Workload, horizon_s: float, *, step_s: float = 10.0, notice_s: float = 30.0,
              interval_s: float = 600.0, db_url: str | None = None, state_dir: Path | None = None,
              scheduler: SchedulerConfig | None = None, t0: float = T0, serving: Serving | None = None,
              lend: bool = True) -> dict[str, Any]:
    """Step the real plane (store, controller, scheduler) over the virtual executor on a simulated clock
    (``t0`` + 0 to ``horizon_s`` every ``step_s``), submitting each job at its time. Returns the GPU-hours
    held, the decisions counted, jobs succeeded, step latencies and a check that no node was ever
    over-committed. With ``state_dir`` the database and the executor's journal stay there (a ``tidal up
    --executor virtual:NODESxGPUS --state-dir`` then adopts the jobs still running). With ``serving`` the
    executor has its nodes too and the plane lends them (:class:`~tidal.control.loans.LiveLoans` over a
    :class:`~tidal.serving.adapters.ReplayAdapter` on the simulated clock; ``lend=False``: the nodes are
    there, nothing is lent): GPU-hours lent and held on loans, reclaims, GPUs returned, and whether every
    return met its deadline."""
    from tidal.control.auth import create_tenant
    from tidal.control.config import ControlConfig
    from tidal.control.controller import Controller
    from tidal.control.loans import LiveLoans
    from tidal.control.server import HeapKeeper
    from tidal.control.spec import parse_spec
    from tidal.control.states import State
    from tidal.control.store import Store
    from tidal.exec.virtual import VirtualExecutor
    from tidal.serving.adapters import ReplayAdapter, parse_nodes

    tmp = tempfile.TemporaryDirectory() if state_dir is None else None
    root = Path(tmp.name) if tmp is not None else Path(state_dir or ".")
    store = Store(db_url or f"sqlite:///{root}/tidal.db")
    try:
        for tenant in w.tenants:
            create_tenant(store, tenant.name, quota_gpus=tenant.quota_gpus, weight=tenant.weight,
                          max_priority=1)
        loans = None
        if serving is not None:
            adapter = ReplayAdapter(serving.replay(), parse_nodes(f"{serving.nodes}x{serving.gpus_per_node}"),
                                    start_s=0.0, origin_s=t0)
            loans = LiveLoans(adapter, serving.timing, shortfall_budget=serving.budget, step_s=serving.step_s,
                              warm_history=serving.history())
        ex = VirtualExecutor(w.nodes, w.gpus_per_node, beat_s=step_s, notice_s=notice_s,
                             serving=loans.nodes if loans is not None else None,
                             journal=root / "virtual.jsonl" if tmp is None else None)
        cfg = ControlConfig(scheduler=scheduler or scheduler_for(notice_s, serving))
        # as tidal up's loop: each step also publishes the view the API's pool reads serve
        ctl = Controller(store, ex, cfg, loans=loans if lend else None, publish=True)
        specs = [parse_spec(spec_of(j, interval_s)).model_dump() for j in w.jobs]
        cap = {n.name: n.gpus for n in ex.nodes()}
        on_serving = set(loans.nodes if loans is not None else ())
        nxt, held_gpu_s, over = 0, 0.0, 0
        lent_gpu_s = on_loans_gpu_s = 0.0
        counts = {"admissions": 0, "admitted_gpus": 0, "shrinks": 0, "preemptions": 0, "grows": 0,
                  "reclaims": 0, "returned_gpus": 0}
        step_wall: list[float] = []
        heap = HeapKeeper()
        sizes: list[tuple[int, int]] = []  # (running, waiting) after each step
        for k in range(int(horizon_s // step_s) + 1):
            t = k * step_s
            if nxt < len(w.jobs) and w.jobs[nxt].submit_s <= t:
                with store.batch():  # (the step's submissions in a few transactions, not one each)
                    while nxt < len(w.jobs) and w.jobs[nxt].submit_s <= t:
                        store.submit(w.jobs[nxt].tenant, specs[nxt], t0 + t)
                        nxt += 1
            wall = time.perf_counter()
            decisions = ctl.step(t0 + t)
            step_wall.append(time.perf_counter() - wall)
            heap.after_step(t0 + t)  # between steps, as tidal up's loop
            sizes.append(ctl.view.sizes())
            for d in decisions:
                if isinstance(d, Admit):
                    counts["admissions"] += 1
                    counts["admitted_gpus"] += sum(d.placement.values())
                counts["shrinks"] += isinstance(d, Shrink)
                counts["preemptions"] += isinstance(d, Preempt)
                counts["grows"] += isinstance(d, Grow)
                counts["reclaims"] += isinstance(d, Shrink | Preempt) and d.reason == "reclaim"
                counts["returned_gpus"] += d.gpus if isinstance(d, ReturnGpus) else 0
            used = ex.used()
            if on_serving:  # a serving node holds at most what is lent there
                cap |= {n: ctl.loans.lent_on(n) if ctl.loans is not None else 0 for n in on_serving}
            over += any(g > cap.get(n, 0) for n, g in used.items())
            held_gpu_s += sum(used.values()) * step_s
            if ctl.loans is not None:
                lent_gpu_s += ctl.loans.lent * step_s
                on_loans_gpu_s += sum(g for n, g in used.items() if n in on_serving) * step_s
        by_state = store.count_by_state()
        peak = max(w for _, w in sizes)
        at_peak = [t for t, (_, w) in zip(step_wall, sizes, strict=True) if w >= 0.9 * peak]
        return {"held_gpu_hours": held_gpu_s / 3600.0, **counts, "over_committed_steps": over,
                "succeeded": by_state.get(State.SUCCEEDED.value, 0),
                "failed": by_state.get(State.FAILED.value, 0), "peak_waiting": peak,
                "peak_running": max(r for r, _ in sizes), "steps": len(step_wall),
                "step_p50_s": _pct(step_wall, 50), "step_p99_s": _pct(step_wall, 99),
                "step_max_s": max(step_wall), "steps_at_peak": len(at_peak),
                "step_p99_at_peak_s": _pct(at_peak, 99), "heap_collections": len(heap.pauses_s),
                "heap_pause_max_s": max(heap.pauses_s, default=0.0),
                **({} if loans is None else {  # (not lent: the loan step's counters as they started)
                    "lent_gpu_hours": lent_gpu_s / 3600.0, "on_loans_gpu_hours": on_loans_gpu_s / 3600.0,
                    "reclaims_met": loans.stats["reclaims_met"],
                    "reclaims_missed": loans.stats["reclaims_missed"],
                    "worst_margin_s": min(loans.margins, default=None),
                    "double_counted_steps": loans.stats["double_counted_steps"],
                    "serving_shortfall_gpu_hours": loans.stats["shortfall_gpu_s"] / 3600.0})}
    finally:
        store.close()
        ex.close()
        if tmp is not None:
            tmp.cleanup()


def run_sim(w: Workload, horizon_s: float, *, sched_period_s: float = 10.0, notice_s: float = 30.0,
            scheduler: SchedulerConfig | None = None, serving: Serving | None = None) -> dict[str, Any]:
    """The same workload through the simulator, costs that the virtual executor does not model set to zero (no
    failures, no checkpoint stall, no restart time); ``serving`` lent by the simulator's Tidal policy with
    the plane's budget, grid, timing and forecast history, and its rule of lending only what spot jobs can
    use (else no serving pool lent)."""
    from tidal.sim.config import CheckpointModel, SimConfig
    from tidal.sim.engine import Engine
    from tidal.sim.policies import PolicySpec

    check_shapes(w, serving)
    cfg = SimConfig(serving_gpus=serving.gpus if serving else 1, training_gpus=w.gpus,
                    gpus_per_node=w.gpus_per_node, days=horizon_s / 86400,
                    step_s=serving.step_s if serving else 3600.0,
                    ckpt=CheckpointModel(persist_s=0.0, stage_s=0.0, restart_s=0.0),
                    failure_rate_per_gpu_hour=0.0, sched_period_s=sched_period_s,
                    scheduler=scheduler or scheduler_for(notice_s, serving), record_timeline=False,
                    lend_to_takers=serving is not None)
    if serving is not None:
        cfg = replace(cfg, timing=serving.timing)
    if serving is None:
        eng = Engine(np.zeros(1), 3600.0, PolicySpec("none"), cfg, list(w.jobs), None, list(w.tenants))
    else:
        eng = Engine(serving.demand(horizon_s), serving.step_s, PolicySpec("tidal", serving.budget), cfg,
                     list(w.jobs), None, list(w.tenants))
        eng.pstate, _ = eng.policy.learn(eng.pstate, serving.history(), serving.gpus)
    res = eng.run()
    m = res.metrics
    out = {"held_gpu_hours": eng.meter.held_gpu_s / 3600.0, "admissions": m.get("admissions", 0),
           "shrinks": m.get("shrinks", 0), "preemptions": m.get("preemptions", 0),
           "succeeded": m.get("jobs_completed", 0)}
    if serving is not None:
        out |= {"lent_gpu_hours": eng.meter.lent_gpu_s / 3600.0,
                "on_loans_gpu_hours": eng.meter.held_on_loans_gpu_s / 3600.0,
                "reclaims": m.get("reclaims", 0),
                "returned_gpus": m.get("returned_gpus", 0),
                "serving_shortfall_gpu_hours": m.get("serving_shortfall_gpu_hours", 0.0)}
    return out


PARITY = ("held_gpu_hours", "lent_gpu_hours", "on_loans_gpu_hours", "reclaims", "returned_gpus", "shrinks",
          "preemptions", "admissions")
"""The figures :func:`parity` sets side by side (those a side has)."""


def parity(w: Workload, horizon_s: float, *, serving: Serving | None = None, **kw: Any) -> dict[str, Any]:
    """Plane and simulator side by side (the simulator's scheduler at the plane's step); ``ratio``: live /
    simulated GPU-hours held (of admitted work, on lent GPUs too); ``ratios``: live / simulated for each
    figure of :data:`PARITY` (None where the simulator's is 0)."""
    live = run_plane(w, horizon_s, serving=serving, **kw)
    sim = run_sim(w, horizon_s, sched_period_s=kw.get("step_s", 10.0), notice_s=kw.get("notice_s", 30.0),
                  scheduler=kw.get("scheduler"), serving=serving)
    ratios = ratios_of(live, sim)
    return {"live": live, "sim": sim, "ratio": ratios["held_gpu_hours"], "ratios": ratios}


def ratios_of(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, float | None]:
    """Live / simulated for each figure of :data:`PARITY` both have (None where the simulator's is 0: JSON
    has no NaN)."""
    return {k: live[k] / sim[k] if sim[k] else None for k in PARITY if k in live and k in sim}


def _timed(client: Any, method: str, path: str, **kw: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    r = client.request(method, path, **kw)
    return time.perf_counter() - t, r


def published(c: Any, timeout_s: float = 300.0) -> None:
    """Wait for the loop's first step to end: the pool then answers as of the view it published (the same
    ``as_of_s`` twice in a row), not as of each call (no view yet). On a loaded machine the first step (every
    active job read) takes seconds; a burst meeting it measures the start, not the plane at work."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        now = c.get("/v1/pool", params={"limit": 1}).json()["as_of_s"]
        if now == last:
            return
        last = now
        time.sleep(0.2)
    raise RuntimeError("the loop published no view")


def tenant_clients(admin: Any, n: int, prefix: str = "burst") -> list[Any]:
    """``n`` new tenants (``<prefix>0`` ...) made by the admin's client, and a client for each with its token:
    they submit as tenants do, through their submission limits and checkpoint location checks."""
    import httpx

    tokens = [admin.post("/v1/tenants", json={"name": f"{prefix}{i}"}).raise_for_status().json()["token"]
              for i in range(n)]
    return [httpx.Client(base_url=admin.base_url, timeout=60, headers={"Authorization": f"Bearer {t}"})
            for t in tokens]


def _db_bytes(url: str) -> int | None:
    """The size of the database at ``url`` on its server (``pg_database_size``; None: not PostgreSQL)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        if engine.dialect.name != "postgresql":
            return None
        with engine.connect() as c:
            return int(c.exec_driver_sql("SELECT pg_database_size(current_database())").scalar() or 0)
    finally:
        engine.dispose()


def _events(c: Any, after: int) -> list[dict]:
    """Every event after id ``after``, a page at a time."""
    out: list[dict] = []
    while page := c.get("/v1/events", params={"after": after, "limit": 10000}).json():
        out += page
        after = page[-1]["id"]
    return out


def _journal_twice(path: Path) -> int:
    """Jobs the virtual executor's journal shows launched while an attempt of theirs was not released."""
    open_: set[str] = set()
    twice: set[str] = set()
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d["op"] == "launch":
            (twice if d["job"] in open_ else open_).add(d["job"])
        elif d["op"] == "release":
            open_.discard(d["job"])
    return len(twice)


class _Up:
    """``tidal up --executor virtual:NODESxGPUS`` on a free loopback port, as a child process."""

    def __init__(self, state: Path, shape: str, db: str | None) -> None:
        self.state, self.shape, self.db = state, shape, db
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it; seconds until its API answers."""
        import httpx

        url_file = self.state / "api.url"
        url_file.unlink(missing_ok=True)
        t = time.perf_counter()
        with open(self.state / "up.log", "ab") as err:  # (the child has its own copy)
            proc = self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tidal.cli import main; main()", "up", "--port", "0",
                 "--executor", f"virtual:{self.shape}", "--state-dir", str(self.state),
                 *(["--db", self.db] if self.db else [])],
                stdout=subprocess.DEVNULL, stderr=err)
        while True:
            if proc.poll() is not None or time.perf_counter() - t > 600:
                raise RuntimeError(f"tidal up did not start: see {self.state / 'up.log'}")
            if url_file.exists():
                self.url = url_file.read_text().strip()
                try:
                    httpx.get(self.url + "/healthz", timeout=5).raise_for_status()
                    return time.perf_counter() - t
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)

    def rss_bytes(self) -> int:
        """The peak resident memory of the process (VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid if self.proc else 0}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


def bench_plane(nodes: str = "256x8", jobs: int = 2000, *, hours: float = 2.0, step_s: float = 60.0,
                submits: int = 2000, reads: int = 300, tenants: int = 200, skew: float = 0.5,
                db: str | None = None, state_dir: Path | None = None, serving: str | None = None,
                traffic: Path | None = None, log: Any = print) -> dict[str, Any]:
    """The live plane under load (docs/benchmarks.md, "The plane at pool scale"). Phases: ``plane``: the
    workload's ``hours`` through the real loop on a simulated clock ending now, beside the simulator
    (``sim_parity``); ``restart``: ``tidal up`` adopts what that left running; ``api``: once its loop has
    stepped, ``submits`` jobs posted by 8 clients (8 tenants: their limits and location checks), then readers
    (jobs pages, status, events, pool, ``/metrics``); ``kill9``: ``tidal
    up`` killed and restarted, every running job checked (none lost, none run twice). With ``serving``
    (``NODESxGPUS``) its nodes' demand follows ``traffic`` (default :data:`TRACE`; its first week the
    forecast's history) and both sides lend them (``lending``: live / simulated figures); the plane phase
    only (the others run ``tidal up`` on the training pool)."""
    import httpx

    from tidal.control.auth import ADMIN_TOKEN_FILE
    from tidal.exec.virtual import parse_shape

    n, g = parse_shape(nodes)
    w = workload(jobs, n, g, span_s=hours * 3600 * 0.8, tenants=tenants, skew=skew)
    horizon = hours * 3600.0
    side = serving_of(serving, traffic or TRACE, notice_s=30.0, step_s=step_s) if serving else None
    check_shapes(w, side)  # (before the plane's run, not after it)
    tmp = tempfile.TemporaryDirectory() if state_dir is None else None
    state = Path(tmp.name if tmp is not None else str(state_dir))
    out: dict[str, Any] = {"nodes": nodes, "jobs": jobs, "hours": hours, "step_s": step_s,
                           "tenants": tenants, "skew": skew, "db": db or "sqlite"}
    if side is not None:
        out |= {"serving": serving, "traffic": side.trace.name, "serving_budget": side.budget}
    try:
        log(f"plane: {jobs} jobs over {hours:g} h on {nodes}" + (f", {serving} serving lent" if side else "")
            + " (simulated clock)")
        t0 = time.time() - horizon
        live = run_plane(w, horizon, step_s=step_s, db_url=db, state_dir=state, t0=t0, serving=side)
        sim = run_sim(w, horizon, sched_period_s=step_s, serving=side)
        out["plane"] = live
        out["sim"] = sim
        ratios = ratios_of(live, sim)
        out["sim_parity"] = ratios["held_gpu_hours"]
        if side is not None:
            out["lending"] = {k: v for k, v in ratios.items() if k != "held_gpu_hours"}
        for k in ("step_p50_s", "step_p99_s", "step_p99_at_peak_s", "peak_waiting", "peak_running",
                  "heap_pause_max_s"):
            out[k] = live[k]
        log(f"plane: {json.dumps(live)}, sim_parity {out['sim_parity']}")
        if side is not None:
            return out
        up = _Up(state, nodes, db)
        log("restart: tidal up adopts the running jobs")
        out["adopt_api_s"] = up.start()
        token = (state / ADMIN_TOKEN_FILE).read_text().strip()
        c = httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        t = time.perf_counter()
        published(c)  # (the API phase measures the plane at work, not its first step after the start)
        out["first_step_s"] = time.perf_counter() - t + out["adopt_api_s"]
        log(f"api: {submits} submissions by 8 clients, each a tenant of its own, then {reads} reads of each "
            "kind")
        spec = spec_of(w.jobs[0], 600.0) | {"name": "burst", "kind": "spot", "priority": 0}  # (no quota)
        from concurrent.futures import ThreadPoolExecutor

        clients = tenant_clients(c, 8)

        def post(i: int) -> float:
            dt, r = _timed(clients[i % 8], "POST", "/v1/jobs", json=spec)
            r.raise_for_status()
            return dt

        t = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            lat = list(pool.map(post, range(submits)))
        out["submits_per_s"] = submits / (time.perf_counter() - t)
        for tc in clients:
            tc.close()
        out["submit_p50_s"], out["submit_p99_s"] = _pct(lat, 50), _pct(lat, 99)
        log(f"api: {out['submits_per_s']:.0f} submits/s, p99 {out['submit_p99_s']:.3f} s")
        ids = [j["id"] for j in c.get("/v1/dashboard/jobs", params={"limit": 100}).json()["jobs"]]
        kinds = {"jobs_page": lambda i: ("/v1/dashboard/jobs", {"limit": 50, "offset": 50 * (i % 20)}),
                 "status": lambda i: (f"/v1/jobs/{ids[i % len(ids)]}", None),
                 "events": lambda i: ("/v1/events", {"job": ids[i % len(ids)]}),
                 "pool": lambda i: ("/v1/pool", None),
                 "dashboard_pool": lambda i: ("/v1/dashboard/pool", None)}
        every: list[float] = []
        for name, make in kinds.items():
            xs, late = [], 0
            for i in range(reads):
                path, params = make(i)
                try:
                    dt, r = _timed(c, "GET", path, params=params)
                    r.raise_for_status()
                except httpx.TimeoutException:  # (counted, at the client's timeout)
                    dt, late = 60.0, late + 1
                xs.append(dt)
            out[f"{name}_p99_s"], out[f"{name}_timeouts"] = _pct(xs, 99), late
            log(f"api: {name} p99 {out[f'{name}_p99_s']:.3f} s, {late} timed out (60 s)")
            every += xs
        out["read_p99_s"] = _pct(every, 99)
        ms = []
        for _ in range(max(5, reads // 20)):
            dt, r = _timed(c, "GET", "/metrics")
            ms.append(dt)
        out["metrics_p99_s"], out["metrics_bytes"] = _pct(ms, 99), len(r.content)
        out["rss_max_bytes"] = up.rss_bytes()
        mark = _events(c, 0)[-1]["id"]  # (before the running jobs are listed: their ends since are after it)
        running: set[str] = set()
        while page := c.get("/v1/jobs", params={"state": "running", "offset": len(running)}).json():
            running |= {j["id"] for j in page}
        log(f"kill9: {len(running)} running jobs, tidal up killed and restarted")
        up.kill()
        out["restart_api_s"] = up.start()  # (it re-adopts before its API answers)
        c = httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        after = _events(c, mark)
        adopted = {e["job"] for e in after if e["kind"] == "adopted"}
        # a job listed running that ended by itself before the kill (between the listing and the kill) was
        # not the plane's to adopt: its end is an event stored before the restart's first adoption
        first = next((e["id"] for e in after if e["kind"] == "adopted"), math.inf)
        ended = {e["job"] for e in after if e["kind"] == "transition" and e["id"] < first
                 and e["to"] in ("succeeded", "failed", "cancelled")} - adopted
        # one recorded as started whose ranks the kill came before (its launch not in the executor's journal)
        # is requeued, to start once: none of its work ran, none is lost
        unlaunched = {e["job"] for e in after if e["kind"] == "transition" and e["id"] < first
                      and (e["data"] or {}).get("launched") is False}
        out["jobs_running_at_kill"] = len(running - ended - unlaunched)
        out["jobs_ended_before_kill"] = len(running & ended)
        out["jobs_unlaunched_at_kill"] = len(running & unlaunched)
        out["jobs_lost"] = len(running - adopted - ended - unlaunched)
        for jid in sorted(running - adopted - ended - unlaunched)[:5]:  # (what happened to them, for the log)
            log(f"kill9: {jid} not adopted: " + "; ".join(
                f"{e['kind']} {e['from'] or ''}->{e['to'] or ''} {e['message'][:80]}" for e in after
                if e["job"] == jid))
        out["jobs_run_twice"] = _journal_twice(state / "virtual.jsonl")
        up.kill()
        out["db_bytes"] = (sum(p.stat().st_size for p in state.glob("tidal.db*")) if db is None
                           else _db_bytes(db))
        return out
    finally:
        if "up" in locals():
            up.kill()
        if tmp is not None:
            tmp.cleanup()


def plane_command(
    nodes: str = typer.Option("256x8", help="the virtual pool, NODESxGPUS"),
    jobs: int = typer.Option(2000, min=1, help="jobs of the workload (sizes 1-512 GPUs, 25 % dedicated)"),
    hours: float = typer.Option(2.0, min=0.01, help="simulated hours the jobs are submitted over (x 0.8)"),
    step_s: float = typer.Option(60.0, min=1.0, help="seconds of the simulated clock per reconcile step"),
    submits: int = typer.Option(2000, min=1, help="jobs posted to the API after the simulated hours"),
    reads: int = typer.Option(300, min=1, help="reads of each kind (jobs page, status, events, pool)"),
    tenants: int = typer.Option(200, min=1, help="tenants, each with an equal share of the pool as quota"),
    skew: float = typer.Option(0.5, min=0.0, help="a job size's odds: size ** -skew (0: sizes uniform)"),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default: SQLite in a temporary state dir)"),
    serving: str | None = typer.Option(None, help="serving nodes NODESxGPUS (GPUs as the training nodes') "
                                       "lent by the Tidal policy in the plane and the simulator (the plane "
                                       "phase only)"),
    traffic: Path | None = typer.Option(None, help="their demand: a serving trace CSV, its first week the "
                                        f"forecast's history (default {TRACE})"),
    json_out: bool = typer.Option(False, "--json", help="the figures as JSON on stdout"),
) -> None:
    """The live plane at pool scale over the virtual executor: step, submit, read and /metrics latencies,
    memory, database size, restart after kill -9, parity with the simulator (with --serving: of lending
    and reclaims too)."""
    try:
        res = bench_plane(nodes, jobs, hours=hours, step_s=step_s, submits=submits, reads=reads,
                          tenants=tenants, skew=skew, db=db, serving=serving, traffic=traffic,
                          log=lambda m: print(m, file=sys.stderr))
    except (ValueError, RuntimeError, OSError) as e:
        raise SystemExit(f"tidal bench plane: {e}") from None
    if json_out:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:>20}  {v:.4g}" if isinstance(v, float) else f"{k:>20}  {v}")


bench_app = _bench_cli.app  # `tidal bench`: the operator's benchmarks and `plane` (a face: above both planes)
bench_app.command("plane")(plane_command)

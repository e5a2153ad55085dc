"""``tidal demo ray --cycle [--serve]``: the day of ``tidal demo cycle`` on a local 4-node Ray cluster, a
training node lost in the night while the other nodes' agents hold the job's newest step (docs/control.md,
the Ray executor)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tidal.control.client import TidalClient
from tidal.control.loans import build_live_loans
from tidal.demo import serve_traffic as st
from tidal.demo.cycle import NARRATED, CycleOptions, _hhmm, _summary, play_day, print_summary, with_simulator
from tidal.demo.cycle import job_spec as cycle_job_spec
from tidal.demo.node_loss import kill_when_peer_newest, worth_a_look
from tidal.demo.options import example_script
from tidal.demo.plane import PLANE_CONFIG, DemoError, EmbeddedPlane, uninterrupted
from tidal.demo.ray_cluster import LocalRayCluster, stdout_to_stderr

TRAINING = {"train-0": 1, "train-1": 1}
SERVING_NODES = "2x8"  # serve-0 and serve-1, 8 declared GPUs each (parse_nodes names them)
DISK_EVERY = 3  # every 3rd save also goes to disk; the peer tier holds every one
TENANT = "research"
BACK_AFTER_S = 60.0
SPEEDUP = 360.0  # the day's default speed-up (serving seconds per second)
SERVE_SPEEDUP = 180.0  # ... with --serve: two restarts of 20-40 s on two busy cores must fit in the night
LATE_S = 4 * 3600.0  # serving seconds after the kill hour from which any moment (any checkpoint) will do


def options(speedup: float, hours: float, start_hour: float, jobs: int, max_ranks: int) -> CycleOptions:
    """The day's options (the defaults are ``tidal demo ray``'s); the serving nodes are the Ray cluster's."""
    return CycleOptions(speedup=speedup, hours=hours, start_hour=start_hour, jobs=jobs, max_ranks=max_ranks,
                        serving_nodes=SERVING_NODES)


def job_spec(opts: CycleOptions, script: Path, ckpt_dir: Path, i: int) -> dict[str, Any]:
    """The single-machine cycle's job, checkpointing to the agents' memory and, every ``DISK_EVERY``
    saves, to ``ckpt_dir`` (a job across nodes has no node-memory tier)."""
    return {**cycle_job_spec(opts, script, None, i),
            "checkpoint": {"tiers": ["peer", {"url": str(ckpt_dir), "every": DISK_EVERY}]}}


@dataclasses.dataclass
class NodeLoss:
    """The night's node loss as it happens."""

    at_s: float  # serving time to kill at
    node: str | None = None
    job: str | None = None
    killed_s: float | None = None
    placement: dict[str, int] | None = None
    lost: dict | None = None  # the node_lost event
    recovered: dict | None = None  # the recovered event
    back: bool = False
    killer: threading.Thread | None = None  # freezes the node, looks at the tiers, kills it or not
    tiers: dict | None = None  # the job's newest committed step per tier when the node was killed
    step: int | None = None  # the job's step as last reported before the kill
    forced: bool = False  # killed at any moment (LATE_S passed without one the agents held the newest)
    announced: bool = False
    looked: int | None = None  # the job's newest peer step (as it reported it) at the last look
    looks: int = 0  # times the node was frozen for a look

    def bring_back(self, now_s: float) -> bool:
        """The node returns once the job trains again (or a minute after the loss was noticed)."""
        if self.back or self.node is None or self.lost is None or (self.killer and self.killer.is_alive()):
            return False
        return self.recovered is not None or now_s - self.lost["time_s"] > BACK_AFTER_S

    def pick(self, jobs: list[dict], serving_s: float) -> tuple[str, dict] | None:
        """A running job spanning nodes, one a training node, whose attempt has committed a step to the peer
        tier (after ``LATE_S``: to any tier). The attempt's own commit, not the job's newest checkpoint: a
        new attempt killed before it commits restores from the one before, not from the peer tier."""
        late = serving_s >= self.at_s + LATE_S
        for j in jobs:
            pl = j.get("placement") or {}
            tiers = (j.get("progress") or {}).get("tiers") or {}
            if (j["state"] == "running" and len(pl) > 1 and any(n in TRAINING for n in pl)
                    and (tiers.get("peer") or (late and tiers))):
                return next(n for n in sorted(pl) if n in TRAINING), j
        return None

    def announcement(self) -> str:
        forced = " (forced: no moment found with the newest step in the other nodes' agents)"
        return (f"[bold red]ray cycle[/bold red] killed node {self.node} (every process on it at once; "
                f"its node memory deleted): {self.job} ran on {self.placement}, step {self.step}; newest "
                f"step per tier then: {self.tiers}{forced if self.forced else ''}")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "job": self.job, "placement": self.placement,
                               "tiers": self.tiers,
                               "forced": self.forced, "looks": self.looks, "detected": self.lost is not None,
                               "recovered": self.recovered is not None}
        if self.lost is not None and self.killed_s is not None:
            out["detection_s"] = round(self.lost["time_s"] - self.killed_s, 3)
            out["ckpt_step_at_loss"] = (self.lost.get("data") or {}).get("ckpt_step")
        if self.recovered is not None:
            d = self.recovered.get("data") or {}
            out.update(recovery_s=round(d.get("recovery_s", 0.0), 3), restore_tier=d.get("restore_tier"),
                       restored_step=d.get("start_step"), steps_redone=d.get("lost_steps"),
                       world_size=d.get("world_size"), was_world_size=d.get("was_world_size"))
        return out


def run(opts: CycleOptions, kill_hour: float, console: Console, *, keep: bool = False,
        serve: bool = False) -> dict[str, Any]:
    opts.check()
    if not 0 <= kill_hour < 24:
        raise DemoError(f"--kill-hour {kill_hour:g}: expected 0 to 24")
    loss = NodeLoss(opts.start_s + ((kill_hour - opts.start_hour) % 24) * 3600.0)
    if loss.at_s >= opts.start_s + opts.hours * 3600.0:
        raise DemoError(f"--kill-hour {kill_hour:g} is not within the {opts.hours:g} h replayed from "
                        f"{opts.start_hour:g}:00")
    script = example_script()
    sdir = Path(tempfile.mkdtemp(prefix="tidal-ray-cycle-"))
    traffic: st.Traffic | None = None
    warm: st.Traffic | None = None
    if serve:  # Ray Serve replicas serving generated traffic (tidal.demo.serve_traffic)
        from tidal.net import free_port

        rate_trace = st.write_rate_trace(opts, sdir / "requests.csv")
        serving = st.serving_config(opts, rate_trace, free_port())
    else:
        serving = opts.serving()  # the plane's serving: block; its adapter is built from it (control.loans)
    cfg = dataclasses.replace(PLANE_CONFIG, serving=serving)
    try:
        build_live_loans(serving)  # what tidal up would refuse, said before a cluster starts
    except (ValueError, OSError) as e:
        shutil.rmtree(sdir, ignore_errors=True)
        raise DemoError(f"serving: {e}") from None
    nodes = {**TRAINING, **serving_nodes(serving)}
    say = _narrator(console)
    say("starting a Ray cluster on this machine: "
        + ", ".join(f"{n} ({g} GPU{'s' if g > 1 else ''})" for n, g in nodes.items()))
    try:
        cluster = LocalRayCluster(nodes)
    except BaseException:  # e.g. a node timed out starting on a busy machine: no state dir left behind
        shutil.rmtree(sdir, ignore_errors=True)
        raise
    plane: EmbeddedPlane | None = None
    try:
        plane = EmbeddedPlane(sdir / "state", "auto", cfg, executor="ray", ckpt_agents=True,
                              ray_address=cluster.cluster.address)
        if serve:
            say(f"deploying Ray Serve application {st.APP} on {', '.join(serving_nodes(serving))} "
                f"({serving.describe()})")
            say(f"every replica healthy after {st.deploy(serving):.0f} s")
            # traffic before the plane's first step (an idle router reads as no demand: everything lent)
            warm = st.Traffic(f"http://127.0.0.1:{serving.http_port}/",
                              st.trace_rate(sdir / "requests.csv", opts.start_s, 1e-9), 600.0)
            warm.start()
        url = plane.start()
        if warm is not None:
            traffic = _start_traffic(plane, serving, sdir / "requests.csv", opts, say)
            warm.stop()
        say(f"control plane up at {url} ({plane.plane.describe})")
        admin = TidalClient(url, plane.admin_token)
        client = TidalClient(url, admin.create_tenant(TENANT)["token"])
        homes = {}  # job -> its disk tier
        for i in range(opts.jobs):
            home = plane.state_dir / "tenants" / TENANT / f"spot-{i}"
            homes[client.submit(job_spec(opts, script, home, i))["id"]] = home
        t0 = time.monotonic()
        reclaim_s: float | None = None  # traffic seconds of the first reclaim notice
        ready_s: float | None = None  # ... and of serving ready again after the newest return

        def extra() -> tuple[tuple[str, str], ...]:
            if loss.node is None:
                return (("node loss", f"at {_hhmm(loss.at_s)}"),)
            what = f"{loss.node} killed ({loss.job})"
            if loss.lost is not None and loss.killed_s is not None:
                what += f"; noticed in {loss.lost['time_s'] - loss.killed_s:.1f} s"
            if loss.recovered is not None:
                d = loss.recovered["data"]
                what += f"; training again {d['recovery_s']:.1f} s later from tier {d['restore_tier']}"
            return (("node loss", what),)

        def on_poll(s: dict, jobs: list[dict], events: list[dict]) -> None:
            nonlocal reclaim_s, ready_s
            for ev in events:
                if ev["kind"] == "node_lost" and ev.get("job") == loss.job and loss.lost is None:
                    loss.lost = ev
                if ev["kind"] == "recovered" and ev.get("job") == loss.job and loss.recovered is None:
                    loss.recovered = ev
                if traffic is not None and ev["kind"] == "reclaim" and reclaim_s is None:
                    reclaim_s = traffic.at(ev["time_s"])
                if traffic is not None and ev["kind"] == "serving_ready" and reclaim_s is not None:
                    ready_s = traffic.at(ev["time_s"])
            trying = loss.killer is not None and loss.killer.is_alive()
            if loss.node is None and not trying and (s.get("serving_time_s") or 0) >= loss.at_s:
                _kill(loss, jobs, s["serving_time_s"], cluster, plane, homes)
            if loss.node is not None and not loss.announced:
                loss.announced = True
                console.print(loss.announcement(), highlight=False)
            if loss.node is not None and loss.bring_back(time.time()):  # (bring_back: a node was lost)
                cluster.add(loss.node)
                loss.back = True
                say(f"node {loss.node} comes back")

        kinds = NARRATED | {"node_lost", "recovered", "node", "serving_ready", "serving_history"}
        s, jobs, checks = play_day(opts, console, client, admin, list(homes), "tidal demo ray --cycle", kinds,
                                   on_poll, extra)
        summary = _summary(opts, s, jobs, admin, checks, time.monotonic() - t0)
        summary["nodes"] = nodes
        summary["node_loss"] = nl = loss.summary()
        summary["ok"] = bool(summary["ok"] and nl["detected"] and nl["recovered"])
        demand = None
        if traffic is not None:
            traffic.stop()
            summary["serve"] = sv = _serve_summary(traffic, warm, serving, s, reclaim_s, ready_s)
            summary["ok"] = bool(summary["ok"] and sv["ok"])
            demand = _trace_gpus(serving)
        return with_simulator(summary, opts, console, sum(TRAINING.values()), demand)
    finally:
        with uninterrupted():  # a second Ctrl-C must not cut the clean-up short
            for t in (warm, traffic):
                if t is not None:
                    t.stop(10.0)
            if serve:
                _serve_shutdown()
            shm = None
            if plane is not None:
                shm = getattr(plane.plane.executor, "shm_root", None)
                plane.stop()
            from tidal.exec.ray_exec import kill_ranks

            kill_ranks(sdir / "state" / "jobs")
            cluster.shutdown()
            if shm is not None:
                shutil.rmtree(shm, ignore_errors=True)
            if not keep:
                shutil.rmtree(sdir, ignore_errors=True)
            else:
                console.print(f"state kept in {sdir}")


def _narrator(console: Console) -> Callable[[str], None]:
    def say(msg: str) -> None:
        console.print(f"[bold cyan]ray cycle[/bold cyan] {msg}", highlight=False)
    return say


def _start_traffic(plane: EmbeddedPlane, serving: Any, rate_trace: Path, opts: CycleOptions,
                   say: Callable[[str], None]) -> st.Traffic:
    """The load generator at the trace's rate from the serving clock's time now (the adapter's)."""
    from tidal.serving.ray_serve import RayServeAdapter

    loans = plane.plane.controller.loans
    adapter = loans.adapter if loans is not None else None
    if not isinstance(adapter, RayServeAdapter):
        raise DemoError(f"the plane lends through {type(adapter).__name__}, not Ray Serve")
    deadline = time.monotonic() + 60.0
    while adapter.origin_s is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if adapter.origin_s is None:
        raise DemoError("the plane took no loan step within 60 s: the serving clock has not started")
    now_serving = adapter.serving_time(time.time())
    url = f"http://127.0.0.1:{serving.http_port}/"
    traffic = st.Traffic(url, st.trace_rate(rate_trace, now_serving, opts.speedup), opts.wall_s + 60.0)
    traffic.start()
    say(f"traffic to {url}: Poisson at the trace's rate from {_hhmm(now_serving)} at {opts.speedup:g}x "
        f"({traffic.rate(0.0):.1f} requests/s now)")
    return traffic


def _serve_summary(traffic: st.Traffic, warm: st.Traffic | None, serving: Any, s: dict,
                   reclaim_s: float | None, ready_s: float | None) -> dict[str, Any]:
    ph = traffic.phases(reclaim_s, ready_s)
    total = ph["total"]
    first = warm.phases(None, None)["total"] if warm is not None else None  # until the first step
    ok = traffic.error is None and total["requests"] > 0 and total["failed"] == 0
    ok = ok and (warm is None or first is None or (warm.error is None and first["failed"] == 0))
    return {"ok": ok, "error": traffic.error or (warm.error if warm else None), "latency": ph,
            "until_the_first_step": first, "reclaim_at_s": reclaim_s, "ready_again_at_s": ready_s,
            "slo": f"p99 queue wait <= {serving.latency_target_s:g} s", "service_s": st.SERVICE_S,
            "gpus_per_replica": serving.gpus_per_replica, "adapter": (s.get("adapter") or {})}


def _trace_gpus(serving: Any) -> Any:
    """The rate trace's demand in GPUs through the adapter's request model (the simulator's demand)."""
    import numpy as np

    from tidal.serving.ray_serve import RayServeSettings
    from tidal.serving.traces import load_trace

    model = RayServeSettings.from_config(serving).model(serving.service_rate_per_replica)
    return np.minimum(load_trace(serving.trace).request_demand_gpus(model), float(serving.serving_gpus))


def _serve_shutdown() -> None:
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # noqa: BLE001 (the cluster goes next anyway)
        pass


def serving_nodes(serving: Any) -> dict[str, int]:
    from tidal.serving.adapters import parse_nodes

    return parse_nodes(serving.nodes)


def _kill(loss: NodeLoss, jobs: list[dict], serving_s: float, cluster: LocalRayCluster, plane: EmbeddedPlane,
          homes: dict[str, Path]) -> None:
    """On a thread, kill the training node of a job that qualifies (:meth:`NodeLoss.pick`) as a machine
    dies, when the other agents hold its newest step (after ``LATE_S``: any time); delete its node memory."""
    got = loss.pick(jobs, serving_s)
    if got is None:
        return  # asked again at the next poll
    node, j = got
    force = serving_s >= loss.at_s + LATE_S
    peer = worth_a_look((j.get("progress") or {}).get("tiers") or {}, loss.looked, strict=False)
    if peer is None and not force:
        return
    loss.looked, loss.looks = peer, loss.looks + 1
    from tidal.exec.ray_exec import RayExecutor

    ex = plane.plane.executor
    assert isinstance(ex, RayExecutor)  # the plane of this demo runs on Ray
    addresses = ex.agents.addresses if ex.agents is not None else {}
    agents = [a for n, a in sorted(addresses.items()) if n != node]

    def kill() -> None:
        frozen_s = time.time()
        held = kill_when_peer_newest(cluster.cluster, cluster.nodes[node], str(homes[j["id"]]), agents,
                                     force=force, strict=False,
                                     token=ex.agents.agent_token if ex.agents is not None else None)
        if held is None:
            return
        cluster.nodes.pop(node)
        loss.killed_s, loss.forced = frozen_s, force  # nothing ran on the node after it was frozen
        loss.tiers = {k: v.committed for k, v in held.items()}
        loss.step = (j.get("progress") or {}).get("step")
        loss.node, loss.job, loss.placement = node, j["id"], dict(j["placement"])
        if ex.shm_root is not None:
            shutil.rmtree(ex.shm_root / node, ignore_errors=True)

    loss.killer = threading.Thread(target=kill, name="tidal-demo-kill", daemon=True)
    loss.killer.start()


def print_node_loss(console: Console, out: dict) -> None:
    nl = out["node_loss"]
    if nl["node"] is None:
        console.print("[red]no node was killed: no job ran across nodes with a peer checkpoint at the kill "
                      "hour[/red]")
        return
    line = f"node {nl['node']} lost ({nl['job']} on {nl['placement']}): "
    seen = nl.get("detection_s")
    line += f"noticed in [bold]{seen:.2f} s[/bold]" if seen is not None else "NOT noticed"
    if nl["recovered"]:
        line += (f", training again [bold]{nl['recovery_s']:.2f} s[/bold] later on {nl['world_size']} ranks "
                 f"(were {nl['was_world_size']}) from step {nl['restored_step']} (tier "
                 f"{nl['restore_tier']}), {nl['steps_redone']} steps redone")
    else:
        line += ", NOT recovered"
    console.print(line, highlight=False)


def print_serve(console: Console, sv: dict) -> None:
    from rich.table import Table

    t = Table(title=f"Ray Serve latency (toy model {sv['service_s']:g} s per request; SLO {sv['slo']})")
    for c in ("phase", "requests", "failed", "p50", "p99", "max"):
        t.add_column(c, justify="right" if c != "phase" else "left")
    names = {"before": "before the reclaims", "during": "reclaims until serving again", "after": "after",
             "total": "the whole day"}
    for k, label in names.items():
        v = sv["latency"][k]
        ms = (lambda x: "-" if x is None else f"{1000 * x:.0f} ms")  # noqa: E731
        t.add_row(label, str(v["requests"]), str(v["failed"]), ms(v["p50_s"]), ms(v["p99_s"]), ms(v["max_s"]))
    console.print(t)
    if sv["error"] or sv["latency"]["total"]["failed"]:
        why = sv["error"] or sv["latency"]["total"]["errors"]
        console.print(f"[red]traffic: {why}[/red]", highlight=False)


def main(speedup: float, hours: float, start_hour: float, kill_hour: float, jobs: int, max_ranks: int,
         keep: bool, json_out: bool, serve: bool = False) -> int:
    """The ``--cycle`` variant of ``tidal demo ray``; the exit code."""
    import json

    console = Console(stderr=json_out)
    try:
        with stdout_to_stderr(json_out):  # Ray prints a killed raylet's last log lines on stdout
            out = run(options(speedup, hours, start_hour, jobs, max_ranks), kill_hour, console, keep=keep,
                      serve=serve)
    except DemoError as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    if json_out:
        print(json.dumps(out, indent=1))
    else:
        print_summary(console, out)
        print_node_loss(console, out)
        if "serve" in out:
            print_serve(console, out["serve"])
    return 0 if out["ok"] else 1


__all__ = ["NodeLoss", "job_spec", "main", "options", "run"]

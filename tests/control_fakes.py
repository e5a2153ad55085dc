"""Fakes at our own seams for the control plane's tests: a clock and an executor. Kept in one place.

``FakeExecutor`` implements :class:`tidal.exec.protocol.Executor` without processes: the test says
when ranks exit (``exit``), beat (``beat``) and checkpoint (``progress``), and reads what the
controller asked for in ``calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tidal.control.auth import create_tenant
from tidal.control.spec import parse_spec
from tidal.control.store import Store
from tidal.exec.progress import Progress
from tidal.exec.protocol import LaunchRequest, Observation, RankState
from tidal.model import Node


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


@dataclass
class FakeJob:
    req: LaunchRequest
    launched_s: float
    codes: list[int | None]
    vanished: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # ranks whose runtime closed cleanly before exiting
    lost: set[int] = field(default_factory=set)  # ranks that went with their node
    progress: Progress = field(default_factory=Progress)


class FakeExecutor:
    def __init__(self, gpus: int = 4, node: str = "n0", serving: dict[str, int] | None = None,
                 more: dict[str, int] | None = None) -> None:
        self.node = node
        self.gpus = gpus
        self.more = dict(more or {})  # more training nodes (a cluster: see lose_node)
        self.serving = dict(serving or {})
        self.jobs: dict[str, FakeJob] = {}
        self.calls: list[tuple] = []
        self.survivors: dict[str, FakeJob] = {}  # what adopt() finds after a "restart"
        self.fail_launch: str | None = None

    # -- the protocol --------------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        return [
            *([Node(self.node, self.gpus)] if self.gpus else []),
            *(Node(n, g) for n, g in self.more.items()),
            *(Node(n, g, "serving") for n, g in self.serving.items()),
        ]

    def launch(self, req: LaunchRequest, now_s: float) -> dict:
        self.calls.append(("launch", req.job_id, req.attempt, req.world_size))
        if self.fail_launch:
            raise RuntimeError(self.fail_launch)
        assert req.job_id not in self.jobs, f"{req.job_id} launched twice"
        self.jobs[req.job_id] = FakeJob(req, now_s, [None] * req.world_size)
        return {"pids": [1000 + r for r in range(req.world_size)]}

    def signal_stop(self, job_id: str, ranks=None) -> None:
        self.calls.append(("stop", job_id))

    def kill(self, job_id: str) -> None:
        self.calls.append(("kill", job_id))
        j = self.jobs[job_id]
        j.codes = [-9 if c is None and r not in j.vanished else c for r, c in enumerate(j.codes)]

    def configure(self, job_id: str, settings) -> None:
        self.calls.append(("configure", job_id, dict(settings)))

    def observe(self, now_s: float) -> dict[str, Observation]:
        return {k: Observation(k, j.req.attempt, j.launched_s,
                               tuple(RankState(r, 1000 + r, c, r in j.vanished, r in j.ended, r in j.lost,
                                               self.rank_node(j, r))
                                     for r, c in enumerate(j.codes)),
                               j.progress) for k, j in self.jobs.items()}

    def adopt(self, job_id: str, attempt: int, now_s: float) -> bool:
        self.calls.append(("adopt", job_id, attempt))
        j = self.survivors.pop(job_id, None)
        if j is None:
            return False
        self.jobs[job_id] = j
        return True

    def release(self, job_id: str) -> None:
        self.calls.append(("release", job_id))
        self.jobs.pop(job_id, None)

    def release_unadopted(self) -> list[str]:
        gone, self.survivors = sorted(self.survivors), {}
        for job_id in gone:
            self.calls.append(("release", job_id))
        return gone

    def log_path(self, job_id: str, rank: int) -> str | None:
        return None

    # -- what tests do -------------------------------------------------------------------------------
    def exit(self, job_id: str, *codes: int | None) -> None:
        """Ranks exit with these codes (``None``: keeps running); one code for all ranks if one is given."""
        j = self.jobs[job_id]
        j.codes = list(codes) * len(j.codes) if len(codes) == 1 else list(codes)

    def beat(self, job_id: str, t: float, step: int, *, step_time_s: float = 1.0, **kw) -> None:
        j = self.jobs[job_id]
        p = j.progress
        j.progress = replace(
            p,
            step=step,
            step_s=t,
            heartbeat_s=t,
            heartbeats=len(j.codes),
            step_time_s=step_time_s,
            start_step=p.start_step if p.start_step is not None else 0,
            first_step=p.first_step if p.first_step is not None else step,
            first_step_s=p.first_step_s if p.first_step_s is not None else t,
            phase="training",
            **kw,
        )

    @staticmethod
    def rank_node(j: FakeJob, rank: int) -> str:
        """Ranks are numbered in placement order (as the Ray executor does)."""
        nodes = [n for n, k in j.req.placement.items() for _ in range(k)]
        return nodes[rank]

    def lose_node(self, node: str) -> None:
        """The node leaves the cluster: its ranks vanish with it (``lost``)."""
        if node == self.node:
            self.gpus = 0
        self.more.pop(node, None)
        self.serving.pop(node, None)
        for j in self.jobs.values():
            for r in range(len(j.codes)):
                if self.rank_node(j, r) == node and j.codes[r] is None:
                    j.vanished.add(r)
                    j.lost.add(r)

    def launches(self, job_id: str | None = None) -> list[tuple]:
        return [c for c in self.calls if c[0] == "launch" and (job_id is None or c[1] == job_id)]


def submit(store: Store, tenant: str, now_s: float, **spec) -> str:
    spec.setdefault("command", ["python", "train.py"])
    spec.setdefault("gpus", 1)
    return store.submit(tenant, parse_spec(spec).model_dump(), now_s).id


def new_store(tmp_path, *tenants: tuple[str, int, float]) -> Store:
    store = Store(f"sqlite:///{tmp_path}/tidal.db")
    for name, quota, weight in tenants:
        create_tenant(store, name, quota_gpus=quota, weight=weight)
    return store

"""The virtual executor: fake nodes and ranks with no process per rank (``tidal up --executor
virtual:NODESxGPUS``), for loading the real plane at pool scale and comparing it with the simulator.

Towards the plane an attempt behaves like a real one (docs/control.md, "The virtual executor"): its ranks
start at launch and beat every ``beat_s``; the job trains one GPU-second of work per GPU per second (a
step is one GPU-second, as the simulator counts work); a checkpoint commits every
``TIDAL_CKPT_INTERVAL_S`` of training; it exits 0 once ``TIDAL_VIRTUAL_WORK_GPU_S`` (its env; absent:
it trains until stopped) is done, answers a notice ``notice_s`` later with a checkpoint and exit 75,
exits -9 when killed, and loses the ranks of a node lost on command (:meth:`VirtualExecutor.lose_node`).
A job resumes from its newest committed checkpoint, which the executor keeps as storage would.

An attempt's state is a function of its launch, the signals sent to it and ``now_s``. With ``journal`` each
of those is appended to that file, so a plane restarted (kill -9 included) adopts its attempts and finds them
where time has taken them. Observations are cached per beat: a step costs what changed, not every rank.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tidal.contract import ENV_CKPT_INTERVAL_S, EXIT_PREEMPTED
from tidal.exec.progress import Progress
from tidal.exec.protocol import LaunchError, LaunchRequest, Observation, RankState, check_ranks
from tidal.files import write_atomic
from tidal.model import Node

WORK_ENV = "TIDAL_VIRTUAL_WORK_GPU_S"  # a job's work in GPU-seconds (its spec's env)
DEFAULT_INTERVAL_S = 600.0  # checkpoint interval of an attempt launched without one


def parse_shape(text: str) -> tuple[int, int]:
    """``"256x8"`` -> (256 nodes, 8 GPUs each); ``ValueError`` saying the form otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"virtual executor: expected NODESxGPUS such as 256x8, got {text!r}")
    return int(m[1]), int(m[2])


@dataclass
class _Attempt:
    job_id: str
    attempt: int
    placement: dict[str, int]
    launch_s: float
    start_work: float  # GPU-seconds done at launch (the checkpoint it resumed)
    work: float  # GPU-seconds the job needs in all (inf: until stopped)
    interval_s: float
    anchor_s: float  # checkpoints commit at anchor_s + k * interval_s (moved by configure)
    stop_s: float | None = None
    kill_s: float | None = None
    lost: dict[int, float] = field(default_factory=dict)  # rank -> when its node was lost
    cache: tuple[Any, Observation] | None = None
    ranks: tuple[Any, tuple[RankState, ...]] | None = None  # ((exit code, ranks lost), the ranks then)

    world: int = field(init=False)  # ranks (the placement's GPUs: an attempt keeps its placement)

    def __post_init__(self) -> None:
        self.world = sum(self.placement.values())

    def rank_nodes(self) -> list[str]:
        return [n for n, k in self.placement.items() for _ in range(k)]

    def end(self, notice_s: float) -> tuple[float, int | None]:
        """(when training stops, the exit code of the ranks then; None: not yet known: it trains on)."""
        ends = [(self.launch_s + (self.work - self.start_work) / self.world, 0)]
        if self.stop_s is not None:
            ends.append((self.stop_s + notice_s, EXIT_PREEMPTED))
        if self.kill_s is not None:
            ends.append((self.kill_s, -9))
        t, code = min(ends)
        if self.lost and min(self.lost.values()) < t:  # the others wait on the lost ranks
            return min(self.lost.values()), code if self.kill_s is not None else None
        return (t, code) if math.isfinite(t) else (math.inf, None)

    def done(self, t: float) -> float:
        return self.start_work + self.world * max(0.0, t - self.launch_s)

    def last_ckpt(self, t: float, notice_s: float,
                  end: tuple[float, int | None] | None = None) -> tuple[float, float | None]:
        """(work committed, when) as of ``t``: periodic checkpoints, and the final one of a notice or of
        the end of the work; ``end``: :meth:`end`'s answer, when the caller has it."""
        stop, code = end or self.end(notice_s)
        upto = min(t, stop)
        k = math.floor((upto - self.anchor_s) / self.interval_s) if upto >= self.anchor_s else 0
        at = self.anchor_s + k * self.interval_s if k >= 1 else None
        if code in (0, EXIT_PREEMPTED) and t >= stop:
            at = stop
        return (self.done(at), at) if at is not None else (self.start_work, None)


class VirtualExecutor:
    """Implements :class:`tidal.exec.protocol.Executor` (see the module docstring). ``beat_s``: how often
    ranks report; ``notice_s``: how long a notice takes to be honoured (checkpoint and exit 75)."""

    def __init__(self, nodes: int, gpus: int, *, serving: Mapping[str, int] | None = None,
                 journal: str | Path | None = None, beat_s: float = 10.0, notice_s: float = 5.0) -> None:
        self.shape = (nodes, gpus)
        self.serving = dict(serving or {})
        self.beat_s, self.notice_s = beat_s, notice_s
        self.lost_nodes: dict[str, float] = {}
        self.ckpt: dict[str, float] = {}  # job -> work (GPU-seconds) of its newest committed checkpoint
        self._jobs: dict[str, _Attempt] = {}  # tracked attempts
        self._gone: dict[str, _Attempt] = {}  # attempts found in the journal, not adopted yet
        self._now = 0.0
        self._nodes: tuple[int, list[Node]] | None = None  # (nodes lost when made, the nodes)
        self._names: set[str] = set()
        self._journal: TextIO | None = None
        if journal is not None:
            self._open(Path(journal))

    # -- the journal ---------------------------------------------------------------------------------
    def _open(self, path: Path) -> None:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    self._replay(json.loads(line))
        self._gone, self._jobs = self._jobs, {}
        live = [*({"op": "lose", "node": n, "t": t} for n, t in self.lost_nodes.items()),
                *({"op": "ckpt", "job": j, "work": w} for j, w in self.ckpt.items()),
                *(self._launch_doc(a) for a in self._gone.values())]
        write_atomic(path, "".join(json.dumps(d) + "\n" for d in live))  # compacted
        self._journal = path.open("a", buffering=1)

    @staticmethod
    def _launch_doc(a: _Attempt) -> dict:
        return {"op": "launch", "job": a.job_id, "attempt": a.attempt, "placement": a.placement,
                "t": a.launch_s, "from": a.start_work, "work": a.work if math.isfinite(a.work) else None,
                "interval": a.interval_s, "anchor": a.anchor_s, "stop": a.stop_s, "kill": a.kill_s,
                "lost": {str(r): t for r, t in a.lost.items()}}

    def _log(self, doc: dict) -> None:
        self._replay(doc)
        if self._journal is not None:
            self._journal.write(json.dumps(doc) + "\n")

    def _replay(self, d: dict) -> None:
        op, job = d["op"], d.get("job", "")
        a = self._jobs.get(job)
        if op == "launch":
            work = d["work"] if d["work"] is not None else math.inf
            self._jobs[job] = _Attempt(job, d["attempt"], d["placement"], d["t"], d["from"], work,
                                       d["interval"], d["anchor"], d.get("stop"), d.get("kill"),
                                       {int(r): t for r, t in (d.get("lost") or {}).items()})
        elif op == "ckpt":
            self.ckpt[job] = d["work"]
        elif op == "lose":
            self.lost_nodes[d["node"]] = d["t"]
            for x in self._jobs.values():
                if x.end(self.notice_s)[0] > d["t"]:  # (ranks that exited before are not lost)
                    for r, n in enumerate(x.rank_nodes()):
                        if n == d["node"]:
                            x.lost.setdefault(r, d["t"])
                x.cache = None
        elif a is None:
            return
        elif op == "stop" and a.stop_s is None:
            a.stop_s = d["t"]
        elif op == "kill" and a.kill_s is None:
            a.kill_s = d["t"]
        elif op == "configure":
            a.anchor_s = a.last_ckpt(d["t"], self.notice_s)[1] or a.anchor_s
            a.interval_s = d["interval"]
        elif op == "release":
            self.ckpt[job] = d["work"]
            del self._jobs[job]
        if a is not None:
            a.cache = None

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    # -- the protocol --------------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        if self._nodes is None or self._nodes[0] != len(self.lost_nodes):  # (made again after a loss)
            n, g = self.shape
            width = len(str(n - 1))
            names = (f"v{i:0{width}d}" for i in range(n))
            self._nodes = (len(self.lost_nodes), [
                *(Node(k, g) for k in names if k not in self.lost_nodes),
                *(Node(k, v, "serving") for k, v in self.serving.items() if k not in self.lost_nodes)])
            self._names = {x.name for x in self._nodes[1]}
        return list(self._nodes[1])

    def used(self) -> dict[str, int]:
        """Node -> GPUs held by tracked attempts (launched and not yet released)."""
        out: Counter[str] = Counter()
        for a in self._jobs.values():
            out.update(a.placement)
        return dict(out)

    def launch(self, req: LaunchRequest, now_s: float) -> dict:
        if req.job_id in self._jobs:
            raise LaunchError(f"job {req.job_id} is running already")
        self.nodes()
        if bad := sorted(set(req.placement) - self._names):
            raise LaunchError(f"job {req.job_id}: no node {', '.join(bad)} in the virtual pool")
        try:
            work = float(req.env.get(WORK_ENV, "inf"))
            interval = float(req.env.get(ENV_CKPT_INTERVAL_S, DEFAULT_INTERVAL_S))
        except ValueError as e:
            raise LaunchError(f"job {req.job_id}: env {WORK_ENV} or {ENV_CKPT_INTERVAL_S}: {e}") from None
        if not work > 0 or not interval > 0:
            raise LaunchError(f"job {req.job_id}: {WORK_ENV} and {ENV_CKPT_INTERVAL_S} must be > 0")
        self._log({"op": "launch", "job": req.job_id, "attempt": req.attempt,
                   "placement": dict(req.placement), "t": now_s, "from": self.ckpt.get(req.job_id, 0.0),
                   "work": work if math.isfinite(work) else None, "interval": interval, "anchor": now_s})
        return {"virtual": True, "ranks": req.world_size}

    def signal_stop(self, job_id: str, ranks: Collection[int] | None = None) -> None:
        a = self._jobs.get(job_id)
        if a is not None:
            check_ranks(f"job {job_id}", ranks, a.world)
            self._log({"op": "stop", "job": job_id, "t": self._now})

    def kill(self, job_id: str) -> None:
        if job_id in self._jobs:
            self._log({"op": "kill", "job": job_id, "t": self._now})

    def configure(self, job_id: str, settings: Mapping[str, Any]) -> None:
        iv = settings.get("ckpt_interval_s")
        if job_id in self._jobs and iv:
            self._log({"op": "configure", "job": job_id, "t": self._now, "interval": float(iv)})

    def observe(self, now_s: float) -> dict[str, Observation]:
        self._now = max(self._now, now_s)
        return {k: self._observe(a, now_s) for k, a in self._jobs.items()}

    def _observe(self, a: _Attempt, now_s: float) -> Observation:
        stop, code = end = a.end(self.notice_s)
        over = now_s >= stop
        t = stop if over else a.launch_s + math.floor((now_s - a.launch_s) / self.beat_s) * self.beat_s
        key = (t, over, len(a.lost))
        if a.cache is not None and a.cache[0] == key:
            return a.cache[1]
        exit_code = code if over else None
        if a.ranks is None or a.ranks[0] != (exit_code, len(a.lost)):  # (the same from beat to beat)
            nodes = a.rank_nodes()
            lost = a.lost
            a.ranks = ((exit_code, len(lost)), tuple(
                RankState(r, None, None if r in lost else exit_code, r in lost, False, r in lost, nodes[r])
                for r in range(a.world)))
        ranks = a.ranks[1]
        work, at = a.last_ckpt(t, self.notice_s, end)
        tier = {"dir": [int(work), at]} if at is not None else {}
        step = int(a.done(t))
        p = Progress(start_step=int(a.start_work), step=step, step_s=t, first_step=int(a.start_work),
                     first_step_s=a.launch_s, step_time_s=1.0 / a.world, heartbeat_s=t, heartbeats=a.world,
                     phase="training", ckpt_step=int(work) if at is not None else None, ckpt_s=at,
                     durable_ckpt_step=int(work) if at is not None else None, durable_ckpt_s=at, tiers=tier,
                     preempted=over and code == EXIT_PREEMPTED, ended=over and code == 0)
        ob = Observation(a.job_id, a.attempt, a.launch_s, ranks, p)
        a.cache = (key, ob)
        return ob

    def adopt(self, job_id: str, attempt: int, now_s: float) -> bool:
        a = self._gone.get(job_id)
        if a is None or a.attempt != attempt:
            return False
        self._jobs[job_id] = self._gone.pop(job_id)
        return True

    def release(self, job_id: str) -> None:
        a = self._jobs.get(job_id)
        if a is not None:
            self._log({"op": "release", "job": job_id, "work": a.last_ckpt(self._now, self.notice_s)[0]})

    def release_unadopted(self) -> list[str]:
        """The journal's attempts not adopted after a restart are released (their checkpoints kept)."""
        out = []
        for job_id in list(self._gone):
            self._jobs[job_id] = a = self._gone.pop(job_id)
            self.release(job_id)
            out.append(f"attempt {a.attempt} of {job_id}")
        return out

    def log_path(self, job_id: str, rank: int) -> str | None:
        return None

    # -- on command ----------------------------------------------------------------------------------
    def lose_node(self, node: str, now_s: float) -> None:
        """The node leaves the pool: its ranks vanish with it (``lost``); it is no longer in ``nodes()``."""
        self._now = max(self._now, now_s)
        self._log({"op": "lose", "node": node, "t": now_s})

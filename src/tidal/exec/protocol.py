"""The executor protocol: what the reconcile loop asks of whatever runs the workers, from one thread
(``observe``, then ``launch``/``signal_stop``/``kill``/``release``; ``adopt`` after a restart). Times are
Unix seconds from the caller; a negative exit code means killed by that signal."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tidal.contract import EXIT_PREEMPTED
from tidal.exec.progress import Progress
from tidal.model import Node

__all__ = ["EXIT_PREEMPTED", "Executor", "LaunchError", "LaunchRequest", "Observation", "RankState",
           "check_ranks"]


class LaunchError(RuntimeError):
    """A rank could not be started (no free device, a missing working directory, an unknown node, ...)."""


@dataclass(frozen=True)
class LaunchRequest:
    """Start attempt ``attempt`` of ``job_id``: ``placement`` (node -> GPUs) ranks running ``command``.

    ``env`` holds the job's variables and Tidal's (checkpoint location and interval, grace); the
    executor adds the torchrun contract, the GPU binding and ``TIDAL_PROGRESS_DIR``; nothing of its
    own environment but what its isolation settings pass (:mod:`tidal.exec.isolation`).
    """

    job_id: str
    attempt: int
    command: tuple[str, ...]
    placement: Mapping[str, int]
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    tenant: str | None = None  # whose job: the local executor may run each tenant as its own uid
    own_dirs: tuple[str, ...] = ()  # directories the job must own (its default checkpoint directory)
    # checkpoint directories it takes over from ended jobs of its tenant (``resume_from``), and those
    # jobs: with uids, what the uids they ran as own there becomes the job's (tidal.exec.handover)
    take_over: tuple[str, ...] = ()
    take_over_from: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return sum(self.placement.values())


@dataclass(frozen=True)
class RankState:
    rank: int
    pid: int | None
    exit_code: int | None = None  # None: still running (or vanished)
    vanished: bool = False  # gone without a recorded exit code
    ended: bool = False  # its runtime closed cleanly first (heartbeat phase tidal.contract.PHASE_ENDED)
    lost: bool = False  # vanished with the machine it ran on (its node left the cluster)
    node: str | None = None  # where it runs, when the executor spans several machines

    @property
    def alive(self) -> bool:
        return self.exit_code is None and not self.vanished


@dataclass(frozen=True)
class Observation:
    """What an executor knows of one job's current attempt at ``now_s``."""

    job_id: str
    attempt: int
    launched_s: float
    ranks: tuple[RankState, ...]
    progress: Progress = field(default_factory=Progress)

    @property
    def alive(self) -> list[RankState]:
        return [r for r in self.ranks if r.alive]

    @property
    def done(self) -> bool:
        return not any(r.alive for r in self.ranks)  # (stops at the first rank running)

    @property
    def all_alive(self) -> bool:
        """Every rank is running (none exited, vanished or lost): the usual state of a training attempt, in
        which the reconcile loop has nothing to look at but its heartbeat (one pass over the ranks)."""
        return bool(self.ranks) and all(r.alive for r in self.ranks)


def check_ranks(who: str, ranks: Collection[int] | None, world_size: int) -> frozenset[int]:
    """The ranks a signal goes to: ``ranks``, or all ``world_size`` of them when ``None``; ``ValueError``
    naming ``who`` (e.g. ``"job gpt-1"``) for a rank outside ``0 .. world_size - 1``."""
    if ranks is None:
        return frozenset(range(world_size))
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise ValueError(f"{who}: no rank {', '.join(map(str, bad))} (it has {world_size}: "
                         f"0..{world_size - 1})")
    return frozenset(ranks)


class Executor(Protocol):
    """See the module docstring for the call order. Implementations: ``LocalExecutor``,
    ``RayExecutor`` (:mod:`tidal.exec.ray_exec`), test fakes. ``nodes()`` is read every step: nodes
    may join and leave."""

    def nodes(self) -> list[Node]:
        """The machines (and their GPUs) this executor runs ranks on."""
        ...

    def launch(self, req: LaunchRequest, now_s: float) -> dict:
        """Start every rank; return a JSON-able handle (pids, devices, paths) for display and the store."""
        ...

    def signal_stop(self, job_id: str, ranks: Collection[int] | None = None) -> None:
        """Notice to every rank still running (SIGTERM): checkpoint now and exit 75. With ``ranks``, only
        to those (a notice that reaches some ranks first: they tell the others at the next step);
        ``ValueError`` for a rank the job does not have."""
        ...

    def kill(self, job_id: str) -> None:
        """SIGKILL every rank still running."""
        ...

    def configure(self, job_id: str, settings: Mapping[str, Any]) -> None:
        """Change settings of a running attempt (today ``ckpt_interval_s``); the ranks pick them up
        between steps (``TIDAL_CONTROL_FILE``). A job not running is ignored."""
        ...

    def observe(self, now_s: float) -> dict[str, Observation]:
        """Facts about every tracked job."""
        ...

    def adopt(self, job_id: str, attempt: int, now_s: float) -> bool:
        """Re-track an attempt launched before a restart; False when nothing of it can be found."""
        ...

    def release(self, job_id: str) -> None:
        """Forget a job whose ranks have all exited."""
        ...

    def release_unadopted(self) -> list[str]:
        """After a restart's adoptions: release what is left of attempts this executor does not track (an
        end that a plane killed before releasing it had stored); what was released, described."""
        ...

    def log_path(self, job_id: str, rank: int) -> str | None:
        """Where rank ``rank``'s output goes (all attempts appended), if the executor keeps one."""
        ...


@runtime_checkable
class NodeMemory(Protocol):
    """An executor that keeps jobs' node-memory checkpoint tiers (shared-memory directories) and frees
    them when the control plane says the job no longer needs them (``Controller.sweep_shm``)."""

    def shm_jobs(self) -> list[str]:
        """Jobs that have a shared-memory directory on this executor's nodes."""
        ...

    def free_shm(self, job_id: str) -> bool:
        """Remove the job's shared-memory directories (never of a tracked job); True if any was there."""
        ...


@runtime_checkable
class AgentMemory(Protocol):
    """An executor that runs the checkpoint agents of the peer tier and frees the steps they hold of a
    job when the control plane says it no longer needs them (``Controller.sweep_shm``). Keyed by the
    job's peer namespace (``tidal.exec.agent_memory``), not its id."""

    def agent_jobs(self) -> list[str]:
        """Peer namespaces of which the executor's agents hold a step."""
        ...

    def free_agent_job(self, namespace: str) -> bool:
        """Remove every step of ``namespace`` from every agent; True if any was there."""
        ...

"""The environment contract of a Tidal training process — the one place it is defined.

A launcher (``torchrun``, Tidal's executor, a test harness) starts one process per rank and tells it
who it is and what to do through these variables; :class:`tidal.train.Session` reads them. With none
set, a script runs as a single process without a process group. docs/train.md mirrors this table;
the names are constants of :mod:`tidal.contract` (``ENV_*``).

variable                       default       meaning (unit)
-----------------------------  ------------  -----------------------------------------------------------------
RANK                           0             this process's rank in the job (torchrun contract)
WORLD_SIZE                     1             number of ranks; when set together with MASTER_ADDR/PORT the
                                             session forms a process group (even of one rank)
LOCAL_RANK                     0             rank on this node; selects the GPU cuda:LOCAL_RANK
LOCAL_WORLD_SIZE               1             ranks on this node
MASTER_ADDR                    (unset)       rendezvous host of rank 0 (torchrun contract)
MASTER_PORT                    (unset)       rendezvous TCP port of rank 0 (torchrun contract)
TIDAL_JOB_ID                   local         job id, written into every progress record
TIDAL_ATTEMPT                  (unset)       the attempt of the job (1, 2, ...; set by the executor): with the
                                             job id, the claim checked against the checkpoint location's
                                             fence before each commit (tidal.ckpt.fence); unset: not checked
TIDAL_CKPT_URL                 (unset)       checkpoint directory (path or file://); unset: no checkpoints,
                                             restore() starts at step 0
TIDAL_CKPT_TIERS               (unset)       tier list, fastest first, instead of TIDAL_CKPT_URL: a JSON list
                                             (strings or dicts, as Checkpointer(tiers=...) takes) or a comma-
                                             separated list, e.g. shm,/ckpt/run1,s3://bucket/run1; restore
                                             reads the newest step committed in any of them
TIDAL_CONTROL_FILE             (unset)       a JSON file the launcher rewrites to change settings of a running
                                             job, e.g. {"ckpt_interval_s": 120}; re-read when it changes
TIDAL_CKPT_INTERVAL_S          600           seconds between periodic checkpoints; 0 turns the timer off
TIDAL_CKPT_INTERVAL_STEPS      0             steps between periodic checkpoints; 0 turns it off
TIDAL_CKPT_KEEP                3             committed steps kept on disk (0: all)
TIDAL_NOTICE_FILE              (unset)       a path whose appearance means "GPUs are being taken back" (for
                                             launchers that cannot signal); the grace counts from its mtime;
                                             a file older than the process is stale and ignored
TIDAL_GRACE_S                  30            seconds from a notice (SIGTERM or the file) to a forced exit
TIDAL_NOTICE_WAIT              fast          on a notice, exit once the final checkpoint is committed in the
                                             fast tier (node memory: survives the process, not the node) or
                                             in all tiers (disk too); either way within the grace
TIDAL_PROGRESS_DIR             (unset)       directory for progress-rNNNNN.jsonl and heartbeat-rNNNNN.json per
                                             rank; unset: no progress files
TIDAL_SHM_DIR                  /dev/shm      where the checkpoint engine keeps its node-memory tier
TIDAL_CKPT_AGENT               (unset)       the peer tier: this node's checkpoint agent, host:port
TIDAL_CKPT_PEERS               (unset)       the peer tier: more agents to read from, comma-separated
TIDAL_CKPT_AGENT_TOKEN         (unset)       the peer tier: this job's token at agents that have a key (set
                                             by the executor; docs/checkpoint.md, Authentication)
TIDAL_API_URL                  (unset)       reserved: control-plane URL (progress over HTTP, notices)
TIDAL_TOKEN                    (unset)       reserved: bearer token for TIDAL_API_URL

Exit codes of a process driven by a session: ``0`` finished; ``75`` (``EX_TEMPFAIL``) preempted,
resumable from the newest committed checkpoint (also after a second SIGTERM or when the grace ran
out: the engine never exposes a torn step); ``77`` (``EX_NOPERM``, ``EXIT_FENCED``) fenced out: the
checkpoint location belongs to another job or a newer attempt now, this rank's commit was refused;
anything else is a failure.

The names, the exit code (``EXIT_PREEMPTED``), the default grace (``DEFAULT_GRACE_S``: the 30 above)
and the progress file names are defined once, in :mod:`tidal.contract`, which the executors and the
control plane import too. Launchers also set ``GROUP_RANK=0`` and, on GPUs, ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidal import contract as c
from tidal.contract import DEFAULT_GRACE_S, EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "NOTICE_WAIT_CHOICES", "Env", "EnvError"]
NOTICE_WAIT_CHOICES = ("fast", "all")


class EnvError(ValueError):
    """A variable of the environment contract holds a value that cannot be used."""


@dataclass(frozen=True)
class Env:
    """The parsed environment contract (see the module docstring for meanings and units)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str = "local"
    ckpt_url: str | None = None
    ckpt_tiers: tuple[Any, ...] | None = None
    control_file: str | None = None
    ckpt_interval_s: float = 600.0
    ckpt_interval_steps: int = 0
    ckpt_keep: int = 3
    notice_file: str | None = None
    grace_s: float = DEFAULT_GRACE_S
    notice_wait: str = "fast"
    progress_dir: str | None = None
    api_url: str | None = None
    token: str | None = None

    @property
    def launched(self) -> bool:
        """True when a launcher set up a rendezvous (then the session forms a process group)."""
        return self.master_addr is not None and self.master_port is not None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Env:
        e = os.environ if environ is None else environ
        env = cls(
            rank=_int(e, c.ENV_RANK, 0, lo=0),
            world_size=_int(e, c.ENV_WORLD_SIZE, 1, lo=1),
            local_rank=_int(e, c.ENV_LOCAL_RANK, 0, lo=0),
            local_world_size=_int(e, c.ENV_LOCAL_WORLD_SIZE, 1, lo=1),
            master_addr=e.get(c.ENV_MASTER_ADDR) or None,
            master_port=_int(e, c.ENV_MASTER_PORT, 0, lo=1) if e.get(c.ENV_MASTER_PORT) else None,
            job_id=e.get(c.ENV_JOB_ID) or "local",
            ckpt_url=e.get(c.ENV_CKPT_URL) or None,
            ckpt_tiers=_tiers(e.get(c.ENV_CKPT_TIERS) or ""),
            control_file=e.get(c.ENV_CONTROL_FILE) or None,
            ckpt_interval_s=_float(e, c.ENV_CKPT_INTERVAL_S, 600.0),
            ckpt_interval_steps=_int(e, c.ENV_CKPT_INTERVAL_STEPS, 0, lo=0),
            ckpt_keep=_int(e, c.ENV_CKPT_KEEP, 3, lo=0),
            notice_file=e.get(c.ENV_NOTICE_FILE) or None,
            grace_s=_float(e, c.ENV_GRACE_S, DEFAULT_GRACE_S, positive=True),
            notice_wait=e.get(c.ENV_NOTICE_WAIT) or "fast",
            progress_dir=e.get(c.ENV_PROGRESS_DIR) or None,
            api_url=e.get(c.ENV_API_URL) or None,
            token=e.get(c.ENV_TOKEN) or None,
        )
        if env.rank >= env.world_size:
            raise EnvError(f"{c.ENV_RANK}={env.rank} is not below {c.ENV_WORLD_SIZE}={env.world_size}")
        if env.notice_wait not in NOTICE_WAIT_CHOICES:
            raise EnvError(f"{c.ENV_NOTICE_WAIT}={env.notice_wait!r}: "
                           f"expected one of {list(NOTICE_WAIT_CHOICES)}")
        if env.world_size > 1 and not env.launched:
            raise EnvError(f"WORLD_SIZE={env.world_size} but MASTER_ADDR/MASTER_PORT are not set: start the "
                           "ranks with torchrun or another launcher that sets the rendezvous")
        return env


def _tiers(raw: str) -> tuple[Any, ...] | None:
    """``TIDAL_CKPT_TIERS``: a JSON list, or comma-separated strings; ``None`` when unset."""
    raw = raw.strip()
    if not raw:
        return None
    if raw.startswith("["):
        try:
            tiers = json.loads(raw)
        except json.JSONDecodeError as e:
            raise EnvError(f"{c.ENV_CKPT_TIERS} is not valid JSON ({e.msg} at character {e.pos}): "
                           f"{raw!r}") from None
        if not isinstance(tiers, list) or not all(isinstance(t, (str, dict)) for t in tiers):
            raise EnvError(f"{c.ENV_CKPT_TIERS}={raw!r}: expected a JSON list of strings or objects")
    else:
        tiers = [t.strip() for t in raw.split(",")]
    if not tiers or any(t == "" for t in tiers):
        raise EnvError(f"{c.ENV_CKPT_TIERS}={raw!r}: expected a non-empty list of tiers without empty "
                       "entries, "
                       "e.g. shm,/ckpt/run1,s3://bucket/run1")
    return tuple(tiers)


def _int(e: Mapping[str, str], name: str, default: int, *, lo: int) -> int:
    raw = e.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected an integer") from None
    if v < lo:
        raise EnvError(f"{name}={raw!r}: expected an integer >= {lo}")
    return v


def _float(e: Mapping[str, str], name: str, default: float, *, positive: bool = False) -> float:
    raw = e.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected a number of seconds") from None
    if v < 0 or (positive and v == 0) or v != v:
        raise EnvError(f"{name}={raw!r}: expected a number of seconds {'> 0' if positive else '>= 0'}")
    return v

"""The environment contract of a training process: the variables a launcher sets per rank and
:class:`tidal.train.Session` reads (docs/train.md has the table and the exit codes)."""

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
    """The parsed environment contract."""

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
            rank=_num(e, c.ENV_RANK, 0), world_size=_num(e, c.ENV_WORLD_SIZE, 1, 1),
            local_rank=_num(e, c.ENV_LOCAL_RANK, 0), local_world_size=_num(e, c.ENV_LOCAL_WORLD_SIZE, 1, 1),
            master_addr=e.get(c.ENV_MASTER_ADDR) or None,
            master_port=_num(e, c.ENV_MASTER_PORT, 0, 1) if e.get(c.ENV_MASTER_PORT) else None,
            job_id=e.get(c.ENV_JOB_ID) or "local", ckpt_url=e.get(c.ENV_CKPT_URL) or None,
            ckpt_tiers=_tiers(e.get(c.ENV_CKPT_TIERS) or ""), control_file=e.get(c.ENV_CONTROL_FILE) or None,
            ckpt_interval_s=_num(e, c.ENV_CKPT_INTERVAL_S, 600.0), ckpt_keep=_num(e, c.ENV_CKPT_KEEP, 3),
            ckpt_interval_steps=_num(e, c.ENV_CKPT_INTERVAL_STEPS, 0),
            notice_file=e.get(c.ENV_NOTICE_FILE) or None,
            grace_s=_num(e, c.ENV_GRACE_S, DEFAULT_GRACE_S, positive=True),
            notice_wait=e.get(c.ENV_NOTICE_WAIT) or "fast", progress_dir=e.get(c.ENV_PROGRESS_DIR) or None,
            api_url=e.get(c.ENV_API_URL) or None, token=e.get(c.ENV_TOKEN) or None
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
                       "entries, e.g. shm,/ckpt/run1,s3://bucket/run1")
    return tuple(tiers)


def _num(e: Mapping[str, str], name: str, default: Any, lo: int = 0, *, positive: bool = False) -> Any:
    """``name``'s value as the type of ``default`` (an int, else seconds), ``>= lo`` (``> 0``: ``positive``);
    ``default`` when unset or empty."""
    raw = e.get(name)
    if not raw:
        return default
    kind, what = (int, "an integer") if isinstance(default, int) else (float, "a number of seconds")
    try:
        v = kind(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected {what}") from None
    if v < lo or (positive and v == 0) or v != v:
        raise EnvError(f"{name}={raw!r}: expected {what} {'> 0' if positive else f'>= {lo}'}")
    return v

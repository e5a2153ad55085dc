"""What the API and the dashboard serve from: :class:`ApiContext`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.control.limits import SubmitLimits
from tidal.control.locations import LocationPolicy
from tidal.control.store import Store
from tidal.model import Node

if TYPE_CHECKING:
    from tidal.control.loans import LiveLoans
    from tidal.control.read_view import PlaneView
    from tidal.serving.watch import Advisor


@dataclass
class ApiContext:
    """What the API needs: the store, the pool's nodes, rank logs, a clock (Unix seconds), and ``ckpt_root``
    for jobs without a ``checkpoint.url`` (``<ckpt_root>/<job>/ckpt``; None: no known location)."""

    store: Store
    nodes: list[Node]
    log_path: Callable[[str, int], str | None]
    clock: Callable[[], float]
    ckpt_root: Path | None = None
    serving: tuple[Advisor | None, str] | None = None
    """The serving side, if configured: (its :class:`~tidal.serving.watch.Advisor` when it only advises,
    else None; its source described)."""
    loans: LiveLoans | None = None
    """Live lending, if configured (its ``view()``)."""
    locations: LocationPolicy | None = None
    """Where tenants may checkpoint (None: a policy with no tenant prefix, only grants: none)."""
    job_dir: Callable[[str], Any] | None = None
    """A job's executor directory (its attempts' progress records, for the dashboard's curves)."""
    shm_dir: Callable[[str], Any] | None = None
    """A job's shared-memory directory as the executor made it (its shm tier, status file); None: the
    plane's ``TIDAL_SHM_DIR``, else ``/dev/shm``."""
    limits: SubmitLimits | None = None
    """Per-tenant submission limits (None: none)."""
    warning: str | None = None
    """What the dashboard shows as a banner (isolation turned off: ``control.server.isolation_warning``)."""
    log_owner: int | None = field(default_factory=os.geteuid)
    """The uid that creates rank logs (the plane's; on Ray the workers' user: None, not checked); a log
    owned by another (a hard link a job made to another's file) is not read."""
    view: Callable[[], PlaneView | None] | None = None
    """The pool as the reconcile loop's newest step left it (:mod:`tidal.control.read_view`), which the pool
    reads and ``/metrics`` serve; None (no loop, or before its first step): they query the store."""

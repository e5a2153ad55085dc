"""Knobs of the live control plane (one table, units in the names); ``tidal up --config FILE`` (YAML, every
field in docs/control.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tidal.exec.isolation import IsolationConfig
from tidal.policy.ckpt_interval import CkptIntervalConfig
from tidal.policy.scheduler import SchedulerConfig
from tidal.serving.watch import WatchConfig


@dataclass(frozen=True)
class ControlConfig:
    """How the reconcile loop treats jobs. Seconds everywhere.

    Failures: ``restart_backoff_s`` before the first restart, doubled per restart up to ``max_backoff_s``.
    Hangs: a running job whose newest heartbeat is older than ``max(hang_timeout_s, hang_step_times x its step
    time)`` is hung; before its first heartbeat (and while it checkpoints, restores or stops),
    ``startup_timeout_s``. Stopping: SIGKILL ``kill_slack_s`` after the job's own grace. ``serving``: where
    serving demand comes from and, with ``nodes``, which GPUs the plane lends (:mod:`tidal.control.loans`);
    ``None``: no serving side.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ckpt_interval: CkptIntervalConfig = field(default_factory=CkptIntervalConfig)
    restart_backoff_s: float = 10.0
    max_backoff_s: float = 600.0
    hang_timeout_s: float = 120.0
    hang_step_times: float = 10.0
    startup_timeout_s: float = 600.0
    kill_slack_s: float = 10.0
    loop_interval_s: float = 0.5
    submit_rate_per_s: float = 100.0
    """Jobs a second a tenant may submit (bursts of ``submit_burst``); over it: 429. 0: no limit (one tenant's
    flood then slows the plane for every tenant: ``tidal up`` says so when it starts)."""
    submit_burst: float = 1000.0
    max_queued_jobs: int = 10000
    """Pending jobs a tenant may have; a submission over it: 429. 0: no cap (said at start, as above)."""
    retention_s: float = 0.0
    """Ended jobs (whose directory the executor no longer keeps) and events older than this are dropped from
    the database; 0: kept for ever."""
    serving: WatchConfig | None = None
    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    checkpoint_grants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Checkpoint prefixes (directories, ``s3://bucket/prefix``) a tenant's jobs may use besides their own
    ``<state dir>/tenants/<tenant>/``; key ``"*"``: every tenant (tidal.control.locations)."""
    checkpoint_endpoints: tuple[str, ...] = ()
    """S3 endpoints (``aws``: the AWS default) and checkpoint agents (host:port) a spec may name."""
    checkpoint_max_timeout_s: float = 60.0
    checkpoint_quota_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes a tenant's jobs' local checkpoint directories may hold (key ``"*"``: every tenant without its
    own; none: no quota): a submission over it is refused, a running job taking its tenant over it is
    an event (tidal.control.locations.quota_use)."""

    def backoff_s(self, restarts: int) -> float:
        """Seconds to wait before restart number ``restarts`` (1 = the first)."""
        return min(self.max_backoff_s, self.restart_backoff_s * 2 ** max(0, restarts - 1))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> ControlConfig:
        names = {f.name for f in fields(cls)}
        for k in d:
            if k not in names:
                raise ValueError(f"{where}: unknown field {k!r} (expected one of {sorted(names)})")
        kw = dict(d)
        nested = {"scheduler": SchedulerConfig, "ckpt_interval": CkptIntervalConfig}
        for key, kind in nested.items():
            if key in kw:
                sub = kw[key] or {}
                if not isinstance(sub, dict):
                    raise ValueError(f"{where}: {key} must be a mapping of settings, got {sub!r}")
                snames = {f.name for f in fields(kind)}
                for k in sub:
                    if k not in snames:
                        raise ValueError(f"{where}: unknown field {key}.{k} (expected one of "
                                         f"{sorted(snames)})")
                kw[key] = kind(**sub)
        if kw.get("serving") is not None:
            kw["serving"] = WatchConfig.from_dict(kw["serving"], f"{where}: serving")
        if "isolation" in kw:
            kw["isolation"] = IsolationConfig.from_dict(kw["isolation"], where)
        grants = kw.get("checkpoint_grants")
        if grants is not None:
            if not isinstance(grants, dict) or not all(
                    isinstance(t, str) and isinstance(ps, list) and all(isinstance(p, str) and p for p in ps)
                    for t, ps in grants.items()):
                raise ValueError(
                    f"{where}: checkpoint_grants must map a tenant (or '*') to a list of directories "
                    f"or s3://bucket/prefix, got {grants!r}")
            for ps in grants.values():
                for p in ps:
                    if not (p.startswith(("/", "s3://", "file:///"))):
                        raise ValueError(f"{where}: checkpoint_grants: {p!r} is not an absolute directory or "
                                         "s3://bucket/prefix")
            kw["checkpoint_grants"] = {t: tuple(ps) for t, ps in grants.items()}
        eps = kw.get("checkpoint_endpoints")
        if eps is not None:
            if not isinstance(eps, list) or not all(isinstance(e, str) and e for e in eps):
                raise ValueError(
                    f"{where}: checkpoint_endpoints must be a list of S3 endpoint URLs, 'aws', or "
                    f"agent host:port, got {eps!r}")
            kw["checkpoint_endpoints"] = tuple(eps)
        quota = kw.get("checkpoint_quota_bytes")
        if quota is not None and (not isinstance(quota, dict) or not all(
                isinstance(t, str) and isinstance(b, int) and not isinstance(b, bool) and b > 0
                for t, b in quota.items())):
            raise ValueError(f"{where}: checkpoint_quota_bytes must map a tenant (or '*') to a number of "
                             f"bytes > 0, got {quota!r}")
        not_numbers = {*nested, "serving", "isolation", "checkpoint_grants", "checkpoint_endpoints",
                       "checkpoint_quota_bytes"}
        for k, v in kw.items():
            if k in not_numbers:
                continue
            unit = _UNITS.get(k, "seconds")
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}: {k} must be a number of {unit} >= 0, got {v!r}")
            if k in _WHOLE:
                if v != int(v):
                    raise ValueError(f"{where}: {k} must be a whole number of {unit} >= 0, got {v!r}")
                kw[k] = int(v)
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> ControlConfig:
        import yaml

        doc = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        serving = doc.get("serving")
        if isinstance(serving, dict) and isinstance(serving.get("trace"), str):  # relative to the file
            doc = {**doc, "serving": {**serving, "trace": str(Path(path).parent / serving["trace"])}}
        return cls.from_dict(doc, str(path))


# what the plane's numeric settings count, where not seconds (their errors name it), and those that are whole
_UNITS = {"submit_rate_per_s": "jobs a second", "submit_burst": "jobs", "max_queued_jobs": "jobs",
          "hang_step_times": "step times"}
_WHOLE = frozenset({"max_queued_jobs"})

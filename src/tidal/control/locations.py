"""Checkpoint locations belong to a tenant (checked at submission, in the API process; rules in
docs/control.md).

* No ``checkpoint.url``/``tiers``: ``<state dir>/jobs/<job>/ckpt``, its own (job ids are never reused).
* A directory must lie under ``<state dir>/tenants/<tenant>/`` or a prefix granted in ``checkpoint_grants``,
  compared after resolving ``..`` and links.
* ``s3://`` and ``peer`` tiers need their endpoints in ``checkpoint_endpoints`` (or the plane's own agents,
  ``own_agents``); tier timeouts are capped by ``checkpoint_max_timeout_s``.
* Two jobs never share a location unless one says ``resume_from`` an ended job of its tenant; a directory
  holding steps is refused otherwise. The admin's jobs may use any location.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMEOUT_OPTIONS = ("timeout_s", "connect_timeout_s", "retry_timeout_s")
TENANTS_DIRNAME = "tenants"  # <state dir>/tenants/<tenant>/: each tenant's own prefix
QUOTA_CHECK_S = 60.0  # how often a tenant's checkpoint bytes are counted (a walk of its directories)
QUOTA_RECHECK_S = 5.0  # ... once they were found at or over its quota (it may have removed some since)


@dataclass(frozen=True)
class LocationPolicy:
    """What the admin allows (from ``ControlConfig``) and where tenants' own prefixes are."""

    tenants_root: Path | None = None
    grants: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    endpoints: tuple[str, ...] = ()
    max_timeout_s: float = 60.0
    own_agents: bool = False
    """The executor runs a checkpoint agent on each node and gives ranks their addresses (``tidal up
    --executor ray --ckpt-agents``): a ``peer`` tier naming no agent uses those, which tenants may."""

    quota_bytes: Mapping[str, int] = field(default_factory=dict)
    """``checkpoint_quota_bytes``: a tenant's (or ``"*"``) bytes of local checkpoints."""

    def quota(self, tenant: str) -> int | None:
        return quota_of(self.quota_bytes, tenant)

    def prefixes(self, tenant: str) -> list[str]:
        out = [str(self.tenants_root / tenant)] if self.tenants_root is not None else []
        for who in (tenant, "*"):
            out.extend(self.grants.get(who, ()))
        return [p if p.startswith("s3://") else _real(p) for p in out]


def quota_of(quota_bytes: Mapping[str, int], tenant: str) -> int | None:
    return quota_bytes.get(tenant, quota_bytes.get("*"))


def homes(jobs: Iterable[Any], ckpt_root: Path | None) -> list[tuple[str, str]]:
    """(tenant, checkpoint home) of ``jobs`` (store rows): the recorded location, else the default
    ``<ckpt_root>/<job>/ckpt``."""
    root = ckpt_root.resolve() if ckpt_root is not None else None  # as recorded locations are
    out = [(j.tenant, j.ckpt_location or (str(root / j.id / "ckpt") if root is not None else None))
           for j in jobs]
    return [(t, h) for t, h in out if h is not None]


def quota_use(homes: Iterable[tuple[str, str]],
              quota: Callable[[str], int | None]) -> dict[str, tuple[int, int]]:
    """``{tenant: (bytes used, quota)}`` of the tenants with a quota, from ``(tenant, home)`` of their
    jobs' checkpoint homes (``s3://`` ones are not counted: the bucket has its own limits). Bytes are
    what the files take on disk (a sparse file counts its blocks), never through a link: a home (recorded
    resolved) that now resolves elsewhere went through a link its job planted, and is not walked."""
    out: dict[str, tuple[int, int]] = {}
    for tenant, home in homes:
        q = quota(tenant)
        if q is None or home.startswith("s3://"):
            continue
        used = 0 if moved(home) else _blocks(_real(home))
        out[tenant] = (out.get(tenant, (0, q))[0] + used, q)
    return out


def moved(home: str) -> bool:
    """Whether a local checkpoint home (recorded resolved) now resolves elsewhere: its job swapped a
    directory on its path for a link (the plane then neither walks nor lists it)."""
    return _real(home) != os.path.abspath(home.removeprefix("file://"))


def _blocks(top: str) -> int:
    """Bytes on disk of the files under ``top``, never through a link (also one swapped in for ``top``)."""
    used = 0
    with contextlib.suppress(OSError):  # not there (yet), or removed meanwhile
        for _, _, files, dfd in os.fwalk(top):
            for f in files:
                with contextlib.suppress(OSError):
                    used += os.stat(f, dir_fd=dfd, follow_symlinks=False).st_blocks * 512
    return used


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path[len("file://"):] if path.startswith("file://") else path))


def _under(loc: str, prefix: str) -> bool:
    p = prefix.rstrip("/")
    return loc == p or loc.startswith(p + "/")


def overlaps(a: str, b: str) -> bool:
    return _under(a, b) or _under(b, a)


def locations(ck: Mapping[str, Any]) -> tuple[str | None, list[tuple[str, str, dict]]]:
    """(home, [(kind, location, options)]) of a checkpoint spec with ``url`` or ``tiers``; ValueError."""
    from tidal.ckpt.tiers.config import resolve

    if ck.get("tiers"):
        home, cfgs = resolve(ck["tiers"], default_keep=0)
        out = [(c.kind, c.location, dict(c.options)) for c in cfgs if c.kind != "shm"]
        for t in ck["tiers"]:  # an explicit namespace is refused here (resolve fills in the derived one)
            u = str(t.get("url", "") if isinstance(t, dict) else t)
            if u.startswith("peer://") or (isinstance(t, dict) and t.get("job") and (
                    t.get("kind") == "peer" or u.startswith("peer"))):
                raise ValueError("a peer tier's namespace is derived from the job's location; "
                                 "give 'peer' without a name")
        return home, out
    url = ck.get("url")
    if url is None:
        return None, []
    if url.startswith("s3://"):
        from tidal.ckpt.tiers.s3 import parse_s3_url

        bucket, prefix = parse_s3_url(url)
        loc = f"s3://{bucket}/{prefix}".rstrip("/")
        return loc, [("s3", loc, {})]
    if url == "peer" or url.startswith("peer://"):
        raise ValueError("a peer location needs a tier list: tiers: [shm, <directory>, peer]")
    from tidal.ckpt.tiers.directory import local_path

    loc = str(local_path(url))
    return loc, [("dir", loc, {})]


def check(ck: Mapping[str, Any], tenant: str, admin: bool, policy: LocationPolicy,
          others: Callable[[set[str]], Iterable[tuple[str, str, str, bool]]],
          job_location: Callable[[str], tuple[str, str, dict] | None]
          ) -> tuple[list[tuple[str, str]], dict, str | None]:
    """Check a spec's ``checkpoint`` for ``tenant``: ``(problems, checkpoint, location)`` with problems as
    (field, message), the checkpoint block as stored (``resume_from`` resolved) and the location to record
    (None: the default). ``others(locations)`` yields (job, tenant, location, ended) of the jobs whose
    location may overlap one of these (at least those that do); ``job_location(id)`` gives
    (tenant, state, checkpoint block) or None.
    """
    ck = dict(ck)
    resumed: str | None = None
    if ck.get("resume_from") is not None:
        rid = ck["resume_from"]
        got = job_location(rid)
        if got is None or got[0] != tenant:
            return [("checkpoint.resume_from", f"no job {rid} of tenant {tenant}")], ck, None
        _, state, src = got
        if state not in ("succeeded", "failed", "cancelled"):
            return [("checkpoint.resume_from", f"job {rid} is {state}: only an ended job's location can be "
                                               "taken over (cancel it first)")], ck, None
        ck.update({k: src[k] for k in ("url", "tiers") if src.get(k)})
        resumed = rid
    try:
        home, tiers = locations(ck)
    except (ValueError, OSError) as e:
        return [("checkpoint.tiers" if ck.get("tiers") else "checkpoint.url", str(e))], ck, None
    if home is None:
        return [], ck, None
    where = "checkpoint.tiers" if ck.get("tiers") else "checkpoint.url"
    problems: list[tuple[str, str]] = []
    prefixes = policy.prefixes(tenant)
    allowed = set(policy.endpoints)
    for kind, loc, opts in tiers if resumed is None else ():  # a location taken over was checked for its job
        if kind == "dir":
            real = _real(loc)
            if not admin and not any(not p.startswith("s3://") and _under(real, p) for p in prefixes):
                problems.append((where, f"{loc} is not under this tenant's checkpoint prefixes "
                                        f"({', '.join(prefixes) or 'none'}); ask the admin for a grant "
                                        "(checkpoint_grants)"))
        elif kind == "s3":
            if not admin and not any(p.startswith("s3://") and _under(loc, p) for p in prefixes):
                problems.append((where, f"{loc} is not under a prefix the admin granted this tenant "
                                        "(checkpoint_grants)"))
            ep = opts.get("endpoint") or "aws"
            if ep not in allowed:
                problems.append((where, f"S3 endpoint {ep!r} is not allowed (checkpoint_endpoints: "
                                        f"{sorted(allowed) or 'none'})"))
        elif kind == "peer":
            peers = opts.get("peers") or []
            named = [
                a for a in [opts.get("agent")] + (list(peers) if isinstance(peers, list | tuple) else [peers])
                if a is not None]
            if not named and not policy.own_agents:  # the ranks' own agent, from the executor: none here
                problems.append((where, "a peer tier without an agent uses the executor's checkpoint agents, "
                                        "and this plane runs none (tidal up --executor ray --ckpt-agents); "
                                        "name an allowed agent (checkpoint_endpoints) or drop the peer tier"))
            for a in named:
                if str(a) not in allowed:
                    problems.append((where, f"checkpoint agent {a} is not allowed (checkpoint_endpoints: "
                                            f"{sorted(allowed) or 'none'})"))
        for k in TIMEOUT_OPTIONS:
            v = opts.get(k)
            if v is not None and (
                not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v <= policy.max_timeout_s
            ):
                problems.append((where, f"{k} {v!r}: expected seconds in (0, {policy.max_timeout_s:g}] "
                                        "(checkpoint_max_timeout_s)"))
    if problems:
        return problems, ck, None
    found = _real(home) if not home.startswith(("s3://", "peer://")) else home
    if admin:  # the operator may point a job anywhere, at existing checkpoints too
        return [], ck, found
    mine = {_real(loc) if kind == "dir" else loc for kind, loc, _ in tiers}
    for jid, owner, loc, ended in others(mine):
        if jid == resumed:
            continue
        if any(overlaps(m, loc) for m in mine):
            if resumed is not None and owner == tenant and ended:
                continue  # an earlier job at the location it takes over, ended
            msg = (f"{home} is (or overlaps) the checkpoint location of another job; a job may only take "
                   "over the location of an ended job of its tenant: checkpoint: {resume_from: JOB}")
            return [(where, msg)], ck, None
    if resumed is None:
        for kind, loc, _ in tiers:
            if kind == "dir" and _holds_steps(loc):
                return [(where, f"{loc} already holds checkpoint steps of no job of this tenant; choose an "
                         "empty location (or resume_from the job that wrote them)")], ck, None
    return [], ck, found


def _holds_steps(loc: str) -> bool:
    from tidal.ckpt.format import manifest as mf

    try:
        return any(mf.parse_step_dirname(n) is not None for n in os.listdir(loc))
    except OSError:
        return False

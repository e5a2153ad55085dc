"""Tier configuration: the tier list a ``Checkpointer`` persists through and ``load`` reads from.

    ["shm", {"url": "/local/nvme/run1", "keep": 2}, {"url": "s3://bucket/run1", "every": 5}]

Entries, their options and the job's *home* (the first directory or S3 tier, else the first peer
tier's ``peer://NAME``) are described in docs/checkpoint.md, "Tiers". Everything is checked here,
and a malformed list is a ``TierSpecError`` naming the entry."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tidal.ckpt.errors import TierSpecError
from tidal.ckpt.tiers.directory import (
    DirTier,
    is_peer_url,
    is_s3_url,
    local_path,
    peer_job,
    shm_root_for,
    shm_tier_to_read,
    tiers_for,
)
from tidal.ckpt.tiers.protocol import Tier
from tidal.contract import ENV_JOB_ID

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_KINDS = ("shm", "dir", "s3", "peer")
_COMMON = ("url", "every", "keep", "name", "kind")
_DIR_OPTIONS = {"fsync": "fsync data and manifests (default: the Checkpointer's fsync)"}


@dataclass(frozen=True)
class TierSpec:
    """One entry of a tier list (see the module docstring for the meaning of each field)."""

    url: str
    every: int = 1
    keep: int | None = None
    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TierConfig:
    """A validated tier: its kind, unique name, schedule, retention and normalized location."""

    kind: str  # "shm" | "dir" | "s3" | "peer"
    name: str
    location: str  # "shm", an absolute directory path, s3://bucket/prefix, or peer://<namespace>
    every: int
    keep: int
    options: Mapping[str, Any]

    def due(self, save_index: int) -> bool:
        """Whether the ``save_index``-th save (0-based) of a Checkpointer is persisted here."""
        return save_index % self.every == 0


def _label(i: int, spec: Any) -> str:
    return f"tiers[{i}] {spec!r}"


def kind_of(url: str, where: str) -> str:
    """"shm", "dir", "s3" or "peer" for a tier URL; TierSpecError naming ``where`` when it is none of them."""
    if url == "shm":
        return "shm"
    if url == "peer" or url.startswith("peer://"):
        return "peer"
    if url.startswith("s3://"):
        return "s3"
    if url.startswith("file://"):
        return "dir"
    m = _SCHEME.match(url)
    if m and len(m.group(1)) > 1:  # (one letter would be a Windows drive)
        raise TierSpecError(f"{where}: unknown scheme '{m.group(1)}:'; expected s3://bucket/prefix, "
                            "file:///path, a directory path, 'shm' or 'peer'")
    if not url or ("/" not in url and not url.startswith(("~", "."))):
        raise TierSpecError(f"{where}: not a tier; expected 'shm', a directory (an absolute path, "
                            "./relative, ~/..., or file:///...), s3://bucket/prefix or 'peer'")
    return "dir"


def normalize(url: str, kind: str) -> str:
    if kind == "dir":
        return str(local_path(url))
    if kind == "s3":
        from tidal.ckpt.tiers.s3 import parse_s3_url

        bucket, prefix = parse_s3_url(url)
        return f"s3://{bucket}/{prefix}".rstrip("/")
    if kind == "peer":
        job = url[len("peer://"):] if url.startswith("peer://") else ""
        if job and not _JOB.match(job):
            raise TierSpecError(f"tier {url!r}: namespace {job!r} must be letters, digits, '.', '_' or '-'")
        return f"peer://{job}"  # "peer://": the namespace is derived from the job's home in resolve()
    return url


def parse_spec(spec: Any, i: int = 0) -> TierSpec:
    """One tier-list entry as a ``TierSpec``; TierSpecError naming the entry when malformed."""
    if isinstance(spec, TierSpec):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return TierSpec(os.fspath(spec))
    if isinstance(spec, Mapping):
        kind = spec.get("kind")
        if kind is not None and kind not in _KINDS:
            raise TierSpecError(f"{_label(i, spec)}: unknown kind {kind!r}; expected one of "
                                f"{', '.join(_KINDS)}")
        if "url" not in spec and kind in ("shm", "peer"):
            job = spec.get("job")
            spec = {**spec, "url": f"peer://{job}" if kind == "peer" and job else kind}
            spec.pop("job", None)
        where = _label(i, spec)
        if "url" not in spec:
            raise TierSpecError(f"{where}: a dict tier needs 'url' ('shm', 'peer', a directory or "
                                "s3://bucket/prefix)")
        if not isinstance(spec["url"], (str, os.PathLike)):
            raise TierSpecError(f"{where}: 'url' must be a string, got {type(spec['url']).__name__}")
        url = os.fspath(spec["url"])
        got = kind_of(url, where)
        if kind is not None and got != kind:
            raise TierSpecError(f"{where}: 'kind' is {kind!r} but 'url' {url!r} is a {got} tier")
        options = {k: v for k, v in spec.items() if k not in _COMMON}
        if got == "peer" and "job" in options:
            if url != "peer":
                raise TierSpecError(f"{where}: give the namespace once: 'peer://NAME' or 'job'")
            url = f"peer://{options.pop('job')}"
        return TierSpec(url, every=spec.get("every", 1), keep=spec.get("keep"), name=spec.get("name"),
                        options=options)
    raise TierSpecError(f"{_label(i, spec)}: expected a string ('shm', a directory, 's3://bucket/prefix'), "
                        f"a dict or a TierSpec; got {type(spec).__name__}")


def resolve(specs: Sequence[Any], *, default_keep: int, home: str | None = None,
            job_id: str | None = None) -> tuple[str, list[TierConfig]]:
    """Validate a tier list; return the job's home location and one ``TierConfig`` per tier.

    ``home``: the Checkpointer's url when one is given; it must then be the first non-shm tier.
    ``job_id``: the job's id, when not this process's ``TIDAL_JOB_ID`` (an executor asking for a rank).
    """
    if isinstance(specs, (str, os.PathLike, Mapping, TierSpec)) or not isinstance(specs, Sequence):
        raise TierSpecError(f"tiers must be a list, got {type(specs).__name__} {specs!r}")
    if not specs:
        raise TierSpecError("tiers is empty; expected e.g. ['shm', '/ckpt/run1', 's3://bucket/run1']")
    out: list[TierConfig] = []
    counts: dict[str, int] = {}
    for i, raw in enumerate(specs):
        spec = parse_spec(raw, i)
        where = _label(i, spec.url)
        kind = kind_of(spec.url, where)
        location = normalize(spec.url, kind)
        if not isinstance(spec.every, int) or isinstance(spec.every, bool) or spec.every < 1:
            raise TierSpecError(f"{where}: 'every' must be an integer >= 1 (persist every N-th save), "
                                f"got {spec.every!r}")
        keep = spec.keep
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 0):
            raise TierSpecError(f"{where}: 'keep' must be an integer >= 0 (0 keeps all), got {spec.keep!r}")
        if kind == "shm" and spec.keep is not None:
            raise TierSpecError(f"{where}: the shm tier keeps one step per staging slot; set "
                                "Checkpointer(slots=N) instead of 'keep'")
        _check_options(kind, spec.options, where)
        counts[kind] = counts.get(kind, 0) + 1
        default_name = {"shm": "shm", "dir": "disk", "s3": "s3", "peer": "peer"}[kind]
        name = spec.name or (default_name if counts[kind] == 1 else f"{default_name}-{counts[kind]}")
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9_.\-]+$", name):
            raise TierSpecError(f"{where}: 'name' must be letters, digits, '.', '_' or '-', got {name!r}")
        keep = default_keep if keep is None else keep
        out.append(TierConfig(kind, name, location, spec.every, keep, dict(spec.options)))
    names = [t.name for t in out]
    for n in names:
        if names.count(n) > 1:
            raise TierSpecError(f"tiers: two tiers are named {n!r}; give one a different 'name'")
    home = _home(out, home, job_id)
    out = [replace(t, location=f"peer://{peer_job(home)}") if t.location == "peer://" else t for t in out]
    locs = [t.location for t in out]
    for loc in locs:
        if locs.count(loc) > 1:
            raise TierSpecError(f"tiers: {loc!r} appears twice")
    return home, out


def _home(out: list[TierConfig], home: str | None, job_id: str | None = None) -> str:
    """The job's home location: ``home`` (a url given to the Checkpointer), else the first directory or
    S3 tier, else the first peer tier's ``peer://NAME`` (NAME defaulting to ``$TIDAL_JOB_ID``)."""
    durable = [t for t in out if t.kind in ("dir", "s3")]
    if home is not None:
        want = normalize(home, "s3" if is_s3_url(home) else "dir")  # any path, even a bare relative one
        if durable and durable[0].location != want:
            first = durable[0].location
            raise TierSpecError(f"url {home!r} must be the first non-shm tier of tiers, 'peer' aside (it "
                                f"names the job's shared memory directory), but that is {first!r}; pass "
                                "Checkpointer(tiers=[...]) without a url, or reorder")
        return want
    if durable:
        return durable[0].location
    peers = [t for t in out if t.kind == "peer"]
    if not peers:
        raise TierSpecError("tiers: a list of only 'shm' needs a url to name the job; add a directory or "
                            "s3://bucket/prefix tier, or pass url=")
    named = next((t.location for t in peers if t.location != "peer://"), None)
    if named is not None:
        return named
    job = _job_name(os.environ.get(ENV_JOB_ID, "") if job_id is None else job_id)
    if not job:
        raise TierSpecError("tiers: nothing names this job's checkpoints (no directory or S3 tier): use "
                            "'peer://NAME', set TIDAL_JOB_ID, or pass url=")
    return f"peer://{job}"


def _job_name(job_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]+", "-", job_id).strip("-.")


def peer_namespace(url: str | None, tiers: Sequence[Any] | None, job_id: str) -> str:
    """The namespace in the checkpoint agents of a job with checkpoint location ``url`` or tier list
    ``tiers`` (what its ranks' ``TIDAL_CKPT_URL`` / ``TIDAL_CKPT_TIERS`` say; ``tiers`` wins): the
    one its peer tier uses (``peer_job`` of its home), or ``job_id``'s when it names no location.
    The executor gives each rank the token of this namespace. ``TierSpecError`` if ``tiers`` is
    malformed."""
    if tiers:
        home = resolve(tiers, default_keep=0, job_id=job_id)[0]
    elif url:
        home = normalize(url, kind_of(url, "checkpoint url"))
    else:
        home = f"peer://{_job_name(job_id)}"
    return peer_job(home)


def _check_options(kind: str, options: Mapping[str, Any], where: str) -> None:
    from tidal.ckpt.tiers.peer import OPTIONS as PEER_OPTIONS
    from tidal.ckpt.tiers.s3 import OPTIONS as S3_OPTIONS

    allowed: dict[str, str] = {"dir": _DIR_OPTIONS, "s3": S3_OPTIONS, "peer": PEER_OPTIONS}.get(kind, {})
    for k in options:
        if k not in allowed:
            expected = ", ".join(list(_COMMON) + list(allowed))
            raise TierSpecError(f"{where}: unknown option {k!r}; expected one of: {expected}")


def build(cfg: TierConfig, home: str, *, fsync: bool = True) -> Tier:
    """The tier object for a validated config (S3 tiers are not contacted here: see ``Tier.check``)."""
    if cfg.kind == "shm":
        return DirTier(cfg.name, shm_root_for(home), fsync=False, kind="shm")
    if cfg.kind == "dir":
        return DirTier(cfg.name, cfg.location, fsync=bool(cfg.options.get("fsync", fsync)))
    if cfg.kind == "peer":
        from tidal.ckpt.tiers.peer import PeerTier

        return PeerTier(cfg.location[len("peer://"):], name=cfg.name, **dict(cfg.options))
    from tidal.ckpt.tiers.s3 import S3Tier

    try:
        return S3Tier(cfg.location, name=cfg.name, **dict(cfg.options))
    except TypeError as e:
        raise TierSpecError(f"tier {cfg.location!r}: {e}") from None


def read_tiers(url_or_tiers: Any) -> list[Tier]:
    """Tiers to read from, fastest first: a location's shm tier (when this node has one) and itself, or
    the tiers of a tier list (shm when present)."""
    if isinstance(url_or_tiers, (str, os.PathLike)):
        return tiers_for(url_or_tiers)
    home, cfgs = resolve(url_or_tiers, default_keep=0)
    out: list[Tier] = []
    for c in cfgs:
        if c.kind == "shm":
            if (tier := shm_tier_to_read(home, c.name)) is not None:
                out.append(tier)
            continue
        out.append(build(c, home))
    return out


def describe(url_or_tiers: Any) -> str:
    """A short name for messages: the location, or the tier locations joined with ' + '."""
    if isinstance(url_or_tiers, (str, os.PathLike)):
        s = os.fspath(url_or_tiers)
        return s if is_s3_url(s) or is_peer_url(s) else str(local_path(s))
    try:
        return " + ".join(parse_spec(t, i).url for i, t in enumerate(url_or_tiers))
    except TierSpecError:
        return repr(url_or_tiers)

"""Names and places of a plane's objects on a Ray cluster (:mod:`tidal.exec.ray_exec`): its namespace,
its rank actors' and placement groups' names (and back to the job, matched whole, never by prefix),
where ranks keep node memory, the variables of an attempt across nodes, and the rank processes
recorded under a state dir (for tests and clean-up on a one-machine cluster)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidal import contract as c
from tidal.exec import procs
from tidal.exec.files import read_json
from tidal.exec.protocol import LaunchError


def namespace_for(root: str | os.PathLike) -> str:
    """The Ray namespace of the plane whose jobs live in ``root`` (two planes on one cluster never meet)."""
    return f"tidal-{hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:12]}"


def shm_base(namespace: str, shm_dir: str | None = None) -> Path | None:
    """Where ranks of this plane keep their node-memory checkpoint tier on each node: ``TIDAL_SHM_DIR`` =
    ``<base>/<node>/<job>`` (``/dev/shm/tidal-ray-<namespace>`` unless ``isolation.shm_dir``); None
    without ``/dev/shm``. The node's name is in the path so that nodes sharing one machine (a test
    cluster) keep apart what separate machines would."""
    if shm_dir is not None:
        return Path(shm_dir)
    return Path(f"/dev/shm/tidal-ray-{namespace}") if Path("/dev/shm").is_dir() else None


def _tier_list(raw: str) -> Any:
    """``TIDAL_CKPT_TIERS`` as the runtime reads it: JSON, else comma-separated names."""
    try:
        return json.loads(raw)
    except ValueError:
        return [t.strip() for t in raw.split(",")]


def agent_namespace(env: Mapping[str, str], job_id: str) -> str:
    """A job's namespace in the checkpoint agents, from its variables (``TIDAL_CKPT_TIERS``, else
    ``TIDAL_CKPT_URL``), as its runtime's peer tier derives it; the job id's when they are malformed
    (the runtime then fails on them itself)."""
    from tidal.ckpt.errors import CheckpointError
    from tidal.ckpt.tiers.config import peer_namespace

    raw = env.get(c.ENV_CKPT_TIERS)
    tiers = _tier_list(raw) if raw else None
    try:
        return peer_namespace(env.get(c.ENV_CKPT_URL) or None, tiers if isinstance(tiers, list) else None,
                              job_id)
    except (CheckpointError, ValueError, TypeError):
        return peer_namespace(None, None, job_id)


def across_nodes(env: Mapping[str, str]) -> dict[str, str]:
    """The job's variables for an attempt that spans nodes: no node-memory checkpoint tier. The
    engine's commit protocol meets all ranks in one tier, and a node's memory holds only its own
    ranks' files (a tier across nodes' memory is the peer agents' job): ``TIDAL_CKPT_URL`` becomes a
    ``TIDAL_CKPT_TIERS`` of that location alone, and ``shm`` leaves a tier list. ``LaunchError`` when
    nothing durable is left."""
    out = dict(env)
    url = out.pop(c.ENV_CKPT_URL, None)
    raw = out.get(c.ENV_CKPT_TIERS)
    if raw:
        tiers = _tier_list(raw)
        if not isinstance(tiers, list):
            return dict(env)  # the runtime reports the malformed value
        kept = [t for t in tiers if t != "shm" and not (isinstance(t, dict) and t.get("url") == "shm")]
        if not kept:
            raise LaunchError(f"{c.ENV_CKPT_TIERS}={raw}: a job across nodes needs a tier other than node "
                              "memory (shm)")
        out[c.ENV_CKPT_TIERS] = json.dumps(kept)
        if url is not None:
            out[c.ENV_CKPT_URL] = url
    elif url:
        out[c.ENV_CKPT_TIERS] = json.dumps([url])
    return out


def actor_name(job_id: str, attempt: int, rank: int) -> str:
    return f"tidal.{job_id}.a{attempt}.r{rank}"


def _pg_name(namespace: str, job_id: str, attempt: int) -> str:
    return f"{namespace}.{job_id}.a{attempt}"


_ACTOR_RE = re.compile(r"^tidal\.(?P<job>.+)\.a(?P<attempt>\d+)\.r\d+$")


def attempt_of_actor(name: str) -> tuple[str, int] | None:
    """The (job, attempt) a rank actor's name (:func:`actor_name`) belongs to; job names may hold dots:
    matched whole, never by prefix."""
    m = _ACTOR_RE.match(name)
    return (m.group("job"), int(m.group("attempt"))) if m else None


def attempt_of_pg(namespace: str, name: str) -> tuple[str, int] | None:
    """The (job, attempt) of a placement group named by :func:`_pg_name` in ``namespace``."""
    m = re.match(rf"^{re.escape(namespace)}\.(?P<job>.+)\.a(?P<attempt>\d+)$", name)
    return (m.group("job"), int(m.group("attempt"))) if m else None


def rank_pids(root: str | os.PathLike) -> list[int]:
    """Every rank pid recorded under ``root`` (``pid-<r>.json``), for tests on a one-machine cluster."""
    out = []
    for p in Path(root).glob(f"*/{c.attempt_dirname('*')}/pid-*.json"):
        doc = read_json(p)
        if doc and isinstance(doc.get("pid"), int):
            out.append(doc["pid"])
    return out


def kill_ranks(root: str | os.PathLike) -> int:
    """SIGKILL the process group of every recorded rank still running on this machine; how many."""
    n = 0
    for pid in rank_pids(root):
        if procs.alive(pid):
            procs.kill_group(pid)
            n += 1
    return n

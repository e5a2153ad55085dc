"""What the checkpoint agents hold of jobs (the peer tier), seen and freed from the control plane.

    held_jobs(addresses)            # namespace -> the agents holding a step of it
    free_job(addresses, namespace)  # every step of it removed at every agent (each forwards to its buddy)

A job's steps in the agents are named by its peer namespace (``tidal.ckpt.tiers.peer``: derived from
the job's checkpoint location), not by its id. The plane's sweep (``tidal.control.node_memory``) maps
namespaces to the jobs whose tiers name them and frees those of ended jobs. An agent that does not
answer is skipped: what it holds is freed at a later sweep (its buddy may meanwhile get it back by
resync, and is freed again). Standard library and the agents' HTTP client only.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Iterable

from tidal.ckpt.agent.store import step_dirname
from tidal.ckpt.tiers.peer import AgentClient

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # one request to one agent (the plane's loop waits for it)


def _client(address: str, token: str | None) -> AgentClient:
    return AgentClient(address, timeout_s=TIMEOUT_S, connect_timeout_s=0.5, token=token)


def held_jobs(addresses: Iterable[str], token: str | None = None) -> dict[str, list[str]]:
    """Namespace -> the agents (of ``addresses`` that answered) holding a step of it, in any tree.
    ``token``: the agents' token (``tidal.ckpt.agent.auth``); agents with a key list no steps without it."""
    out: dict[str, list[str]] = {}
    for a in addresses:
        c = _client(a, token)
        try:
            rows = c.json("GET", "/status").get("steps") or []
        except (OSError, ValueError) as e:
            log.info("checkpoint agent %s: %s", a, e)
            continue
        finally:
            c.drop()
        for ns in sorted({r["job"] for r in rows if isinstance(r, dict) and isinstance(r.get("job"), str)}):
            out.setdefault(ns, []).append(a)
    return out


def free_job(addresses: Iterable[str], namespace: str, token: str | None = None) -> int:
    """Remove every step of ``namespace`` at every agent that answers; the steps removed (a step held
    by two agents counts twice). ``token``: as for :func:`held_jobs`."""
    path = f"/v1/jobs/{urllib.parse.quote(namespace, safe='')}"
    removed = 0
    for a in addresses:
        c = _client(a, token)
        try:
            for s in sorted(int(s) for s in c.json("GET", path)["steps"]):
                status, _ = c.request("DELETE", f"{path}/{step_dirname(s)}")
                removed += status == 200
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("checkpoint agent %s: freeing %s: %s", a, namespace, e)
        finally:
            c.drop()
    return removed

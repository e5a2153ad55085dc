"""What the checkpoint agents hold of jobs (the peer tier), seen (:func:`held_jobs`) and freed
(:func:`free_job`) from the control plane, by the job's peer namespace (``tidal.ckpt.tiers.peer``), not
its id. An agent that does not answer is skipped: a later sweep frees what it holds.
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

"""A node of a local Ray cluster lost as a machine is lost, every process at one instant (Ray's
``remove_node`` alone lets its ranks go on for a moment), and what the other nodes hold of a job's
checkpoints then: :func:`kill_when_peer_newest` kills only when the surviving agents hold the newest step."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidal.ckpt.format import manifest as mf
from tidal.exec import procs

log = logging.getLogger(__name__)

SETTLE_S = 0.3  # after the freeze: what the other nodes' ranks were writing lands (or cannot any more)
AGENT_TIMEOUT_S = 2.0  # one listing of a surviving agent


def node_pids(node: Any) -> list[int]:
    """Ray's own processes of one node of a ``ray.cluster_utils.Cluster`` (its raylet, ...); the workers,
    and what they start, run below them."""
    return [i.process.pid for infos in getattr(node, "all_processes", {}).values() for i in infos
            if getattr(i, "process", None) is not None]


def freeze_node(node: Any) -> list[int]:
    """Stop every process of ``node`` dead (SIGSTOP over its process tree); the pids stopped."""
    return procs.freeze(node_pids(node))


def kill_node(cluster: Any, node: Any, frozen: Sequence[int] | None = None) -> None:
    """The machine is gone: every process of ``node`` (``frozen``, or frozen now) SIGKILLed and gone, then
    ``cluster.remove_node``."""
    left = procs.kill_all(freeze_node(node) if frozen is None else frozen)
    if left:
        log.warning("processes %s of a killed Ray node are still there (stopped, killed)", left)
    cluster.remove_node(node, allow_graceful=False)


@dataclass(frozen=True)
class TierSteps:
    """One tier as seen now: its newest committed step (None: none), and whether a newer step is being
    written there (files of it, no manifest yet)."""

    committed: int | None
    writing: bool


def tier_steps(home: str, agents: Sequence[str], token: str | None = None) -> dict[str, TierSteps]:
    """The job's tiers: "disk" (directory ``home``) and "peer" as the ``agents`` (host:port, asked with
    ``token``) alone see it; a tier that cannot be listed is left out."""
    from tidal.ckpt.tiers.config import read_tiers
    from tidal.ckpt.tiers.peer import PeerTier

    disk = read_tiers([home])[0]
    tiers = [disk]
    if agents:
        peer = read_tiers(["peer", home])[0]
        assert isinstance(peer, PeerTier)
        # No local agent: its buddy (perhaps the lost node's) is never asked.
        tiers.insert(0, PeerTier(peer.job, name="peer", agent=None, peers=list(agents), token=token,
                                 timeout_s=AGENT_TIMEOUT_S, connect_timeout_s=AGENT_TIMEOUT_S / 4))
    out = {}
    for t in tiers:
        try:
            files = t.step_files()
        except OSError:
            continue
        done = [s for s, names in files.items() if mf.MANIFEST in names]
        newest = max(done, default=None)
        out[t.name] = TierSteps(newest, any(s > (newest if newest is not None else -1)
                                            for s, names in files.items() if mf.MANIFEST not in names))
    return out


def peer_newest(held: dict[str, TierSteps], strict: bool = True) -> bool:
    """Whether the peer tier holds the newest committed step - newer than the disk's, or (not ``strict``)
    at least as new: a restore then reads it from the agents too, the faster tier - with nothing newer
    being written in either."""
    peer, disk = held.get("peer"), held.get("disk")
    if peer is None or peer.committed is None or peer.writing or (disk is not None and disk.writing):
        return False
    if disk is None or disk.committed is None:
        return True
    return peer.committed > disk.committed if strict else peer.committed >= disk.committed


def worth_a_look(reported: dict[str, Any], looked: int | None, strict: bool = True) -> int | None:
    """A look stops the job too, so look only when it is likely to succeed: the job's newest peer step
    when its progress (``tiers``: tier -> [step, time]) reports one newer than its disk's (not
    ``strict``: as new), other than ``looked`` (the one of the last look); else None."""
    peer = (reported.get("peer") or [None])[0]
    held = {t: TierSteps(v[0], False) for t, v in reported.items() if v}
    return peer if peer != looked and peer_newest(held, strict) else None


def kill_when_peer_newest(cluster: Any, node: Any, home: str, agents: Sequence[str], *, force: bool = False,
                          strict: bool = True, settle_s: float = SETTLE_S,
                          token: str | None = None) -> dict[str, TierSteps] | None:
    """Freeze ``node``; after ``settle_s``, if the surviving ``agents`` hold the job's newest step
    (:func:`peer_newest`) or ``force``: kill it and return what the tiers held; else thaw it (None)."""
    frozen = freeze_node(node)
    try:
        time.sleep(settle_s)
        held = tier_steps(home, agents, token)
    except BaseException:
        procs.thaw(frozen)
        raise
    if not (force or peer_newest(held, strict)):
        procs.thaw(frozen)
        return None
    kill_node(cluster, node, frozen)
    return held

"""A real multi-node Ray cluster on this machine for the Ray executor's tests (``ray.cluster_utils.Cluster``).

One per test process (``ray_cluster`` in conftest.py; two at once under pytest-xdist), started on first use
(~5-15 s on 2 busy cores): a head node with no GPUs and three worker nodes with declared (virtual) GPUs,
labelled for Tidal ``n1`` (2 GPUs), ``n2`` (1) and ``n3`` (1), one CPU each, with Ray's token authentication
(a fresh token in a 0600 file named by ``RAY_AUTH_TOKEN_PATH`` in this process's environment;
``tidal.exec.ray_auth``). Ray's health checks are tightened (a node that stops answering is dead after ~3 s
instead of ~30 s) so node-loss tests are quick; nothing calls the network (usage stats off, no dashboard).
At the end: ``ray.shutdown()``, ``cluster.shutdown()``, every rank recorded under the tests' state dirs
SIGKILLed, their node-memory directories removed, and a check that no raylet or GCS started here is left.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.contract import RAY_AUTH_TOKEN_PATH_ENV
from tidal.demo.node_loss import kill_node, node_pids
from tidal.exec import procs
from tidal.exec.ray_auth import enable_local
from tidal.exec.ray_exec import NODE_LABEL, QUIET_ENV, kill_ranks, namespace_for, shm_base

NODES = {"n1": 2, "n2": 1, "n3": 1}
HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 4}


@dataclass
class RayCluster:
    cluster: Any
    nodes: dict[str, Any] = field(default_factory=dict)  # Tidal name -> ray node handle
    state_roots: list[Path] = field(default_factory=list)  # jobs dirs whose ranks are killed at the end
    token_file: Path | None = None  # Ray's token (0600, in a 0700 directory of its own)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(num_cpus=1, num_gpus=NODES[name], labels={NODE_LABEL: name},
                                                 include_dashboard=False)

    def remove(self, name: str, graceful: bool = False) -> None:
        """The node goes. Non-graceful: as a machine is lost, every process on it (Ray's, the ranks', the
        checkpoint agent's) is SIGKILLed at one instant (``kill_node``); Ray's health checks notice."""
        node = self.nodes.pop(name)
        if graceful:
            self.cluster.remove_node(node, allow_graceful=True)
        else:
            kill_node(self.cluster, node)

    def restore(self) -> None:
        """Every node of ``NODES`` back (a test that removed one and failed before adding it again)."""
        for name in NODES:
            if name not in self.nodes:
                self.add(name)

    def pids(self) -> list[int]:
        """Ray's own processes of every node of this cluster (raylets, GCS, ...)."""
        return [p for node in [self.cluster.head_node, *self.cluster.worker_nodes] for p in node_pids(node)]


def start() -> RayCluster:
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    enable_local(Path(tempfile.mkdtemp(prefix="tidal-ray-auth-")))  # the cluster refuses clients without it
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "_system_config": HEALTH},
    )
    rc = RayCluster(c, token_file=Path(os.environ[RAY_AUTH_TOKEN_PATH_ENV]))
    for name in NODES:
        rc.add(name)
    c.wait_for_nodes()
    return rc


def held(timeout_s: float = 60.0) -> list[str]:
    """Empty once every GPU of the cluster is free again (an ended test's placement groups and actors are
    released asynchronously); else, after ``timeout_s``, what still holds GPUs: each placement group not
    removed and each rank actor alive, by name. The cluster's nodes are all expected present."""
    import ray

    deadline = time.monotonic() + timeout_s
    total = sum(NODES.values())
    while True:
        if ray.cluster_resources().get("GPU", 0.0) == ray.available_resources().get("GPU", 0.0) == total:
            return []
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = [f"placement group {info.get('name')!r} ({info.get('state')})"
           for info in ray.util.placement_group_table().values() if info.get("state") != "REMOVED"]
    out += [f"actor {a.get('namespace')}/{a.get('name')}"
            for a in ray.util.list_named_actors(all_namespaces=True)
            if str(a.get("name", "")).startswith("tidal.")]
    return out or [f"GPUs: {ray.available_resources().get('GPU', 0.0):g} free of "
                   f"{ray.cluster_resources().get('GPU', 0.0):g} (nothing named holds them)"]


def clear() -> None:
    """Remove every placement group and kill every rank actor of the cluster (what a failed test left)."""
    import contextlib

    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for a in ray.util.list_named_actors(all_namespaces=True):
        if str(a.get("name", "")).startswith("tidal."):
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("state") != "REMOVED":
            with contextlib.suppress(Exception):
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))


def stop(rc: RayCluster) -> None:
    import ray

    pids = rc.pids()
    try:
        ray.shutdown()
    finally:
        rc.cluster.shutdown()
        for root in rc.state_roots:
            kill_ranks(root)
            shm = shm_base(namespace_for(root))
            if shm is not None:
                shutil.rmtree(shm, ignore_errors=True)
        if rc.token_file is not None:
            shutil.rmtree(rc.token_file.parent, ignore_errors=True)
    deadline = time.monotonic() + 10
    while any(procs.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if procs.alive(p)]
    assert not left, f"Ray processes left behind: {left}"

"""A Ray cluster on this machine for the Ray demos: a head and GPU nodes with declared GPUs, nodes lost
and added by Tidal node name; and stdout kept for the summary while Ray prints on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NODES = {"n1": 2, "n2": 1, "n3": 1}
HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 4}


class LocalRayCluster:
    """A head and GPU nodes (``nodes``: Tidal name -> declared GPUs) on this machine, with Ray's token
    authentication; ``remove``/``add`` by Tidal node name."""

    def __init__(self, nodes: dict[str, int] | None = None) -> None:
        from tidal.exec.ray_auth import enable_local
        from tidal.exec.ray_exec import NODE_LABEL, QUIET_ENV

        for k, v in QUIET_ENV.items():
            os.environ.setdefault(k, v)
        self._auth_dir = Path(tempfile.mkdtemp(prefix="tidal-ray-auth-"))
        enable_local(self._auth_dir)  # the cluster refuses clients without its token (docs/control.md)
        from ray.cluster_utils import Cluster

        self._label = NODE_LABEL
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "_system_config": HEALTH})
        self.gpus = dict(nodes or NODES)
        self.nodes: dict[str, Any] = {}
        for name in self.gpus:
            self.add(name)
        self.cluster.wait_for_nodes()

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(
            num_cpus=1, num_gpus=self.gpus[name], labels={self._label: name}, include_dashboard=False)

    def remove(self, name: str) -> None:
        """The node is lost as a machine is: every process on it SIGKILLed at one instant (Ray's, the
        ranks', its checkpoint agent's; :func:`tidal.demo.node_loss.kill_node`)."""
        from tidal.demo.node_loss import kill_node

        kill_node(self.cluster, self.nodes.pop(name))

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self._auth_dir, ignore_errors=True)


@contextlib.contextmanager
def stdout_to_stderr(on: bool = True) -> Iterator[None]:
    """File descriptor 1 goes to 2 meanwhile (for ``--json``: stdout carries the summary alone)."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)

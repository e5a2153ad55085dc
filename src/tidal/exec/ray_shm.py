"""Node memory on Ray nodes: which jobs keep a shared-memory directory on each node, and freeing them.

The plane cannot see another machine's ``/dev/shm``, so each question is a small Ray task pinned to each
node (not soft; no CPU reserved, so a busy node still answers), all nodes at once. A listing not answered
within ``CALL_TIMEOUT_S`` is cancelled (asked again at the next sweep); a removal is left to finish.
Called by :class:`~tidal.exec.ray_exec.RayExecutor` (the ``NodeMemory`` protocol) from the sweep.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0  # one sweep waits this long at most for the nodes' answers


def _list(node_dir: str) -> list[str]:
    """On the node: the job directories under ``node_dir`` (never following a symbolic link)."""
    try:
        return sorted(
            e.name for e in os.scandir(node_dir) if e.is_dir(follow_symlinks=False) and e.name != "agent"
        )
    except OSError:
        return []


def _free(job_dir: str) -> bool:
    """On the node: remove ``job_dir`` if it is a real directory; True if it was there."""
    p = Path(job_dir)
    if p.is_symlink() or not p.is_dir():
        return False
    shutil.rmtree(p, ignore_errors=True)
    return True


@functools.cache
def _remote(ray: Any, fn: Any) -> Any:
    """``fn`` as a Ray remote function, made once per process (not at every sweep)."""
    return ray.remote(fn)


def run_on_nodes(ray: Any, nodes: Mapping[str, str], fn: Any, args: Mapping[str, tuple],
                 cancel_late: bool, timeout_s: float = CALL_TIMEOUT_S) -> tuple[dict[str, Any], list[str]]:
    """``fn(*args[node])`` as a task on each node in ``args`` (name -> Ray node id in ``nodes``), all at
    once: (the answers that came back within ``timeout_s`` in all, the nodes still working).
    ``cancel_late``: cancel what has not answered (a listing; a removal is left to finish)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = _remote(ray, fn)
    refs = {name: task.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        nodes[name], soft=False)).remote(*a) for name, a in args.items() if name in nodes}
    if not refs:
        return {}, []
    done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    finished = {r.hex() for r in done}
    out: dict[str, Any] = {}
    late: list[str] = []
    for name, ref in refs.items():
        if ref.hex() not in finished:
            late.append(name)
            log.warning("%s on %s: no answer within %g s", fn.__name__, name, timeout_s)
            if cancel_late:
                ray.cancel(ref, force=True)
            continue
        try:
            out[name] = ray.get(ref)
        except Exception as e:  # the node went away meanwhile: the next sweep
            log.warning("%s on %s: %s", fn.__name__, name, type(e).__name__)
    return out, late


def shm_jobs(ray: Any, nodes: Mapping[str, str], base: Path) -> dict[str, list[str]]:
    """Job -> the nodes (names) where it has a node-memory directory, over the alive ``nodes`` that
    answered (the others are asked again at the next sweep)."""
    answers, _ = run_on_nodes(ray, nodes, _list, {n: (str(base / n),) for n in nodes}, cancel_late=True)
    out: dict[str, list[str]] = {}
    for node, jobs in sorted(answers.items()):
        for job in jobs:
            out.setdefault(job, []).append(node)
    return out


def free(ray: Any, nodes: Mapping[str, str], base: Path, job_id: str, where: list[str]) -> bool:
    """Remove ``job_id``'s node-memory directory on each node of ``where``: True if one was there, or a
    node is still at it (its removal runs to the end; the next listing shows what is left)."""
    answers, late = run_on_nodes(ray, nodes, _free, {n: (str(base / n / job_id),) for n in where},
                                  cancel_late=False)
    return any(answers.values()) or bool(late)

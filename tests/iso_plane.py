"""A control plane built in-process (``server.build``) under /tmp and driven step by step, for the
isolation tests (one place): ``planes`` makes them, ``run`` steps the reconcile loop until jobs end,
``rank_log`` reads a rank's log. Jobs run as their own uids when the tests run as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tidal.control.config import ControlConfig
from tidal.control.server import Plane, build
from tidal.exec.isolation import DEFAULT_UID_BASE, PLANE_RANGES, UID_SPAN, IsolationConfig

ROOT = os.geteuid() == 0
TERMINAL = ("succeeded", "failed", "cancelled")
PY = "/usr/bin/python3"  # a plain Python other uids can run (this project's venv may lie under /root)
SRC = Path(__file__).resolve().parents[1] / "src"


def worker_uid_base(k: int = 0) -> int:
    """The ``k``-th range of :data:`UID_SPAN` uids of this pytest worker alone (``make test`` runs several at
    once): above every range a plane picks by default, so two tests running at once never share a uid (a
    checkpoint hand-over refuses while any process of the earlier uid runs, whichever test started it)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return DEFAULT_UID_BASE + UID_SPAN * (PLANE_RANGES + 4 * (int(worker) if worker.isdigit() else 0) + k)


def config(**iso) -> ControlConfig:
    return ControlConfig(loop_interval_s=0.1, restart_backoff_s=0.1, isolation=IsolationConfig(**iso))


@contextmanager
def planes() -> Iterator[Callable[..., Plane]]:
    """``make(ray=None, **isolation)``: a plane with a state dir under a fresh 0711 directory in /tmp (other
    uids pass through it; pytest's tmp dirs lie under a 0700 one), on the local executor, or with ``ray`` (the
    ``ray_cluster`` fixture) the Ray executor on that cluster; all are stopped and removed at the end."""
    base = Path(tempfile.mkdtemp(prefix="tidal-iso-"))
    base.chmod(0o711)
    made: list[Plane] = []

    def make(ray=None, **iso) -> Plane:
        iso.setdefault("shm_dir", str(base / "shm"))
        state = base / "state"
        if ray is None:
            p = build(state, "2", None, config(**iso))
        else:
            ray.state_roots.append(state / "jobs")  # its ranks killed at the cluster's end, whatever happens
            p = build(state, "auto", None, config(**iso), executor="ray", ray_address=ray.address)
        p.controller.recover(time.time())
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            for job_id in list(p.executor._jobs):
                p.executor.kill(job_id)
                p.executor.release(job_id)
            p.store.close()
            p.executor.close()  # the local one: this process is no longer a subreaper
        shutil.rmtree(base, ignore_errors=True)


def run(plane: Plane, *job_ids: str, timeout_s: float = 60) -> None:
    """Step the plane until every job in ``job_ids`` has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plane.controller.step(time.time())
        if all(plane.store.job(j).state in TERMINAL for j in job_ids):
            return
        time.sleep(0.05)
    raise AssertionError({j: (plane.store.job(j).state, plane.store.job(j).message) for j in job_ids})


def rank_log(plane: Plane, job_id: str, rank: int = 0) -> str:
    return Path(plane.executor.log_path(job_id, rank)).read_text()


def plain_python_reaches_src(uid: int = 200999) -> str | None:
    """None when :data:`PY` run as ``uid`` imports this checkout's ``tidal`` (standard library parts);
    else why not (no such Python, or the checkout lies where other uids cannot read it)."""
    if not os.access(PY, os.X_OK):
        return f"no {PY}"
    out = subprocess.run([PY, "-I", "-c", f"import sys; sys.path.insert(0, {str(SRC)!r}); "
                          "import tidal.ckpt.tiers.directory"],
                         user=uid, group=uid, extra_groups=[], capture_output=True, text=True)
    return None if out.returncode == 0 else f"uid {uid} cannot import {SRC} with {PY}: {out.stderr[-200:]}"

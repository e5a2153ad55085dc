"""A memory limit per rank (``isolation.max_memory_bytes``) through the kernel's memory cgroup, v2 or v1:
``<own cgroup>/tidal-<hash of the jobs dir>/<job>-a<attempt>-r<rank>``, made and removed by its shim."""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
MIN_MEMORY_BYTES = 64 * 2**20  # below this a Python interpreter cannot even start


@dataclass(frozen=True)
class MemoryCgroups:
    """Where this plane's rank cgroups go: ``root`` (one directory per plane) of version ``version``."""

    version: int  # 1 or 2
    root: Path

    def rank_dir(self, job_id: str, attempt: int, rank: int) -> Path:
        return self.root / f"{job_id}-a{attempt}-r{rank}"


def _own_path(controller: str, proc_cgroup: str) -> str | None:
    """This process's cgroup path for ``controller`` ("": the v2 unified hierarchy)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (controller in parts[1].split(",") if controller else parts[1] == ""):
            return parts[2]
    return None


def find(jobs_dir: Path, fs: Path = CGROUP_FS) -> MemoryCgroups:
    """The memory cgroups of this plane, created; ``ValueError`` saying why there are none."""
    try:
        proc = Path("/proc/self/cgroup").read_text()
    except OSError as e:
        raise ValueError(
            f"isolation.max_memory_bytes: cannot read /proc/self/cgroup ({e.strerror})"
        ) from None
    name = "tidal-" + hashlib.sha256(str(jobs_dir.resolve()).encode()).hexdigest()[:12]
    tried = []
    candidates = []
    v2 = _own_path("", proc)
    for base in (fs, fs / "unified"):
        if v2 is not None and (base / "cgroup.controllers").is_file():
            candidates.append((2, base / v2.lstrip("/")))
    v1 = _own_path("memory", proc)
    if v1 is not None:
        candidates.append((1, fs / "memory" / v1.lstrip("/")))
    for version, own in candidates:
        if version == 2:
            try:
                if "memory" not in (own / "cgroup.controllers").read_text().split():
                    tried.append(f"{own}: no memory controller")
                    continue
            except OSError as e:
                tried.append(f"{own}: {e.strerror}")
                continue
        root = own / name
        try:
            root.mkdir(exist_ok=True)
            if version == 2:  # memory for root (from own), then for the rank cgroups below root
                if "memory" not in (root / "cgroup.controllers").read_text().split():
                    (own / "cgroup.subtree_control").write_text("+memory")
                (root / "cgroup.subtree_control").write_text("+memory")
        except OSError as e:
            tried.append(f"{root}: {e.strerror}")
            continue
        return MemoryCgroups(version, root)
    why = "; ".join(tried) or "no memory cgroup is mounted"
    raise ValueError(f"isolation.max_memory_bytes needs a memory cgroup this user may create ({why})")


def members(d: Path) -> list[int]:
    """The pids in the cgroup ``d`` (none when it is gone)."""
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove_empty(groups: MemoryCgroups) -> None:
    """Remove rank cgroups left empty (by shims that were killed), then nothing else."""
    try:
        entries = list(groups.root.iterdir())
    except OSError:
        return
    for d in entries:
        if d.is_dir():
            with contextlib.suppress(OSError):  # still has processes (a running rank)
                os.rmdir(d)

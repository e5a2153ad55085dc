"""Atomicity under SIGKILL: a save torn at any moment is invisible, the previous commit stays loadable.

A worker (tests/workers/kill_worker.py; 1 process, or 2 gloo ranks) commits step 1 and then saves
steps 2, 3, ... back to back, 16 MiB each, every element equal to the step. The test kills a rank
with SIGKILL at a seeded random moment after it announces a save - scaled by how long a save took
there, so the kills land in different phases (staging, checksums, shm link, disk write, commit,
cleanup) - then checks from this process that

* every step ``ckpt.steps`` lists loads whole and holds that step's values, the last step the
  worker saw committed is among them, and no step beyond the one in flight appears;
* without the shm tier (TIDAL_SHM_DIR pointing elsewhere, or the shm directory deleted as by a
  node reboot) the newest disk step loads correctly;
* a fresh Checkpointer's next save cleans up: no step directory without manifest.json and no
  ``.part`` file remains, and committed steps hold only their manifest and data files.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from dist_harness import WORKERS_DIR, Launch
from tidal import ckpt
from tidal.ckpt.tiers.directory import shm_root_for

pytestmark = pytest.mark.slow

MIB = 16

_spec = importlib.util.spec_from_file_location("kill_worker", WORKERS_DIR / "kill_worker.py")
assert _spec is not None and _spec.loader is not None
kill_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kill_worker)

# (ranks, seed, where in a save to aim the kill, as a fraction of a measured save's duration)
SCENARIOS = [(1, 0, 0.0), (1, 1, 0.3), (1, 2, 0.6), (1, 3, 0.9), (2, 4, 0.15), (2, 5, 0.75)]


def full_state() -> dict:
    return kill_worker.make_state(MIB, 0, 1)


def check_step(d: Path, step: int | None) -> int:
    """Load ``step`` (newest if None) into a fresh full state; assert every value equals the step."""
    state = full_state()
    kill_worker.fill(state, -1)
    got = ckpt.load(d, state, step=step)
    assert step is None or got == step
    assert state["step"] == got, f"step {got}: extra value {state['step']}"
    big = state["big"].tensor
    assert torch.equal(big, torch.full_like(big, got)), f"step {got}: 'big' does not hold {got} everywhere"
    for k, t in state["small"].items():
        assert torch.equal(t, torch.full_like(t, got)), f"step {got}: small/{k} = {t}"
    return got


def step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.exists() else []


def snapshot(d: Path, shm_root: Path) -> str:
    """What the kill left, for messages: per tier, each step as committed or torn (with its files)."""
    parts = []
    for name, root in (("disk", d), ("shm", shm_root)):
        items = []
        for sd in step_dirs(root):
            step = int(sd.name[5:])
            if (sd / "manifest.json").exists():
                items.append(str(step))
            else:
                items.append(f"{step} TORN[{','.join(sorted(p.name[:3] + p.suffix for p in sd.iterdir()))}]")
        parts.append(f"{name}: {' '.join(items) or '-'}")
    return "; ".join(parts)


def printed_steps(launch: Launch, word: str) -> list[int]:
    """N of every "<word> N" line any rank printed."""
    out = []
    for r in range(launch.nprocs):
        out += [int(m.group(1)) for m in re.finditer(rf"^{word} (\d+)", launch.stdout(r), re.M)]
    return out


@pytest.mark.parametrize(
    ("ranks", "seed", "aim"), SCENARIOS, ids=[f"{n}rank-seed{s}" for n, s, _ in SCENARIOS]
)
def test_kill9_mid_save(tmp_path, monkeypatch, ranks: int, seed: int, aim: float) -> None:
    rng = random.Random(seed)
    d = tmp_path / "ckpt"
    shm = tmp_path / "shm"
    monkeypatch.setenv("TIDAL_SHM_DIR", str(shm))
    victim = rng.randrange(ranks)
    target = rng.randint(3, 5)
    with Launch("kill_worker", ranks, ["--dir", str(d), "--mib", str(MIB)], shm_dir=shm,
                log_dir=tmp_path / "logs") as run:
        run.wait_for_line(victim, lambda s: s.startswith("committed 2 "), timeout=120)
        took = max(float(ln.split()[2]) for _, ln in run.lines[victim] if ln.startswith("committed "))
        t_saving, _ = run.wait_for_line(victim, lambda s: s == f"saving {target}", timeout=60)
        delay = took * (aim + 0.3 * rng.random())
        time.sleep(max(0.0, t_saving + delay - time.monotonic()))
        run.kill_rank(victim)
        time.sleep(0.3 * rng.random())  # the other rank runs on a moment, as it would until torchrun reacts
        run.kill()
        run.join_readers()
        committed = max(printed_steps(run, "committed"))  # in every tier, as far as the workers know
        in_flight = max(printed_steps(run, "saving"))  # the newest step any rank started to save
        where = (f"killed rank {victim} {delay:.3f}s after 'saving {target}' (a save took {took:.3f}s); "
                 f"last committed {committed}; left {snapshot(d, shm_root_for(d))}")
    print(where)

    # Every listed step loads whole; the torn one (if any) is invisible.
    listed = ckpt.steps(d)
    assert committed in listed, where
    assert listed and max(listed) <= in_flight, (listed, where)
    for s in listed:
        check_step(d, s)
    assert check_step(d, None) == max(listed)
    if in_flight not in listed:
        with pytest.raises(ckpt.NotFoundError):
            ckpt.load(d, full_state(), step=in_flight)

    # Disk tier alone: TIDAL_SHM_DIR somewhere else (no shm tier on this node).
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "elsewhere"))
    on_disk = ckpt.steps(d)
    assert committed in on_disk and set(on_disk) <= set(listed), (on_disk, listed, where)
    assert check_step(d, None) == max(on_disk)
    monkeypatch.setenv("TIDAL_SHM_DIR", str(shm))

    if seed % 2:  # node reboot: shared memory is gone, the disk tier serves the newest step
        shutil.rmtree(shm)
        assert ckpt.steps(d) == on_disk
        assert check_step(d, None) == max(on_disk)

    # Resuming from the newest step, a fresh Checkpointer's next save - often into the torn step's
    # own directory - clears what the killed save left behind, in both tiers.
    new = max(listed) + 1
    state = full_state()
    kill_worker.fill(state, new)
    with ckpt.Checkpointer(d, keep=3) as cp:
        cp.save(new, state).wait()
    for root in (d, shm_root_for(d)):
        for sd in step_dirs(root):
            assert (sd / "manifest.json").exists(), f"{sd} left without a manifest ({where})"
            doc = json.loads((sd / "manifest.json").read_text())
            files = sorted(p.name for p in sd.iterdir())
            assert files == sorted(["manifest.json", *(f["name"] for f in doc["files"])]), (sd, files, where)
        assert not list(root.rglob("*.part")) and not list(root.rglob("*.tmp")), where
    assert ckpt.steps(d)[-1] == new
    assert check_step(d, None) == new
    assert check_step(d, committed) == committed
    shutil.rmtree(d)  # ~0.5 GB per case; pytest keeps the tmp dirs of recent runs
    shutil.rmtree(shm, ignore_errors=True)

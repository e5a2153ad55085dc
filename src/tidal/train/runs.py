"""Run the example job as a sequence of interrupted segments, and read back what each step trained on.

Shared by ``tidal verify-resume`` (:mod:`tidal.train.verify`) and the resume benchmark
(:mod:`tidal.train.measure`). A *segment* is one launch of the job on some world size and layout;
it runs until the job finishes or until it reports ``stop_at`` steps, when it is sent a notice
(SIGTERM to some ranks, or the notice file) and must exit with code 75.

Every segment writes its own progress directory, so the records of a run are unambiguous: for each
step, the *last* segment that reported it says what it trained on (a step re-run after a crash is
counted once, as re-run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tidal
from tidal import contract as c
from tidal.contract import EXIT_PREEMPTED
from tidal.train.launch import LocalLaunch
from tidal.train.progress import progress_path, read_jsonl


def example_script() -> Path:
    """``examples/gpt/train.py`` of the source tree this package was loaded from."""
    return Path(tidal.__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"


@dataclass
class Segment:
    """One launch: ``world`` ranks in ``layout``; a notice once the job reports ``stop_at`` steps."""

    world: int
    layout: str
    stop_at: int | None = None
    notice: str = "sigterm"  # "sigterm" or "file"
    notice_ranks: list[int] | None = None  # SIGTERM only these ranks (default: all)

    def describe(self) -> str:
        return f"{self.layout} x{self.world}, {self.ending()}"

    def ending(self) -> str:
        if self.stop_at is None:
            return "runs to the end"
        if self.notice == "file":
            return f"notice file at step {self.stop_at}"
        who = "all" if self.notice_ranks is None else ",".join(f"r{r}" for r in self.notice_ranks)
        return f"SIGTERM {who} at step {self.stop_at}"


@dataclass
class SegmentResult:
    segment: Segment
    exit_codes: list[int]
    started_unix: float
    notice_unix: float | None
    exited_unix: float
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> records
    log_dir: str = ""

    def events(self, name: str, rank: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.records.get(rank, []) if r.get("event") == name]

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.events("step")]

    @property
    def restored_step(self) -> int:
        ev = self.events("restore")
        return int(ev[0]["step"]) if ev else 0

    def summary(self) -> dict[str, Any]:
        """Timings of this launch (seconds; ``None`` where not applicable)."""
        restore = (self.events("restore") or [{}])[0]
        steps = self.events("step")
        first = steps[0] if steps else {}
        pre = (self.events("preempted") or [{}])[0]
        return {
            "world": self.segment.world, "layout": self.segment.layout, "ending": self.segment.ending(),
            "exit_codes": self.exit_codes,
            "restored_step": self.restored_step, "restore_tier": restore.get("tier"),
            "last_step": steps[-1]["step"] if steps else None,
            "restore_s": restore.get("duration_s") if restore.get("tier") else None,
            "start_to_first_step_s": (first["time"] - self.started_unix) if first else None,
            "stop_step": pre.get("step"), "stop_tiers": pre.get("tiers"),
            "notice_to_exit_s": (self.exited_unix - self.notice_unix) if self.notice_unix else None,
            "wall_s": self.exited_unix - self.started_unix,
        }


class _Tail:
    """Complete lines appended to a progress file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self._pos, self._buf = path, 0, b""

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(data)
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]


def run_segment(seg: Segment, script: Path, job_args: list[str], work: Path, index: int, *,
                env: dict[str, str], timeout_s: float = 300.0) -> SegmentResult:
    """Launch one segment and wait for its ranks; raise RuntimeError when it did not end as planned."""
    seg_dir = work / f"seg{index}"
    pdir = seg_dir / c.PROGRESS_DIRNAME
    notice_file = seg_dir / "notice"
    cmd = [sys.executable, str(script), "--parallel", seg.layout, *job_args]
    seg_env = {**env, c.ENV_PROGRESS_DIR: str(pdir), c.ENV_NOTICE_FILE: str(notice_file)}
    notice_unix = None
    with LocalLaunch(cmd, seg.world, env=seg_env, log_dir=seg_dir / "logs") as job:
        started = job.started_unix
        if seg.stop_at is not None:
            tail = _Tail(progress_path(pdir, 0))
            deadline = time.monotonic() + timeout_s
            while notice_unix is None:
                if any(r.get("event") == "step" and r["step"] >= seg.stop_at for r in tail.new()):
                    if seg.notice == "file":
                        notice_unix = time.time()
                        notice_file.write_text("reclaim\n")
                    else:
                        notice_unix = job.signal(signal.SIGTERM, seg.notice_ranks)
                    break
                if any(c is not None for c in job.poll()) or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        codes = job.wait(timeout_s)
        exited = max(t for t in job.exited_unix if t is not None)
        tails = job.tails()
    result = SegmentResult(seg, codes, started, notice_unix, exited, log_dir=str(seg_dir / "logs"))
    for r in range(seg.world):
        p = progress_path(pdir, r)
        result.records[r] = read_jsonl(p) if p.exists() else []
    want = EXIT_PREEMPTED if seg.stop_at is not None else 0
    if any(c != want for c in codes):
        raise RuntimeError(
            f"segment {index} ({seg.describe()}) exited with codes {codes}, expected {want} on "
            f"every rank; logs in {seg_dir / 'logs'}\n{tails}"
        )
    return result


def per_step(results: list[SegmentResult]) -> dict[int, dict[str, Any]]:
    """step -> {"indices": the global batch in order, "loss": mean loss, "segment": index} (last wins)."""
    out: dict[int, dict[str, Any]] = {}
    for i, res in enumerate(results):
        by_step: dict[int, dict[int, list[int]]] = {}
        loss: dict[int, float | None] = {}
        for recs in res.records.values():
            for r in recs:
                if r.get("event") != "step":
                    continue
                s = int(r["step"])
                if "indices" in r:
                    by_step.setdefault(s, {})[int(r["data_rank"])] = list(r["indices"])
                if r.get("rank") == 0:
                    loss[s] = r.get("loss")
        for s in sorted(set(by_step) | set(loss)):
            slices = by_step.get(s, {})
            out[s] = {
                "indices": [x for d in sorted(slices) for x in slices[d]],
                "loss": loss.get(s),
                "segment": i,
            }
    return out


def job_env(work: Path, shm_dir: Path | str, **extra: str) -> dict[str, str]:
    """The Tidal variables every segment of one run shares (checkpoint location, node memory, grace)."""
    return {c.ENV_CKPT_URL: str(work / "ckpt"), c.ENV_SHM_DIR: str(shm_dir), c.ENV_JOB_ID: work.name,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}

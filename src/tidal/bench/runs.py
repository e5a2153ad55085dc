"""The example job run as a chain of *segments* (launches by the local executor, each stopped by a notice
once it reports ``stop_at`` steps, or run to the end), and what each step trained on (the last segment
that reported it says); for ``tidal verify-resume`` and the resume benchmark."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tidal
from tidal import contract as c
from tidal.contract import EXIT_PREEMPTED
from tidal.exec.local import LocalExecutor, detect_gpus
from tidal.exec.protocol import LaunchRequest, Observation, check_ranks
from tidal.train.progress import progress_path, read_jsonl

POLL_S = 0.01  # how often a segment's ranks are observed (notice and exit times are this precise)
AFTER_FAILURE_S = 10.0  # a rank failed: the others, waiting on it in a collective, are killed this much later


def example_script(script: Path | None = None) -> Path:
    """``script``, else ``examples/gpt/train.py`` of this checkout (installed editable) or under the cwd;
    ``FileNotFoundError`` naming what is missing."""
    roots = (Path(tidal.__file__).resolve().parents[2], Path.cwd())
    for p in [script] if script else [r / "examples" / "gpt" / "train.py" for r in roots]:
        if p.is_file():
            return p
    raise FileNotFoundError(f"example job not found at {script}; pass --script" if script else
                            "the GPT example examples/gpt/train.py was not found next to the tidal package "
                            f"nor under {Path.cwd()}: run from a checkout of the repository")


@dataclass
class Segment:
    """One launch: ``world`` ranks in ``layout``; a notice once the job reports ``stop_at`` steps."""

    world: int
    layout: str
    stop_at: int | None = None
    notice: str = "sigterm"  # "sigterm" or "file"
    notice_ranks: list[int] | None = None  # SIGTERM only these ranks (default: all)

    def __post_init__(self) -> None:
        if self.notice not in ("sigterm", "file"):
            raise ValueError(f"segment notice {self.notice!r}: expected 'sigterm' or 'file'")
        check_ranks(f"segment {self.layout} x{self.world}", self.notice_ranks, self.world)

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
            "exit_codes": self.exit_codes, "restored_step": self.restored_step,
            "restore_tier": restore.get("tier"), "last_step": steps[-1]["step"] if steps else None,
            "restore_s": restore.get("duration_s") if restore.get("tier") else None,
            "start_to_first_step_s": (first["time"] - self.started_unix) if first else None,
            "stop_step": pre.get("step"), "stop_tiers": pre.get("tiers"),
            "notice_to_exit_s": (self.exited_unix - self.notice_unix) if self.notice_unix else None,
            "wall_s": self.exited_unix - self.started_unix}


def segment_devices(world: int) -> list[int] | None:
    """The first ``world`` GPUs this process sees (rank ``r`` on ``cuda:r``), or ``None`` (CPU slots,
    gloo) when it sees fewer."""
    visible = os.environ.get(c.ENV_CUDA_VISIBLE_DEVICES)
    ids = detect_gpus() if visible is None else [int(x) for x in visible.split(",") if x.strip().isdigit()]
    return ids[:world] if len(ids) >= world else None


LAYOUTS = ("fsdp", "ddp", "tp", "single")  # the example job's --parallel


def check_model(layouts: list[str], n_embd: int, n_head: int) -> None:
    """ValueError naming the option when the example job would refuse these settings after starting."""
    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {list(LAYOUTS)}")
    if n_embd % n_head:
        raise ValueError(f"--n-embd {n_embd} must be a multiple of the model's {n_head} attention heads")


def run_segment(seg: Segment, script: Path, job_args: list[str], work: Path, index: int, *,
                env: dict[str, str], timeout_s: float = 300.0) -> SegmentResult:
    """Launch one segment (attempt ``index + 1``) and wait for its ranks; RuntimeError when it did not end
    as planned, TimeoutError (every rank killed) past ``timeout_s``."""
    job = env.get(c.ENV_JOB_ID) or work.name
    gpus = segment_devices(seg.world)
    # the operator's own run: sandboxed, as the operator (the checkpoints it makes are the operator's)
    ex = LocalExecutor(work / "jobs", gpu_ids=gpus or None, slots=None if gpus else seg.world,
                       run_as_self=True)
    adir = ex.attempt_dir(job, index + 1)
    notice_file = adir / "notice"
    cmd = (sys.executable, str(script), "--parallel", seg.layout, *job_args)
    req = LaunchRequest(job, index + 1, cmd, {ex.node: seg.world}, workdir=os.getcwd(),
                        env={**env, c.ENV_NOTICE_FILE: str(notice_file)})
    logs = Path(ex.log_path(job, 0)).parent
    started = time.time()
    try:
        ex.launch(req, started)
        notice_unix, last, exited = _wait(ex, seg, job, notice_file, timeout_s, logs)
    finally:
        ex.release(job)  # kills what is left (an interrupt, an error here)
        ex.close()
    codes = [-1 if r.exit_code is None else r.exit_code for r in last.ranks]  # -1: vanished, code unknown
    result = SegmentResult(seg, codes, started, notice_unix, exited, log_dir=str(logs))
    for r in range(seg.world):
        p = progress_path(adir / c.PROGRESS_DIRNAME, r)
        result.records[r] = read_jsonl(p) if p.exists() else []
    want = EXIT_PREEMPTED if seg.stop_at is not None else 0
    if any(code != want for code in codes):
        raise RuntimeError(f"segment {index} ({seg.describe()}) exited with codes {codes}, expected {want} "
                           f"on every rank; logs in {logs}\n{tails(ex, job, index + 1, seg.world)}")
    return result


def _wait(ex: LocalExecutor, seg: Segment, job: str, notice_file: Path, timeout_s: float,
          logs: Path) -> tuple[float | None, Observation, float]:
    """Observe the segment until every rank exited: the notice once rank 0 reports ``stop_at`` steps
    (while every rank runs), the others killed ``AFTER_FAILURE_S`` after a rank failed (they wait on it
    in a collective). Returns when the notice went out, the last observation and when it was made."""
    deadline = time.monotonic() + timeout_s
    notice_unix: float | None = None
    failed_at: float | None = None
    killed = False
    while True:
        now = time.time()
        obs = ex.observe(now)[job]
        if obs.done:
            return notice_unix, obs, now
        step = obs.progress.step
        if (seg.stop_at is not None and notice_unix is None and step is not None and step >= seg.stop_at
                and len(obs.alive) == seg.world):
            notice_unix = time.time()
            if seg.notice == "file":
                notice_file.write_text("reclaim\n")
            else:
                ex.signal_stop(job, seg.notice_ranks)
        if failed_at is None and any(r.exit_code not in (None, 0, EXIT_PREEMPTED) for r in obs.ranks):
            failed_at = time.monotonic()
        if not killed and failed_at is not None and time.monotonic() - failed_at > AFTER_FAILURE_S:
            ex.kill(job)
            killed = True
        if time.monotonic() > deadline:
            ex.kill(job)
            raise TimeoutError(f"{seg.describe()}: still running after {timeout_s:.0f} s; logs in {logs}\n"
                               f"{tails(ex, job, obs.attempt, seg.world)}")
        time.sleep(POLL_S)


def tails(ex: LocalExecutor, job: str, attempt: int, world: int, lines: int = 15) -> str:
    """The last ``lines`` lines of each rank's output in ``attempt`` (its log holds every attempt's)."""
    parts = []
    for r in range(world):
        try:
            text = Path(ex.log_path(job, r)).read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        mine = text.rpartition(f"=== tidal: {job} attempt {attempt}, rank {r} ")[2].splitlines()[1:]
        parts.append(f"--- rank {r} output tail:\n" + "\n".join(mine[-lines:]))
    return "\n".join(parts)


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
            out[s] = {"indices": [x for d in sorted(slices) for x in slices[d]], "loss": loss.get(s),
                      "segment": i}
    return out


def job_env(work: Path, shm_dir: Path | str, **extra: str) -> dict[str, str]:
    """The Tidal variables every segment of one run shares (checkpoint location, node memory, grace)."""
    return {c.ENV_CKPT_URL: str(work / "ckpt"), c.ENV_SHM_DIR: str(shm_dir), c.ENV_JOB_ID: work.name,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}

"""Stopping and resuming real multi-process jobs (gloo on CPU) with ``tidal.train``.

* The example GPT on 2 ranks (FSDP2) gets SIGTERM on rank 1 only: both ranks stop after the same
  step, checkpoint it and exit with code 75. Resumed on 3 ranks (DDP) it continues from that step;
  against an uninterrupted 2-rank run every step trains on the same global batch (the same dataset
  indices in the same order) and the loss agrees (bit for bit before the world-size change).
* A rank SIGKILLed while its save of step 4 is persisting: step 4 stays invisible, a resume on one
  rank restores step 2 and trains steps 3.. on the same samples as ever.
* A world size that cannot divide the global batch stops every rank with a message naming the numbers.

Starting torch costs seconds per process, so the stop/resume/baseline launches run once per module.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

from dist_harness import Launch
from tidal import ckpt, train
from tidal.train.progress import progress_path, read_jsonl

pytestmark = pytest.mark.slow

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block", "32", "--global-batch", "12",
        "--micro-batch", "2", "--warmup", "2", "--log-every", "1", "--record-indices"]
STEPS = 12  # every launch gets the same --steps: the learning-rate schedule depends on it


def records(pdir: Path, rank: int, event: str | None = None) -> list[dict]:
    recs = read_jsonl(progress_path(pdir, rank))
    return [r for r in recs if event is None or r["event"] == event]


def by_step(pdir: Path, world: int) -> dict[int, dict]:
    """step -> {"indices": global batch (data ranks in order), "loss": mean loss}."""
    out: dict[int, dict] = {}
    for rank in range(world):
        for r in records(pdir, rank, "step"):
            e = out.setdefault(r["step"], {"slices": {}, "loss": None})
            e["slices"][r["data_rank"]] = r["indices"]
            if rank == 0:
                e["loss"] = r["loss"]
    return {s: {"indices": [i for d in sorted(e["slices"]) for i in e["slices"][d]], "loss": e["loss"]}
            for s, e in out.items()}


def example_num_samples(block: int = 32) -> int:
    spec = importlib.util.spec_from_file_location(
        "gpt_train", Path(__file__).parents[1] / "examples/gpt/train.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return len(mod.Corpus(block))


@pytest.fixture(scope="module")
def stop_resume(tmp_path_factory):
    """Run fsdp x2 stopped by SIGTERM to rank 1 → ddp x3 resumed to the end; and fsdp x2 uninterrupted."""
    tmp = tmp_path_factory.mktemp("stop_resume")
    shm = tmp / "shm"
    env = {"TIDAL_CKPT_URL": str(tmp / "ckpt"), "TIDAL_SHM_DIR": str(shm), "TIDAL_GRACE_S": "60"}
    out: dict = {"tmp": tmp, "shm": shm}
    with Launch("train_example", 2, ["--parallel", "fsdp", "--steps", str(STEPS), *TINY], shm_dir=shm,
                env={**env, "TIDAL_PROGRESS_DIR": str(tmp / "p1")}) as job:
        job.wait_for_line(0, lambda line: line.startswith("step") and int(line.split()[1]) >= 3, timeout=90)
        os.kill(job.procs[1].pid, signal.SIGTERM)
        out["codes1"] = job.exit_codes(timeout=60)
        out["stderr1"] = [job.stderr(r) for r in range(2)]
    stop = records(tmp / "p1", 0, "preempted")
    assert stop, f"rank 0 wrote no 'preempted' record; stderr: {out['stderr1']}"
    out["stop_step"] = s1 = stop[0]["step"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_SHM_DIR", str(shm))  # see the node-memory tier from this process too
        out["committed_after_stop"] = ckpt.steps(tmp / "ckpt")
    assert s1 < STEPS, f"the job finished (step {s1}) before the notice took effect"
    final = STEPS
    with Launch("train_example", 3, ["--parallel", "ddp", "--steps", str(final), *TINY], shm_dir=shm,
                env={**env, "TIDAL_PROGRESS_DIR": str(tmp / "p2")}) as job:
        job.wait(timeout=90)
    base_env = {"TIDAL_SHM_DIR": str(tmp / "shm-base"), "TIDAL_PROGRESS_DIR": str(tmp / "base")}
    with Launch(
        "train_example",
        2,
        ["--parallel", "fsdp", "--steps", str(final), *TINY],
        shm_dir=tmp / "shm-base",
        env=base_env,
    ) as job:
        job.wait(timeout=90)
    out["final"] = final
    return out


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step_with_exit_75(stop_resume):
    r = stop_resume
    assert r["codes1"] == [train.EXIT_PREEMPTED] * 2, r["stderr1"]
    tmp, s1 = r["tmp"], r["stop_step"]
    notices = [records(tmp / "p1", rank, "notice")[0] for rank in range(2)]
    assert [n["source"] for n in notices] == ["peer", "SIGTERM"]  # rank 0 learned it from the all-reduce
    for rank in range(2):
        pre = records(tmp / "p1", rank, "preempted")[0]
        assert pre["step"] == s1 and pre["exit_code"] == 75
        assert pre["tiers"], f"rank {rank} exited before the final checkpoint committed anywhere"
        assert max(x["step"] for x in records(tmp / "p1", rank, "step")) == s1
    assert s1 >= 3 and s1 in r["committed_after_stop"]


def test_resume_on_three_ranks_continues_from_the_stopped_step(stop_resume):
    tmp, s1 = stop_resume["tmp"], stop_resume["stop_step"]
    for rank in range(3):
        rest = records(tmp / "p2", rank, "restore")[0]
        assert rest["step"] == s1 and rest["saved_world_size"] == 2
        assert rest["read_amplification"] == 1.0
        assert [x["step"] for x in records(tmp / "p2", rank, "step")] == list(
            range(s1 + 1, stop_resume["final"] + 1)
        )


def test_data_order_is_identical_and_loss_matches_the_uninterrupted_run(stop_resume):
    tmp, s1, final = stop_resume["tmp"], stop_resume["stop_step"], stop_resume["final"]
    base = by_step(tmp / "base", 2)
    resumed = {**by_step(tmp / "p1", 2), **by_step(tmp / "p2", 3)}
    assert sorted(base) == sorted(resumed) == list(range(1, final + 1))
    sampler = train.GlobalBatchSampler(example_num_samples(), 12, 2, seed=1337)
    for s in range(1, final + 1):
        assert resumed[s]["indices"] == base[s]["indices"] == sampler.global_indices(s - 1), f"step {s}"
    for s in range(1, s1 + 1):  # same world size and layout: the same arithmetic
        assert resumed[s]["loss"] == base[s]["loss"], f"step {s}"
    rel = max(abs(resumed[s]["loss"] - base[s]["loss"]) / base[s]["loss"] for s in range(1, final + 1))
    assert rel < 1e-4, f"max relative loss difference {rel:.2e}"  # only summation order differs


def test_example_loss_falls(stop_resume):
    base = by_step(stop_resume["tmp"] / "base", 2)
    steps = sorted(base)
    first, last = base[steps[0]]["loss"], base[steps[-1]]["loss"]
    assert first > 5.0  # about ln(256) = 5.55 for bytes at random
    assert last < first - 0.5, [round(base[s]["loss"], 3) for s in steps]


def test_sigkill_mid_save_resumes_from_the_previous_committed_step(tmp_path):
    env = {"TIDAL_CKPT_URL": str(tmp_path / "ckpt"), "TIDAL_CKPT_INTERVAL_STEPS": "2",
           "TIDAL_PROGRESS_DIR": str(tmp_path / "p1")}
    with Launch("train_worker", 2, ["--steps", "1000", "--die-at-checkpoint", "4", "--die-rank", "1"],
                shm_dir=tmp_path / "shm", env=env) as job:
        codes = job.exit_codes(timeout=90)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes  # rank 0 fails on its dead peer
    assert [c["step"] for c in records(tmp_path / "p1", 1, "checkpoint")] == [2]  # the kill came first
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))
        committed = ckpt.steps(tmp_path / "ckpt")
    # Rank 1 died while its part of step 4 was being checksummed and written (48 MiB). Only if the
    # scheduler starved its training thread for that long could step 4 have committed first.
    assert committed[-1] in (2, 4) and 2 in committed, committed
    if committed[-1] == 2:
        assert not (tmp_path / "ckpt" / "step_000000000004" / "manifest.json").exists()
    env["TIDAL_PROGRESS_DIR"] = str(tmp_path / "p2")
    with Launch("train_worker", 1, ["--steps", "6"], shm_dir=tmp_path / "shm", env=env) as job:
        job.wait(timeout=60)
    rest = records(tmp_path / "p2", 0, "restore")[0]
    assert rest["step"] == committed[-1] and rest["saved_world_size"] == 2
    sampler = train.GlobalBatchSampler(1000, 12, 2, seed=7)
    got = {r["step"]: r["indices"] for r in records(tmp_path / "p2", 0, "step")}
    assert sorted(got) == list(range(committed[-1] + 1, 7))
    assert all(got[s] == sampler.global_indices(s - 1) for s in got)
    first_run = {r["step"]: r["indices"] for r in records(tmp_path / "p1", 0, "step")}
    assert all(first_run[s] == sampler.local_indices(s - 1)[:6] for s in first_run)  # rank 0's half of 12
    assert [c["step"] for c in records(tmp_path / "p2", 0, "committed")][-1] == 6


def test_world_size_that_cannot_divide_the_global_batch_is_rejected_with_the_numbers(tmp_path):
    args = ["--parallel", "ddp", "--steps", "2", *TINY, "--global-batch", "6"]  # the last value wins
    with Launch("train_example", 2, args, shm_dir=tmp_path / "shm") as job:
        codes = job.exit_codes(timeout=60)
        err = job.stderr(0)
    assert codes == [1, 1]
    assert "global batch 6 cannot be split over 2 data-parallel ranks with micro-batch 2" in err
    assert "2 x 2 = 4 does not divide 6" in err and "world sizes that work with micro-batch 2: [1, 3]" in err

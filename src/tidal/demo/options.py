"""What the demos train: the GPT example (``examples/gpt/train.py``), its model sizes and its job spec
(every demo); and the options of ``tidal demo``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.bench import runs
from tidal.contract import ENV_SHM_DIR
from tidal.demo.plane import DemoError

# Model sizes of examples/gpt/train.py. "small" takes about 0.1-0.2 s a step on 2 CPU ranks; "tiny" is
# the test setting (a few ms of compute a step).
SIZES: dict[str, dict[str, int]] = {
    "small": {"n-layer": 4, "n-head": 4, "n-embd": 128, "block": 64, "global-batch": 16},
    "tiny": {"n-layer": 2, "n-head": 2, "n-embd": 32, "block": 32, "global-batch": 12}}


@dataclass(frozen=True)
class DemoOptions:
    steps: int = 300
    ckpt_every: int = 25
    gpus: int = 2
    parallel: str = "ddp"
    size: str = "small"
    kill_at: float = 0.5
    kill_rank: int | None = None  # default: the last rank
    timeout_s: float = 600.0
    poll_s: float = 0.25

    def check(self) -> None:
        """Refuse settings that cannot show a recovery, naming the option and what was expected."""
        if self.size not in SIZES:
            raise DemoError(f"--size {self.size!r}: expected one of {sorted(SIZES)}")
        if self.parallel not in ("ddp", "fsdp"):
            raise DemoError(f"--parallel {self.parallel!r}: expected ddp or fsdp")
        if self.gpus < 2:
            raise DemoError(
                f"--gpus {self.gpus}: the demo kills one rank of a gang, so it needs at least 2 slots")
        gb = SIZES[self.size]["global-batch"]
        if gb % self.gpus:
            ok = [n for n in range(2, gb + 1) if gb % n == 0]
            raise DemoError(
                f"--gpus {self.gpus}: the global batch of {gb} sequences ({self.size} model) must split "
                f"evenly over the ranks; expected one of {ok}"
            )
        if not 0 < self.kill_at < 1:
            raise DemoError(f"--kill-at {self.kill_at}: expected a fraction of the steps between 0 and 1")
        if self.steps < 4:
            raise DemoError(f"--steps {self.steps}: expected at least 4")
        if not 1 <= self.ckpt_every < int(self.steps * self.kill_at):
            raise DemoError(
                f"--ckpt-every {self.ckpt_every}: expected 1 to {int(self.steps * self.kill_at) - 1}, "
                f"so that a checkpoint exists before the kill at step {int(self.steps * self.kill_at)} "
                f"(--kill-at {self.kill_at:g} of --steps {self.steps})"
            )
        if self.kill_rank is not None and not 0 <= self.kill_rank < self.gpus:
            raise DemoError(f"--kill-rank {self.kill_rank}: expected 0 to {self.gpus - 1}")

    @property
    def rank_to_kill(self) -> int:
        return self.gpus - 1 if self.kill_rank is None else self.kill_rank

    @property
    def kill_step(self) -> int:
        return int(self.steps * self.kill_at)

    @property
    def global_batch(self) -> int:
        return SIZES[self.size]["global-batch"]


def example_script() -> Path:
    """:func:`tidal.bench.runs.example_script`, its error a :class:`DemoError`."""
    try:
        return runs.example_script()
    except FileNotFoundError as e:
        raise DemoError(str(e)) from None


def gpt_job(script: Path, name: str, size: str, args: list[str], shm_dir: Path | None = None,
            **fields: Any) -> dict[str, Any]:
    """A ``kind: spot`` job of the GPT example: ``args`` and the model ``size``; ``fields`` (gpus,
    max_restarts, grace_s, ...) as given; node memory in ``shm_dir`` when given."""
    return {"name": name, "kind": "spot", **fields, "workdir": str(script.parents[2]),
            "command": [sys.executable, str(script), *args, *(f"--{k}={v}" for k, v in SIZES[size].items())],
            "env": {"OMP_NUM_THREADS": "1", **({ENV_SHM_DIR: str(shm_dir)} if shm_dir is not None else {})}}

"""load = reshard, for real: checkpoints saved by N gloo processes in one layout, loaded by M in another.

Every case compares, bit for bit, the full model and Adam state gathered after the load (with
torch.distributed.checkpoint's ``full_state_dict``) against the same gathering done right after the
save, and requires every rank to read at most the checksum blocks its bytes lie in; the
workers also check the step and extra values and train one more step after the load
(tests/workers/reshard_worker.py).

Starting torch costs seconds of CPU per process, so the processes of one launch run several jobs in
turn (``--then``), and a launch saves the checkpoints that later launches load. A launch runs once
per module, when the first case that needs it runs, after the launches that save what it loads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dist_harness import Launch, WorkerError
from tidal import ckpt

pytestmark = pytest.mark.slow

# Launches in dependency order: world size, jobs (phase, layout, checkpoint name), TIDAL_SHM_DIR.
# Launches sharing an shm dir share the node: they load from the shm tier. "E" runs on a node
# without it (as after a reboot) and loads from the disk tier.
LAUNCHES: dict[str, tuple[int, list[tuple[str, str, str]], str]] = {
    "A": (
        4,
        [("save", "fsdp", "fsdp4"), ("save", "tp_dp", "tp2dp2"), ("save", "fsdp_tp", "fsdp2x2tp")],
        "node",
    ),
    "B": (1, [("load", "single", "fsdp4"), ("save", "single", "single")], "node"),
    "C": (2, [("load", "fsdp", "single"), ("load", "fsdp", "fsdp4"), ("save", "ddp", "ddp2")], "node"),
    "D": (
        3,
        [
            ("load", "fsdp", "fsdp4"),
            ("load", "fsdp", "tp2dp2"),
            ("save", "fsdp", "fsdp3"),
            ("load", "fsdp", "fsdp2x2tp"),
        ],
        "node",
    ),
    "E": (
        4,
        [("load", "tp_dp", "fsdp3"), ("load", "fsdp", "ddp2"), ("load", "fsdp_tp", "fsdp3")],
        "rebooted",
    ),
}

# FSDP2 over dp on top of TP (the usual 2-D layout) shards `up` on dim 0 twice, which DTensor
# expresses as placements (_StridedShard(dim=0, sf=2), Shard(dim=0)): still one box per rank.

# Cases: id -> (launch, layout loaded into, checkpoint loaded).
CASES = {
    "fsdp4-to-fsdp3": ("D", "fsdp", "fsdp4"),
    "fsdp4-to-fsdp2": ("C", "fsdp", "fsdp4"),
    "fsdp4-to-single": ("B", "single", "fsdp4"),
    "ddp2-to-fsdp4": ("E", "fsdp", "ddp2"),
    "tp2dp2-to-fsdp3": ("D", "fsdp", "tp2dp2"),
    "fsdp3-to-tp2dp2": ("E", "tp_dp", "fsdp3"),
    "single-to-fsdp2": ("C", "fsdp", "single"),
    "fsdp2x2tp-to-fsdp3": ("D", "fsdp", "fsdp2x2tp"),
    "fsdp3-to-fsdp2x2tp": ("E", "fsdp_tp", "fsdp3"),
}
CASE_PARAMS = list(CASES)

RESULT = re.compile(r"^RESULT (\S+) (OK|FAIL) ?(.*)$")


class Runs:
    """Runs launches on demand (what they load first) and keeps every rank's RESULT lines."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[str, dict[str, list[tuple[str, str]]]] = {}  # launch -> job -> [(status, msg)]
        self.errors: dict[str, str] = {}

    def ckpt_dir(self, name: str) -> Path:
        return self.root / name

    @staticmethod
    def saver(name: str) -> str:
        return next(
            k for k, (_, jobs, _) in LAUNCHES.items() if any(j[0] == "save" and j[2] == name for j in jobs)
        )

    def run(self, launch: str) -> dict[str, list[tuple[str, str]]]:
        if launch in self.results:
            return self.results[launch]
        world, jobs, shm = LAUNCHES[launch]
        for phase, _, name in jobs:
            if phase == "load":
                self.run(self.saver(name))
            else:
                self.ckpt_dir(name).mkdir(parents=True, exist_ok=True)
        (phase, layout, name), *rest = jobs
        args = ["--phase", phase, "--layout", layout, "--dir", str(self.ckpt_dir(name))]
        for p, lay, n in rest:
            args += ["--then", f"{p}:{lay}:{self.ckpt_dir(n)}"]
        with Launch("reshard_worker", world, args, shm_dir=self.root / f"shm-{shm}",
                    log_dir=self.root / f"logs-{launch}") as running:
            try:
                running.wait(timeout=240)
            except WorkerError as e:
                self.errors[launch] = str(e)
            outs = [running.stdout(r) for r in range(world)]
        per_job: dict[str, list[tuple[str, str]]] = {}
        for out in outs:
            for line in out.splitlines():
                m = RESULT.match(line.strip())
                if m:
                    per_job.setdefault(m.group(1), []).append((m.group(2), m.group(3)))
        self.results[launch] = per_job
        return per_job

    def job(self, launch: str, phase: str, layout: str, name: str) -> list[str]:
        """Every rank's message for one job; fails the test unless every rank reported OK."""
        world = LAUNCHES[launch][0]
        got = self.run(launch).get(f"{phase}:{layout}:{name}", [])
        bad = [f"{status} {msg}" for status, msg in got if status != "OK"]
        if bad or len(got) != world:
            why = "\n".join(bad) or f"only {len(got)} of {world} ranks reported a result"
            errors = "\n\n".join(f"launch {k}: {v}" for k, v in self.errors.items())
            pytest.fail(f"{phase} {layout} {name} (launch {launch}):\n{why}\n\n{errors}", pytrace=False)
        return [msg for _, msg in got]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("reshard"))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_load_reshards_bitwise(runs: Runs, case: str) -> None:
    launch, layout, name = CASES[case]
    msgs = runs.job(launch, "load", layout, name)
    assert "tensors bitwise equal" in msgs[0], msgs[0]
    want_tier = "disk" if LAUNCHES[launch][2] == "rebooted" else "shm"
    for rank, msg in enumerate(msgs):
        assert f"tiers={want_tier}" in msg.split(), f"rank {rank}: {msg}"


def _layouts(man) -> dict[str, str]:
    return {n: t.layout for n, t in man.tensors.items()}


@pytest.mark.parametrize("name", ["fsdp4", "tp2dp2", "single", "ddp2", "fsdp3", "fsdp2x2tp"])
def test_saved_layout_is_the_real_one(runs: Runs, name: str) -> None:
    """Guard against vacuous passes: each checkpoint was saved sharded the way its name says."""
    launch = runs.saver(name)
    layout = next(j[1] for j in LAUNCHES[launch][1] if j[0] == "save" and j[2] == name)
    runs.job(launch, "save", layout, name)
    d = runs.ckpt_dir(name)
    assert ckpt.steps(d) == [3]
    _, man = ckpt.read_manifest(d)
    lay = _layouts(man)
    world = LAUNCHES[launch][0]
    assert man.world_size == world
    w, exp = "model/up.weight", "optim/state/up.weight/exp_avg"
    if layout == "fsdp":
        for n in (w, exp, "model/head.weight", "model/emb.weight"):
            assert lay[n] == f"[Shard(dim=0)] on mesh ({world},)", (n, lay[n])
        assert lay["model/seen"] == "replicated"
        # 37 rows in `world` chunks; head.weight has 5 rows: on 4 ranks one shard is empty.
        assert len(man.tensors[w].pieces) == world
        assert len(man.tensors["model/head.weight"].pieces) == {4: 3, 3: 3}[world]
    elif layout == "tp_dp":
        assert lay[w] == lay[exp] == lay["model/up.bias"] == "[Shard(dim=0)] on mesh (2,)"
        assert lay["model/down.weight"] == "[Shard(dim=1)] on mesh (2,)"
        assert lay["model/down.bias"] == "[Replicate()] on mesh (2,)"
        assert lay["model/emb.weight"] == "replicated"
        assert [p.box.lengths for p in man.tensors[w].pieces] == [(19, 53), (18, 53)]
    elif layout == "fsdp_tp":
        assert lay[w] == lay[exp] == "[_StridedShard(dim=0, sf=2), Shard(dim=0)] on mesh (2, 2)"
        assert lay["model/down.weight"] == "[Shard(dim=0), Shard(dim=1)] on mesh (2, 2)"
        # tp splits the 37 rows 19 + 18, then dp splits each part again.
        assert [p.box.lengths for p in man.tensors[w].pieces] == [(10, 53), (9, 53), (9, 53), (9, 53)]
        assert len(man.tensors["model/down.weight"].pieces) == 4
    else:
        assert set(lay.values()) == {"replicated"}
    # Replicated pieces are written once, spread over the ranks.
    files = {p.file for t in man.tensors.values() for p in t.pieces}
    assert len(files) == world
    assert all(len(t.pieces) == len({p.box for p in t.pieces}) for t in man.tensors.values())

"""Single-process behaviour of Checkpointer and load: tiers, retention, overlapped mode."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from tidal import ckpt
from tidal.ckpt.tiers.directory import DirTier, shm_root_for


@pytest.fixture(autouse=True)
def private_shm(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))


def make_state(seed: int = 0, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(n, 17, generator=g), "b": torch.randn(17, generator=g).to(torch.bfloat16)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(n, 17, generator=g)}},
                  "param_groups": [{"lr": 0.1, "betas": [0.9, 0.95], "params": ["w"]}]},
        "progress": {"step": 7, "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g)},
    }


def zeros_like_state(state: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return None if not isinstance(v, list) else []

    return z(state)


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_state_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_roundtrip_all_dtypes_and_objects(tmp_path):
    state = make_state()
    state["extra"] = {d: torch.arange(6).to(d) for d in (torch.float16, torch.int64, torch.int8, torch.bool)}
    state["extra"] = {str(k): v for k, v in state["extra"].items()}
    state["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    with ckpt.Checkpointer(tmp_path / "c") as cp:
        h = cp.save(5, state)
        h.wait()
        assert h.committed == ["shm", "disk"]
    target = zeros_like_state(state)
    assert ckpt.load(tmp_path / "c", target) == 5
    assert_state_equal(target, state)


def test_keep_retains_newest_and_steps_are_sorted(tmp_path):
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "c", keep=2) as cp:
        for step in (1, 2, 3, 10):
            state["progress"]["step"] = step
            cp.save(step, state).wait()
    disk = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert disk == ["step_000000000003", "step_000000000010"]
    assert ckpt.steps(tmp_path / "c") == [3, 10]
    target = zeros_like_state(state)
    assert ckpt.load(tmp_path / "c", target, step=3) == 3 and target["progress"]["step"] == 3


def test_data_files_are_plain_safetensors(tmp_path):
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "c") as cp:
        cp.save(1, state).wait()
    (f,) = (tmp_path / "c" / "step_000000000001").glob("*.safetensors")
    with safe_open(f, framework="pt") as st:
        assert torch.equal(st.get_tensor("model/w"), state["model"]["w"])
        assert st.metadata()["format"] == "tidal-ckpt"


@pytest.mark.slow
def test_shm_tier_survives_the_process_and_is_read_first(tmp_path):
    url = tmp_path / "c"
    code = textwrap.dedent(f"""
        import torch
        from tidal import ckpt
        cp = ckpt.Checkpointer({str(url)!r})
        cp.save(4, {{"w": torch.full((1000,), 4.0)}}).wait()
        cp.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
    assert (shm_root_for(url) / "step_000000000004" / "manifest.json").exists()
    target = {"w": torch.zeros(1000)}
    stats = ckpt.LoadStats()
    ckpt.load(url, target, stats=stats)
    assert stats.manifest_tier == "shm" and stats.bytes_by_tier == {"shm": 4000}
    assert torch.equal(target["w"], torch.full((1000,), 4.0))


def test_a_status_write_killed_midway_leaves_nothing_after_the_next_open(tmp_path):
    """Rank 0 rewrites its status file atomically (a temporary file renamed over it); one killed mid-write
    leaves the temporary file: the next Checkpointer of the job removes it, and only it."""
    url = tmp_path / "c"
    with ckpt.Checkpointer(url) as cp:
        cp.save(1, {"w": torch.ones(10)}).wait()
    root = shm_root_for(url)
    torn, other = root / ".status.json.0123456789ab.tmp", root / ".other.json.0123456789ab.tmp"
    torn.write_text('{"step": ')
    other.write_text("{}")
    with ckpt.Checkpointer(url) as cp:
        cp.save(2, {"w": torch.ones(10)}).wait()
    assert not torn.exists() and other.exists() and (root / "status.json").exists()


def test_slots_are_reused_and_shm_holds_at_most_two_steps(tmp_path):
    url = tmp_path / "c"
    with ckpt.Checkpointer(url, keep=0) as cp:
        for step in range(5):
            cp.save(step, {"w": torch.full((256,), float(step))}).wait()
        shm = shm_root_for(url)
        assert sorted(os.listdir(shm / "slots")) == ["r00000-slot0.safetensors", "r00000-slot1.safetensors"]
        shm_steps = DirTier("shm", shm, fsync=False).committed_steps()
        assert shm_steps == [3, 4]
    for step in (2, 3, 4):  # older steps come from disk, newer ones from shm: both correct
        target = {"w": torch.zeros(256)}
        ckpt.load(url, target, step=step)
        assert torch.equal(target["w"], torch.full((256,), float(step)))


def test_layout_change_reallocates_slots(tmp_path):
    url = tmp_path / "c"
    with ckpt.Checkpointer(url) as cp:
        cp.save(1, {"w": torch.ones(10)}).wait()
        cp.save(2, {"w": torch.ones(20), "v": torch.ones(3)}).wait()
        cp.save(3, {"w": torch.full((20,), 3.0), "v": torch.ones(3)}).wait()
    target = {"w": torch.zeros(10)}
    ckpt.load(url, target, step=1)
    assert torch.equal(target["w"], torch.ones(10))
    target = {"w": torch.zeros(20), "v": torch.zeros(3)}
    ckpt.load(url, target)
    assert torch.equal(target["w"], torch.full((20,), 3.0))


def test_local_shard_save_and_load(tmp_path):
    full = torch.arange(60.0).reshape(10, 6)
    with ckpt.Checkpointer(tmp_path / "c") as cp:
        cp.save(1, {"w": full}).wait()
    stats = ckpt.LoadStats()
    part = torch.zeros(3, 4)
    ckpt.load(tmp_path / "c", {"w": ckpt.LocalShard(part, (4, 1), (10, 6))}, stats=stats)
    assert torch.equal(part, full[4:7, 1:5])
    assert stats.bytes_needed == 3 * 4 * 4
    assert stats.bytes_read == 10 * 6 * 4  # the piece is one checksum block: read whole, and checked


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(512, 2048)
        self.bn = torch.nn.BatchNorm1d(2048)
        self.fc2 = torch.nn.Linear(2048, 512)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def train_step(model, opt, seed):
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_overlapped_save_commits_exactly_the_state_at_save(tmp_path):
    """Mutate the state right after save (forward changes BN buffers, optimizer step changes params
    and Adam state); the committed step must still be bitwise the state at the save."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, opt, 0)
    cp = ckpt.Checkpointer(tmp_path / "c", guard=opt)
    assert cp.overlapped
    for step in (1, 2, 3):
        state = ckpt.training_state(model, opt, extra={"step": step})
        expected = copy.deepcopy(state)
        h = cp.save(step, state)
        # Right away, while the parameters and Adam state are still being copied: change buffers in
        # place and step the optimizer (gradients are still there from the last step).
        model.bn.running_mean.add_(1.0)
        opt.step()
        h.wait()
        train_step(model, opt, step)
        fresh_model, fresh_opt = Net(), torch.optim.Adam(Net().parameters(), lr=0.1)
        fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
        target = ckpt.training_state(fresh_model, fresh_opt, extra={"step": 0})
        assert ckpt.load(tmp_path / "c", target) == step
        assert_state_equal(target, expected)
        assert not torch.equal(model.fc1.weight, expected["model"]["fc1.weight"])  # it did move on
    cp.close()


def test_model_and_optimizer_helpers_resume_identically(tmp_path):
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, 0)
    with ckpt.Checkpointer(tmp_path / "c") as cp:
        cp.save(1, ckpt.training_state(model, opt)).wait()
    train_step(model, opt, 1)
    reference = copy.deepcopy(model.state_dict())

    model2 = Net()
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    state = ckpt.training_state(model2, opt2)
    ckpt.load(tmp_path / "c", state)
    ckpt.apply_training_state(model2, opt2, state)
    train_step(model2, opt2, 1)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k]), k


def test_save_errors_leave_committed_steps_alone(tmp_path):
    url = tmp_path / "c"
    with ckpt.Checkpointer(url) as cp:
        cp.save(1, {"w": torch.ones(4)}).wait()
        with pytest.raises(ValueError, match="non-negative integer"):
            cp.save(-1, {"w": torch.ones(4)})
        with pytest.raises(ckpt.StateError, match="'bad'"):
            cp.save(2, {"w": torch.ones(4), "bad": object()})
        cp.save(3, {"w": torch.full((4,), 3.0)}).wait()
    assert ckpt.steps(url) == [1, 3]


def test_urgent_save_and_wait_tier(tmp_path):
    url = tmp_path / "c"
    with ckpt.Checkpointer(url) as cp:
        h = cp.save(1, {"w": torch.full((1000,), 1.0)}, urgent=True)
        assert h.wait_tier("shm", timeout=60)
        h.wait()
        assert h.committed == ["shm", "disk"]
        assert h.wait_tier("disk", timeout=0) and not h.wait_tier("s3", timeout=0)
    target = {"w": torch.zeros(1000)}
    ckpt.load(url, target)
    assert torch.equal(target["w"], torch.full((1000,), 1.0))

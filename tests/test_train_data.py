"""The data position (``tidal.train.data``): pure functions, no processes."""

from __future__ import annotations

import pytest
import torch

from tidal.train import BatchSizeError, GlobalBatchSampler, check_batch, permute, reseed


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4099])
def test_permute_is_a_permutation(n):
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (2**40 + 3, 7)]:
        assert sorted(permute(i, n, seed, epoch) for i in range(n)) == list(range(n))


def test_permute_depends_on_seed_and_epoch_and_shuffles():
    n = 1000
    orders = {(s, e): [permute(i, n, s, e) for i in range(n)] for s in (0, 1) for e in (0, 1)}
    assert len({tuple(o) for o in orders.values()}) == 4
    assert orders[(0, 0)] != list(range(n))
    with pytest.raises(IndexError):
        permute(n, n, 0)


def test_order_is_pinned():
    """The order is part of the checkpoint format: a change would resume old jobs on other samples."""
    s = GlobalBatchSampler(1000, 8, 2, seed=1337)
    assert s.global_indices(0) == [417, 15, 59, 690, 491, 695, 382, 809]
    assert s.global_indices(1) == [792, 593, 842, 178, 401, 185, 551, 895]


@pytest.mark.parametrize(
    "world,micro", [(1, 1), (1, 24), (2, 3), (3, 2), (4, 2), (6, 1), (8, 3), (12, 2), (24, 1)]
)
def test_rank_slices_reassemble_the_same_global_batch_on_any_world_size(world, micro):
    samplers = [GlobalBatchSampler(500, 24, micro, rank=r, world_size=world, seed=3) for r in range(world)]
    reference = GlobalBatchSampler(500, 24, 1, seed=3)
    for step in (0, 1, 20, 21):  # 20 * 24 = 480: step 20 crosses into the second epoch
        parts = [s.micro_batches(step) for s in samplers]
        assert all(
            len(p) == s.accum_steps == 24 // (world * micro) for p, s in zip(parts, samplers, strict=True)
        )
        assert all(len(mb) == micro for p in parts for mb in p)
        flat = [i for p in parts for mb in p for i in mb]
        assert flat == reference.global_indices(step) == samplers[0].global_indices(step)


def test_each_epoch_visits_every_sample_once():
    s = GlobalBatchSampler(10, 5, 1, seed=0)
    stream = [i for step in range(6) for i in s.global_indices(step)]
    epochs = [stream[k : k + 10] for k in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_no_shuffle_walks_in_order():
    s = GlobalBatchSampler(5, 4, 2, rank=1, world_size=2, shuffle=False)
    assert s.global_indices(0) == [0, 1, 2, 3] and s.global_indices(1) == [4, 0, 1, 2]
    assert s.micro_batches(1) == [[1, 2]]


def test_a_world_size_that_cannot_divide_the_global_batch_names_the_numbers():
    with pytest.raises(BatchSizeError) as e:
        GlobalBatchSampler(100, 24, 2, rank=0, world_size=5)
    msg = str(e.value)
    assert "global batch 24 cannot be split over 5 data-parallel ranks with micro-batch 2" in msg
    assert "5 x 2 = 10 does not divide 24" in msg
    assert "world sizes that work with micro-batch 2: [1, 2, 3, 4, 6, 12]" in msg
    assert "no micro-batch works on 5 ranks" in msg
    assert check_batch(24, 2, 4) == 3
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        GlobalBatchSampler(100, 24, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        GlobalBatchSampler(100, 0, 1)


def test_state_accepts_another_world_size_but_not_another_order():
    saved = GlobalBatchSampler(100, 12, 2, rank=1, world_size=3, seed=5).state_dict()
    GlobalBatchSampler(100, 12, 6, rank=0, world_size=2, seed=5).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"global_batch: checkpoint 12, now 24.*seed: checkpoint 5, now 6"):
        GlobalBatchSampler(100, 24, 2, seed=6).load_state_dict(saved)
    with pytest.raises(ValueError, match="num_samples: checkpoint 100, now 99"):
        GlobalBatchSampler(99, 12, 2, seed=5).load_state_dict(saved)


def test_reseed_depends_on_seed_step_and_rank_only():
    def draw(seed, step, rank):
        reseed(seed, step, rank)
        return torch.rand(3)

    assert torch.equal(draw(1, 5, 0), draw(1, 5, 0))
    assert not torch.equal(draw(1, 5, 0), draw(1, 6, 0))
    assert not torch.equal(draw(1, 5, 0), draw(1, 5, 1))

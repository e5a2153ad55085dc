"""World-size-independent data position: which samples each rank trains on at each step (docs/train.md,
The data position)."""

from __future__ import annotations

from typing import Any

STATE_VERSION = 1
_M64 = (1 << 64) - 1


class BatchSizeError(ValueError):
    """The global batch cannot be split evenly over the data-parallel ranks and micro-batches."""


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit hash."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def permute(i: int, n: int, seed: int, epoch: int = 0) -> int:
    """Position ``i`` of a pseudo-random permutation of ``range(n)`` keyed by ``(seed, epoch)``: a 4-round
    Feistel network over the smallest even number of bits covering ``n``, with cycle walking."""
    if not 0 <= i < n:
        raise IndexError(f"index {i} out of range for a permutation of {n}")
    if n == 1:
        return 0
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    mask = (1 << half) - 1
    key = _mix64(_mix64(seed & _M64) ^ (epoch * 0x9E3779B97F4A7C15))
    x = i
    while True:
        left, right = x >> half, x & mask
        for rnd in range(4):
            left, right = right, left ^ (_mix64(key + (rnd << 58) + right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def reseed(seed: int, step: int, rank: int = 0) -> int:
    """Seed torch's generators (CPU and every CUDA device) from ``(seed, step, rank)``; return the seed."""
    import torch

    s = _mix64(_mix64(_mix64(seed) + step) + rank) & ((1 << 63) - 1)
    torch.manual_seed(s)
    return s


class GlobalBatchSampler:
    """Dataset indices per step, per data-parallel rank (``rank``/``world_size``: the data-parallel ones),
    per micro-batch; pure. :class:`BatchSizeError` when ``world_size × micro_batch`` does not divide
    ``global_batch``; ``shuffle=False`` walks the dataset in order."""

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        for name, v in (("num_samples", num_samples), ("global_batch", global_batch),
                        ("micro_batch", micro_batch), ("world_size", world_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        check_batch(global_batch, micro_batch, world_size)
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.local_batch = global_batch // world_size
        self.accum_steps = self.local_batch // micro_batch

    def __repr__(self) -> str:
        return (f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch={self.global_batch}, "
                f"micro_batch={self.micro_batch}, rank={self.rank}, world_size={self.world_size}, "
                f"accum_steps={self.accum_steps}, seed={self.seed})")

    def sample(self, position: int) -> int:
        """The dataset index at ``position`` of the sample stream (epoch after epoch)."""
        epoch, i = divmod(position, self.num_samples)
        return permute(i, self.num_samples, self.seed, epoch) if self.shuffle else i

    def global_indices(self, step: int) -> list[int]:
        """The global batch of ``step`` (0-based: the batch the step-th optimizer step trains on)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = step * self.global_batch
        return [self.sample(p) for p in range(start, start + self.global_batch)]

    def local_indices(self, step: int) -> list[int]:
        """This rank's contiguous slice of the global batch of ``step``."""
        start = step * self.global_batch + self.rank * self.local_batch
        return [self.sample(p) for p in range(start, start + self.local_batch)]

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's slice of ``step``'s global batch: ``accum_steps`` lists of ``micro_batch`` indices."""
        idx = self.local_indices(step)
        m = self.micro_batch
        return [idx[k : k + m] for k in range(0, len(idx), m)]

    def state_dict(self) -> dict[str, Any]:
        """What the order depends on (JSON). The position is the step, saved beside it."""
        return {"version": STATE_VERSION, "num_samples": self.num_samples, "global_batch": self.global_batch,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``ValueError`` unless a checkpoint's sampler made this sampler's order: the world size and
        micro-batch may differ, the dataset size, global batch, seed and shuffling may not."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not {STATE_VERSION}")
        mine = self.state_dict()
        diff = [f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}" for k in mine if state.get(k) != mine[k]]
        if diff:
            raise ValueError("the checkpoint's data order differs from this run's (resuming would train on "
                             "other samples): " + "; ".join(diff))


def check_batch(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient-accumulation steps for this split; :class:`BatchSizeError` naming the numbers if none."""
    per_step = world_size * micro_batch
    if global_batch % per_step == 0:
        return global_batch // per_step
    worlds = [w for w in range(1, global_batch + 1) if global_batch % (w * micro_batch) == 0]
    micros = [m for m in range(1, global_batch + 1) if global_batch % (world_size * m) == 0]
    hint = f"world sizes that work with micro-batch {micro_batch}: {worlds[:12]}" if worlds else \
        f"no world size works with micro-batch {micro_batch}"
    hint += (f"; micro-batches that work on {world_size} ranks: {micros[:12]}" if micros
             else f"; no micro-batch works on {world_size} ranks")
    raise BatchSizeError(
        f"global batch {global_batch} cannot be split over {world_size} data-parallel ranks with micro-batch "
        f"{micro_batch}: {world_size} x {micro_batch} = {per_step} does not divide {global_batch} ({hint})")

"""``tidal.ckpt`` — concurrent, layout-independent checkpoints. Usable alone in any training script.

    from tidal import ckpt
    cp = ckpt.Checkpointer(url, process_group=None, keep=3)
    h = cp.save(step, state)     # returns once the state is captured; persisting continues
    h.wait()                     # this step is committed
    cp.close()                   # waits for everything pending
    step = ckpt.load(url, state) # newest committed step; fills `state` in place, resharding
    ckpt.steps(url)              # committed steps, ascending

See docs/checkpoint.md for the format and the guarantees.
"""

from tidal.ckpt.api import LoadStats, load, read_manifest, steps
from tidal.ckpt.checkpointer import Checkpointer, SaveHandle
from tidal.ckpt.errors import (
    CheckpointError,
    CorruptionError,
    ManifestError,
    NotFoundError,
    SaveError,
    StateError,
)
from tidal.ckpt.flatten import LocalShard
from tidal.ckpt.state import apply_training_state, training_state

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "load",
    "steps",
    "read_manifest",
    "LoadStats",
    "LocalShard",
    "training_state",
    "apply_training_state",
    "CheckpointError",
    "CorruptionError",
    "ManifestError",
    "NotFoundError",
    "SaveError",
    "StateError",
]

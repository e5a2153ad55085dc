"""``tidal.ckpt`` — concurrent, layout-independent checkpoints. Usable alone in any training script.

    from tidal import ckpt
    cp = ckpt.Checkpointer(tiers=["shm", "/nvme/run1", {"url": "s3://bucket/run1", "every": 5}])
    cp.save(step, state).wait()  # save returns once the state is captured; wait: committed
    step = ckpt.load(url, state) # newest committed step in any tier; fills `state` in place, resharding

See docs/checkpoint.md. Names are imported on first use (PEP 562): ``python -m tidal.ckpt.agent``
loads no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULES = {
    "engine.checkpointer": ["Checkpointer"],
    "engine.handle": ["SaveHandle"],
    "tiers.config": ["TierSpec"],
    "api": ["load", "steps", "read_manifest", "LoadStats"],
    "format.flatten": ["LocalShard"],
    "engine.state": ["training_state", "apply_training_state"],
    "engine.status": ["CheckpointStatus", "TierStatus", "StepStatus", "read_status"],
    "errors": ["CheckpointError", "CorruptionError", "FencedError", "ManifestError", "NotFoundError",
               "SaveError", "StateError", "TierError", "TierSpecError", "UnsafeFileError"],
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}
__all__ = [
    "Checkpointer", "SaveHandle", "TierSpec", "load", "steps", "read_manifest", "LoadStats", "LocalShard",
    "training_state", "apply_training_state", "CheckpointStatus", "TierStatus", "StepStatus", "read_status",
    "CheckpointError", "CorruptionError", "FencedError", "ManifestError", "NotFoundError", "SaveError",
    "StateError", "TierError", "TierSpecError", "UnsafeFileError",
]

if TYPE_CHECKING:
    from tidal.ckpt.api import LoadStats, load, read_manifest, steps
    from tidal.ckpt.engine.checkpointer import Checkpointer
    from tidal.ckpt.engine.handle import SaveHandle
    from tidal.ckpt.engine.state import apply_training_state, training_state
    from tidal.ckpt.engine.status import CheckpointStatus, StepStatus, TierStatus, read_status
    from tidal.ckpt.errors import (
        CheckpointError,
        CorruptionError,
        FencedError,
        ManifestError,
        NotFoundError,
        SaveError,
        StateError,
        TierError,
        TierSpecError,
        UnsafeFileError,
    )
    from tidal.ckpt.format.flatten import LocalShard
    from tidal.ckpt.tiers.config import TierSpec


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.ckpt.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""``(model, optimizer)`` ↔ a checkpointable state dict, through ``torch.distributed.checkpoint.state_dict``
(DDP, FSDP2 and tensor-parallel names; sharded tensors stay ``DTensor``)::

    state = training_state(model, optimizer, extra={"step": 0})
    ckpt.load(url, state)                # fills the tensors in place
    apply_training_state(model, optimizer, state)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported lazily: it costs ~1.5 s per process, and plain save/load don't need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   extra: dict[str, Any] | None = None, options: StateDictOptions | None = None) -> dict:
    """``{"model": ..., "optim": ..., **extra}`` with sharded tensors left sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    else:
        msd, osd = get_state_dict(model, optimizer, options=options)
        state = {"model": msd, "optim": osd}
    if extra:
        overlap = set(extra) & set(state)
        if overlap:
            raise ValueError(f"extra keys {sorted(overlap)} collide with 'model'/'optim'")
        state.update(extra)
    return state


def apply_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict, *,
                         options: StateDictOptions | None = None) -> None:
    """Load a (filled) state from :func:`training_state` back into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)

"""Other open checkpoint engines next to Tidal in ``python -m lab ckpt-peers``, each in a venv of its own.

A peer is an engine users would pick instead of Tidal (ByteCheckpoint, DLRover's flash checkpoint, NVIDIA's
nvidia-resiliency-ext). Their pins clash with Tidal's (and with each other's), so each is installed in its
own venv by ``lab/peers/setup.sh`` under :func:`venvs_root` and run there by an *adapter*: a module of
this package (``python -m lab.peers.<adapter>``, ``PYTHONPATH`` = Tidal's ``src`` and the repository)
that builds the same state as the main benchmark (:func:`tidal.bench.ckpt_state.build_state`), times the
engine with the same protocol (:mod:`lab.peers.protocol`) and writes one JSON document.
:mod:`lab.peers.runner` starts the adapters one after another and merges what they wrote into the
benchmark's result.

This module and the runner use the standard library only; the adapters need torch and their engine.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

VENVS_ENV = "TIDAL_PEER_VENVS"  # where the peer venvs are (lab/peers/setup.sh reads it too)
SETUP_SCRIPT = "lab/peers/setup.sh"
PROTOCOL = 1  # the version of the adapter's JSON document

# venv name (= the name setup.sh takes) -> the adapter module run by that venv's python
PEERS: dict[str, str] = {
    "bytecheckpoint": "lab.peers.bytecheckpoint",
    "dlrover": "lab.peers.dlrover",
    "nvidia-resiliency-ext": "lab.peers.nvrx",
}


def repo_dir() -> Path:
    """The repository holding ``lab``."""
    return Path(__file__).resolve().parents[2]


def pythonpath() -> str:
    """What the adapters get as ``PYTHONPATH``: the directory of the ``tidal`` this process would import
    (found, not imported), then the repository (for ``lab``)."""
    spec = importlib.util.find_spec("tidal")
    src = Path(spec.origin).parents[1] if spec and spec.origin else repo_dir() / "src"
    return os.pathsep.join([str(src), str(repo_dir())])


def venvs_root() -> Path:
    """``$TIDAL_PEER_VENVS``, else ``.peer-venvs`` in the repository."""
    env = os.environ.get(VENVS_ENV)
    return Path(env) if env else repo_dir() / ".peer-venvs"

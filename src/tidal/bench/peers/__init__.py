"""Other open checkpoint engines next to Tidal in ``tidal bench ckpt``, each in a venv of its own.

A peer is an engine users would pick instead of Tidal (ByteCheckpoint, DLRover's flash checkpoint, NVIDIA's
nvidia-resiliency-ext). Their pins clash with Tidal's (and with each other's), so each is installed in its
own venv by ``benchmarks/peers/setup.sh`` under :func:`venvs_root` and run there by an *adapter*: a module of
this package (``python -m tidal.bench.peers.<adapter>``, ``PYTHONPATH`` = Tidal's ``src``) that builds the
same state as the main benchmark (:func:`tidal.bench.ckpt_state.build_state`), times the engine with the
same protocol (:mod:`tidal.bench.peers.protocol`) and writes one JSON document.
:mod:`tidal.bench.peers.runner` starts the adapters one after another and merges what they wrote into the
benchmark's result.

This module and the runner use the standard library only; the adapters need torch and their engine.
"""

from __future__ import annotations

import os
from pathlib import Path

VENVS_ENV = "TIDAL_PEER_VENVS"  # where the peer venvs are (benchmarks/peers/setup.sh reads it too)
SETUP_SCRIPT = "benchmarks/peers/setup.sh"
PROTOCOL = 1  # the version of the adapter's JSON document

# venv name (= the name setup.sh takes) -> the adapter module run by that venv's python
PEERS: dict[str, str] = {
    "bytecheckpoint": "tidal.bench.peers.bytecheckpoint",
    "dlrover": "tidal.bench.peers.dlrover",
    "nvidia-resiliency-ext": "tidal.bench.peers.nvrx",
}


def src_dir() -> Path:
    """The directory holding the ``tidal`` package (what the adapters get as ``PYTHONPATH``)."""
    return Path(__file__).resolve().parents[3]


def venvs_root() -> Path:
    """``$TIDAL_PEER_VENVS``, else ``.peer-venvs`` in the repository this package was loaded from."""
    env = os.environ.get(VENVS_ENV)
    return Path(env) if env else src_dir().parent / ".peer-venvs"

"""Tidal: PyTorch training on a shared GPU pool, with concurrent, reshardable checkpoints."""

__version__ = "0.1.0"

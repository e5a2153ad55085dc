"""Errors raised by the checkpoint engine. Each message names the entry, file or step involved."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class for checkpoint errors."""


class StateError(CheckpointError, ValueError):
    """The state passed to ``save``/``load`` is malformed or does not match the checkpoint."""


class ManifestError(CheckpointError):
    """A manifest is missing, truncated, hand-edited or of an unknown format."""


class CorruptionError(CheckpointError):
    """Stored bytes do not match their checksum (names the file and step)."""


class NotFoundError(CheckpointError, FileNotFoundError):
    """No committed step (or not the requested one) exists at the location."""


class SaveError(CheckpointError):
    """Persisting a step failed; the previous committed step is untouched."""


class FencedError(SaveError):
    """A commit refused by the fence of the checkpoint location: another job or a newer attempt of this
    one owns it now (``tidal.ckpt.fence``), or its fence cannot be read. Nothing of the step is visible."""


class TierError(CheckpointError, OSError):
    """A tier is unreachable, misconfigured, or refused a request (names the tier and what to check)."""


class TierSpecError(CheckpointError, ValueError):
    """A tier specification is malformed (names the spec and what was expected)."""


class UnsafeFileError(CheckpointError, OSError):
    """A step folder or file in a directory tier is a symlink, a hard link out of the tier, or not a
    plain file: refused (names the path and why). Loads fall back to the next tier as for a bad copy."""

"""The storage-tier protocol: what the checkpointer and the loader need from a place that holds steps.

A tier stores named objects per step, ``<root>/step_<12 digits>/<name>`` (see ``manifest``).
Implementations: ``directory.DirTier``, ``s3.S3Tier``, ``peer.PeerTier``; optional abilities are
protocols checked with ``isinstance``. Contract: writes are atomic (a reader sees the whole object or
none); a step is committed when ``manifest.json`` is among its objects; a missing object raises
``FileNotFoundError``, an unreachable tier ``TierError`` (an ``OSError``), a range past an object's end
``TruncatedRead``; methods may be called from several threads at once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tidal.ckpt.format import manifest as mf


class TruncatedRead(Exception):  # noqa: N818 - a condition the reader turns into CorruptionError
    """An object ended before the requested range: ``offset``/``length`` asked, ``got`` returned."""

    def __init__(self, offset: int, length: int, got: int) -> None:
        super().__init__(f"bytes {offset}..{offset + length} requested, {got} returned")
        self.offset, self.length, self.got = offset, length, got


class RangeReader(Protocol):
    """An open data file of one step in one tier. Not shared between threads by the loader."""

    def read_ranges(self, ranges: Sequence[tuple[int, int]], out: memoryview) -> None:
        """Read each ``(offset, length)`` range, in order, into consecutive bytes of ``out`` (exactly
        the total length). An implementation may read ranges concurrently, never a byte outside them."""

    def close(self) -> None: ...


@runtime_checkable
class Tier(Protocol):
    """A place that holds committed steps.

    Attributes:
        name: label in stats, status and errors ("shm", "disk", "s3", ...); unique per tier list.
        kind: "shm", "dir", "s3" or "peer".
        location: the root, as a person would type it (a path or ``s3://bucket/prefix``).
        durable: survives the node's memory being lost (every kind but "shm").
        fast: written by the checkpointer's persist thread straight from the staging slot ("shm",
            "dir"); a slow tier (``False``) gets an upload queue instead, so it never holds a slot.
        poll_s: (first, longest) interval in seconds between polls while waiting for other ranks.
    """

    name: str
    kind: str
    location: str
    durable: bool
    fast: bool
    poll_s: tuple[float, float]

    def where(self, step: int, name: str | None = None) -> str:
        """Human-readable address of a step directory or of one object in it (for messages)."""

    def check(self) -> None:
        """Raise ``TierError`` naming the tier when it is unreachable or misconfigured."""

    # -- listing ---------------------------------------------------------------------------------
    def step_files(self) -> dict[int, set[str]]:
        """Every step directory (committed or torn) and the object names in it."""

    def committed(self) -> dict[int, float]:
        """Committed steps and when each was committed (unix seconds; manifest mtime)."""

    def committed_steps(self) -> list[int]: ...

    def list_files(self, step: int) -> set[str]:
        """Object names in one step directory (empty when it does not exist)."""

    def file_sizes(self, step: int) -> dict[str, int]:
        """Object name -> size in bytes, for one step directory (empty when it does not exist)."""

    # -- small objects ---------------------------------------------------------------------------
    def read_bytes(self, step: int, name: str) -> bytes: ...

    def write_bytes(self, step: int, name: str, data: bytes) -> None: ...

    def read_manifest(self, step: int) -> mf.Manifest:
        """The parsed manifest of ``step``; ``ManifestError`` naming the object when missing or bad."""

    # -- data ------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data: memoryview) -> None: ...

    def open_file(self, step: int, name: str) -> RangeReader: ...

    # -- removal ---------------------------------------------------------------------------------
    def remove_file(self, step: int, name: str) -> None:
        """Remove one object; a missing object is not an error."""

    def remove_step(self, step: int) -> None:
        """Remove a step: its manifest first (so it is never seen half-removed), then the rest."""


@runtime_checkable
class HandoffTier(Protocol):
    """A slow tier that can take a data file from node memory while the staging slot is still held."""

    def handoff(self, step: int, name: str, data: memoryview, path: str | os.PathLike | None = None) -> None:
        """Start taking ``data`` (the slot file at ``path`` when shm-backed); returns quickly."""

    def wait_handoff(self, step: int, name: str) -> None:
        """Block until the slot's bytes are no longer needed (after that the slot may be reused)."""


@runtime_checkable
class DiscardTier(Protocol):
    """A tier holding handed-off data files that must be dropped when their step is abandoned."""

    def discard(self, step: int, name: str) -> None: ...

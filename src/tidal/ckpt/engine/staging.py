"""Staging slots: reusable CPU buffers laid out as this rank's safetensors file.

A save copies into a free slot (``save`` blocks only when every slot is busy); a slot is a file on
``/dev/shm`` hard-linked into the shm tier's step directory, so the stall's copy survives a crash of
the process. Buffers are touched once per layout and pinned on a CUDA machine; without shared memory a
slot is an anonymous buffer and the shm tier is skipped."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from pathlib import Path

import torch

from tidal.ckpt.format.flatten import ST_TO_DTYPE
from tidal.ckpt.format.plan import PlannedPiece, RankFile
from tidal.files import private_dirs

log = logging.getLogger(__name__)


class Slot:
    """One staging buffer. ``free`` is set while no save uses it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.free = threading.Event()
        self.free.set()
        self.step = -1  # the step saved into it last
        self.path: Path | None = None  # the shm file, when shm-backed
        self.fingerprint: str | None = None
        self.size = 0
        self._mmap: mmap.mmap | None = None
        self.buffer: torch.Tensor | None = None  # uint8, the whole file image
        self.views: dict[str, torch.Tensor] = {}
        self._pinned = False
        # Steps whose shm-tier data file is a hard link to this slot's file (cleared on re-layout).
        self.linked: set[int] = set()

    def reusable(self, fingerprint: str) -> bool:
        """Whether ``allocate`` with this layout keeps the current file (and overwrites its bytes)."""
        return self.fingerprint == fingerprint and self.buffer is not None

    def memoryview(self) -> memoryview:
        assert self.buffer is not None
        if self._mmap is not None:
            return memoryview(self._mmap)
        return self.buffer.numpy().data.cast("B")

    def allocate(self, rf: RankFile, fingerprint: str, shm_dir: Path | None, dtypes: dict[str, str]) -> None:
        """(Re)lay out this slot for ``rf``; a no-op when the layout is unchanged."""
        if self.reusable(fingerprint):
            return
        self.release()
        size = max(rf.size_bytes, 8)
        if shm_dir is not None:
            private_dirs(shm_dir)
            path = shm_dir / f"r{rf.rank:05d}-slot{self.index}.safetensors"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # never resize an inode a committed shm step may still link to
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self.path = path
        else:
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self.path = None
        self.buffer.zero_()  # fault every page in now, not during the first timed save
        self._pin()
        self.size = size
        self.buffer[: len(rf.header)].copy_(torch.frombuffer(bytearray(rf.header), dtype=torch.uint8))
        self.views = {p.key: self._view(p, dtypes[p.name]) for p in rf.pieces}
        self.fingerprint = fingerprint

    def _view(self, p: PlannedPiece, st_dtype: str) -> torch.Tensor:
        assert self.buffer is not None
        raw = self.buffer[p.start : p.start + p.nbytes]
        return raw.view(ST_TO_DTYPE[st_dtype]).view(p.box.lengths)

    def _pin(self) -> None:
        if self._mmap is None or self.buffer is None or not torch.cuda.is_available():
            return
        try:  # register the shm mapping as page-locked so device-to-host copies are DMA
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            self._pinned = int(getattr(rc, "value", rc)) == 0
        except Exception as e:  # pragma: no cover - needs a GPU
            log.warning("could not pin staging slot %s: %s", self.path, e)

    def release(self) -> None:
        if self._pinned:  # pragma: no cover - needs a GPU
            with contextlib.suppress(Exception):
                assert self.buffer is not None  # pinned: _pin found it
                torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._pinned = False
        self.views = {}
        self.linked = set()
        self.buffer = None
        self.fingerprint = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a view is still alive; the GC unmaps it later
                self._mmap.close()
            self._mmap = None


def shm_has_room(path: Path, need_bytes: int) -> bool:
    """Whether the filesystem at ``path`` has ``need_bytes`` free (with 10% headroom)."""
    try:
        st = os.statvfs(private_dirs(path))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= need_bytes * 1.1


def drop_stale_slots(slot_dir: Path, world: int) -> None:
    """Remove slot files of ranks beyond the current world that no step links to any more."""
    with contextlib.suppress(FileNotFoundError):
        for n in os.listdir(slot_dir):
            if n.startswith("r") and n[1:6].isdigit() and int(n[1:6]) >= world:
                p = slot_dir / n
                with contextlib.suppress(OSError):
                    if os.stat(p).st_nlink == 1:
                        p.unlink()

"""The commit protocol, cleanup and retention, written once against ``protocol.Tier``.

Every rank writes its data file, then a sidecar (``r<rank>-<save_id>.json``: its checksums); rank 0
waits for all sidecars and writes ``manifest.json`` last; the others wait for it. A step without a
manifest is invisible and removed by a later ``cleanup``; a failing rank writes an error sidecar (rank
0 a failure marker) so nobody waits out the timeout. Runs on background threads; no collective."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator

from tidal.ckpt.errors import FencedError, ManifestError, SaveError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.directory import failure_name, sidecar_name
from tidal.ckpt.tiers.protocol import Tier

log = logging.getLogger(__name__)
FENCED_MARK = "fenced: "  # opens a failure marker written because the fence refused the commit


def write_json(tier: Tier, step: int, name: str, doc: dict) -> None:
    tier.write_bytes(step, name, json.dumps(doc, separators=(",", ":")).encode())


def read_json(tier: Tier, step: int, name: str) -> dict | None:
    """The JSON object ``name`` of ``step``, or None when it is missing or not a JSON object."""
    try:
        doc = json.loads(tier.read_bytes(step, name))
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _polls(tier: Tier, step: int, timeout_s: float, cancel: threading.Event | None) -> Iterator[bool]:
    """One item per poll of ``tier``, backing off up to ``tier.poll_s[1]``: whether ``timeout_s`` had
    passed before it (the caller then gives up); SaveError once ``cancel`` is set."""
    deadline, delay = time.monotonic() + timeout_s, tier.poll_s[0]
    while True:
        yield time.monotonic() > deadline
        if cancel is not None and cancel.is_set():
            raise SaveError(f"step {step}: gave up waiting on tier '{tier.name}' (the checkpointer is "
                            "closing)")
        time.sleep(delay)
        delay = min(delay * 2, tier.poll_s[1])


def wait_sidecars(tier: Tier, step: int, save_id: str, world: int, timeout_s: float,
                  cancel: threading.Event | None = None) -> list[dict]:
    """Rank 0: wait until every rank's sidecar for this save exists; return them by rank."""
    docs: dict[int, dict] = {}
    wanted = {sidecar_name(r, save_id): r for r in range(world)}
    for late in _polls(tier, step, timeout_s, cancel):
        present = tier.list_files(step) if world > 1 else set(wanted)
        for name in present & wanted.keys():
            r = wanted[name]
            if r in docs:
                continue
            doc = read_json(tier, step, name)
            if doc is None:
                continue
            if doc.get("error"):
                raise SaveError(f"step {step}: rank {r} failed to persist to tier '{tier.name}': "
                                f"{doc['error']}")
            docs[r] = doc
        if len(docs) == world:
            return [docs[r] for r in range(world)]
        if late:
            missing = [r for r in range(world) if r not in docs]
            raise SaveError(f"step {step}: ranks {missing} did not finish writing to tier '{tier.name}' "
                            f"within {timeout_s:.0f} s; the step stays uncommitted")
    raise AssertionError("unreachable")


def wait_committed(tier: Tier, step: int, save_id: str, timeout_s: float,
                   cancel: threading.Event | None = None) -> None:
    """Ranks other than 0: wait until rank 0 committed this save (or reported failure)."""
    for late in _polls(tier, step, timeout_s, cancel):
        doc = read_json(tier, step, mf.MANIFEST)
        if doc is not None and doc.get("save_id") == save_id:
            return
        with contextlib.suppress(FileNotFoundError):
            why = tier.read_bytes(step, failure_name(save_id)).decode(errors="replace")
            if why.startswith(FENCED_MARK):  # rank 0 was fenced out: so is this rank (same attempt)
                raise FencedError(why[len(FENCED_MARK):])
            raise SaveError(f"step {step}: commit to tier '{tier.name}' failed: {why}")
        if late:
            raise SaveError(f"step {step}: not committed to tier '{tier.name}' within {timeout_s:.0f} s")


def commit(tier: Tier, step: int, doc: dict, fence: Callable[[int], None] | None = None) -> None:
    """Rank 0: make the step visible by writing its manifest last, atomically. ``fence(step)`` first:
    it raises ``FencedError`` when the location belongs to another job or a newer attempt now
    (``tidal.ckpt.fence``), and nothing becomes visible."""
    if fence is not None:
        fence(step)
    write_json(tier, step, mf.MANIFEST, doc)


def mark_failed(tier: Tier, step: int, save_id: str, why: str | BaseException) -> None:
    """Rank 0: the other ranks stop waiting for this save (a refused commit: they learn it was the fence)."""
    text = (FENCED_MARK if isinstance(why, FencedError) else "") + str(why)
    with contextlib.suppress(OSError):
        tier.write_bytes(step, failure_name(save_id), text.encode())


def report_error(tier: Tier, step: int, rank: int, save_id: str, why: str) -> None:
    """A rank's error sidecar: rank 0 stops waiting for this rank and fails the step."""
    with contextlib.suppress(OSError):
        write_json(tier, step, sidecar_name(rank, save_id), {"rank": rank, "error": why})


def cleanup(tier: Tier, keep: int, committed_step: int, busy: Callable[[int], bool] = lambda s: False,
            lock: threading.Lock | None = None) -> list[int]:
    """Rank 0, after committing ``committed_step``: remove and return torn steps (no manifest),
    superseded steps (committed steps *newer* than it, left by a run this job abandoned when it resumed
    from an older step: kept, they would hijack the next restore), steps past the newest ``keep`` (0
    keeps all; ``committed_step`` always stays), and stray files. Steps for which ``busy(step)`` is
    true are never touched; the check and the removal happen under ``lock``, under which ``save``
    registers a step before any rank may write it.
    """
    removed = []
    lock = lock or threading.Lock()

    def remove(s: int) -> None:
        with lock:
            if busy(s):
                return
            tier.remove_step(s)
        removed.append(s)

    files = tier.step_files()
    committed = sorted(s for s, names in files.items() if mf.MANIFEST in names)
    for s in sorted(s for s, names in files.items() if mf.MANIFEST not in names):
        remove(s)
    for s in committed:
        if s > committed_step:
            log.warning("removing step %d from tier '%s': superseded by step %d of the resumed run",
                        s, tier.name, committed_step)
            remove(s)
    older = [s for s in committed if s <= committed_step]
    if keep > 0:
        for s in older[:-keep]:
            if s != committed_step:
                remove(s)
    for s in older:
        if s in removed:
            continue
        with lock:
            if busy(s):
                continue
        try:  # only a manifest whose checksum holds may say which files are stray
            doc = mf.verified_doc(tier.read_bytes(s, mf.MANIFEST), tier.where(s, mf.MANIFEST))
            keep_files = {f["name"] for f in doc["files"]} | {mf.MANIFEST}
        except (OSError, ManifestError, TypeError, KeyError):
            keep_files = None
        if keep_files is None:
            continue  # a damaged manifest is left for a person to look at
        for n in files.get(s, set()) - keep_files:
            with contextlib.suppress(OSError):
                tier.remove_file(s, n)
    return removed

"""Loading (= resharding) and listing committed steps, from a location or a tier list.

``load`` is collective when a process group is in use (ranks agree on the step and on skipping it);
each rank reads exactly the byte ranges of the stored pieces its tensors need, each from the fastest
tier that has it (``reader``), skipping unreachable tiers and falling back to an older step when no
tier serves one intact (docs/checkpoint.md, "Integrity")."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tidal.ckpt.engine import comm
from tidal.ckpt.errors import CorruptionError, ManifestError, NotFoundError, StateError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.config import describe, read_tiers
from tidal.ckpt.tiers.directory import newest_manifest
from tidal.ckpt.tiers.protocol import Tier

log = logging.getLogger(__name__)


@dataclass
class LoadStats:
    """What a ``load`` did on this rank. ``read_amplification`` is 1.0 when only needed bytes were read.
    ``fallbacks``: one line per piece a faster tier could not serve and per tier that could not be
    listed; ``skipped_steps``: one line per newer step skipped for an older one (what and why)."""

    step: int = -1
    manifest_tier: str = ""
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    pieces_read: int = 0
    fallbacks: list[str] = field(default_factory=list)
    skipped_steps: list[str] = field(default_factory=list)

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


UrlOrTiers = str | os.PathLike | list | tuple


def held_steps(tiers: list[Tier], notes: list[str] | None = None, failed: list | None = None,
               *, must_list: bool = True) -> dict[int, list[Tier]]:
    """Committed step -> the tiers holding it, fastest first, by step. A tier that cannot be listed is left
    out, said in ``notes`` (and ``failed``); with ``must_list`` logged, and raised when none can be."""
    out: dict[int, list[Tier]] = {}
    errors = []
    for t in tiers:
        try:
            listed = t.committed_steps()
        except OSError as e:
            errors.append(e)
            if must_list:
                log.warning("tier '%s' (%s) is unreachable: %s", t.name, t.location, e)
            if notes is not None:
                notes.append(f"tier '{t.name}' ({t.location}) could not be listed: {e}")
            if failed is not None:
                failed.append((t, str(e)))
            continue
        for s in listed:
            out.setdefault(s, []).append(t)
    if must_list and errors and len(errors) == len(tiers):
        raise errors[0]
    return dict(sorted(out.items()))


def steps(url_or_tiers: UrlOrTiers) -> list[int]:
    """Committed steps in any tier (node shared memory, directories, object storage), ascending."""
    return list(held_steps(read_tiers(url_or_tiers)))


def pick(where: str, held: dict[int, list[Tier]], step: int | None, notes: list[str] | None = None,
         process_group: Any = None) -> int:
    """``step``, else the newest step in ``held`` (the oldest newest over the ranks); NotFoundError naming
    ``where`` (and ``notes``) when it is not committed."""
    if not held:
        why = f" ({'; '.join(notes)})" if notes else ""
        raise NotFoundError(f"no committed checkpoint step at {where}{why}")
    chosen = comm.all_min(max(held), process_group) if step is None else step
    if chosen not in held:
        raise NotFoundError(f"step {chosen} is not committed at {where}; committed steps: "
                            f"{sorted(held)[-10:]}")
    return chosen


def _choose(url_or_tiers: UrlOrTiers, step: int | None, process_group: Any,
            notes: list[str] | None) -> tuple[int, dict[int, list[Tier]]]:
    held = held_steps(read_tiers(url_or_tiers), notes)
    return pick(describe(url_or_tiers), held, step, None, process_group), held


def load(url_or_tiers: UrlOrTiers, state: dict, step: int | None = None, process_group: Any = None, *,
         strict: bool = True, verify: bool = True, stats: LoadStats | None = None,
         fallback_older: bool | None = None, key: bytes | str | bool | None = None) -> int:
    """Fill ``state`` in place from a committed step (the newest in any tier by default); return the step.

    Tensors (plain, DTensor, LocalShard) get the part this rank holds now, whatever layout they were
    saved from; non-tensor values are replaced. ``strict``: the checkpoint and ``state`` hold exactly
    the same entries. ``verify`` checks the CRC-32 of every block read. ``fallback_older`` (default:
    when ``step`` is None): skip a step no tier serves intact for the newest older one. ``key``: the
    checkpoint key the manifest must be signed with (default ``$TIDAL_CKPT_KEY``; none, or ``False``:
    checksums only, e.g. for another job's checkpoint you trust).
    """
    key = mf.checkpoint_key(key)
    stats = stats if stats is not None else LoadStats()
    older_ok = step is None if fallback_older is None else fallback_older
    chosen, held = _choose(url_or_tiers, step, process_group, stats.fallbacks)
    while True:
        holding = list(held[chosen])
        error: CorruptionError | ManifestError | None = None
        try:
            tier, man = newest_manifest(holding, chosen, key)
            holding.sort(key=lambda t: t is not tier)  # the tier whose manifest we read comes first
            stats.step, stats.manifest_tier = chosen, tier.name
            _fill(man, holding, state, strict=strict, verify=verify, stats=stats)
        except (CorruptionError, ManifestError) as e:
            if not older_ok:
                raise
            error = e
        if not older_ok or comm.all_min(0 if error else 1, process_group):
            return chosen
        older = comm.all_min(max((s for s in held if s < chosen), default=-1), process_group)
        why = str(error) if error is not None else "another rank could not read it intact"
        line = f"step {chosen}: skipped: {why}"
        stats.skipped_steps.append(line)
        if older < 0:
            if len(stats.skipped_steps) > 1:
                why = "; ".join(stats.skipped_steps)
            raise (type(error) if error is not None else CorruptionError)(f"{why} (no older intact step)")
        log.warning("checkpoint %s; falling back to step %d", line, older)
        chosen = older


def _fill(man: mf.Manifest, tiers: list[Tier], state: dict, *, strict: bool, verify: bool,
          stats: LoadStats) -> None:
    from tidal.ckpt.engine.reader import PieceReader  # torch: only a load needs it
    from tidal.ckpt.format.flatten import flatten, set_path

    tensors, objects = flatten(state)
    stored_objects = {tuple(p): v for p, v in man.objects}
    want_t = {e.name: e for e in tensors}
    want_o = {tuple(o.path): o for o in objects}
    stored_o_names = {mf.path_name(p): p for p in stored_objects}
    # An entry may be a tensor on one side and a plain value on the other.
    for name in want_t:
        if name in stored_o_names:
            raise StateError(f"entry '{name}': state holds a tensor but step {man.step} stores a plain value")
    for p in want_o:
        if mf.path_name(p) in man.tensors:
            raise StateError(f"entry '{mf.path_name(p)}': state holds a plain value but step {man.step} "
                             "stores a tensor")
    missing = [n for n in want_t if n not in man.tensors] + [
        mf.path_name(p) for p in want_o if p not in stored_objects]
    unexpected = [n for n in man.tensors if n not in want_t] + [
        mf.path_name(p) for p in stored_objects if p not in want_o and mf.path_name(p) not in want_t]
    if strict and (missing or unexpected):
        raise StateError(f"state and step {man.step} hold different entries (pass strict=False to load the "
                         f"common ones): missing from the checkpoint: {sorted(missing)[:10]}"
                         f"{' …' if len(missing) > 10 else ''}; unexpected in the checkpoint: "
                         f"{sorted(unexpected)[:10]}{' …' if len(unexpected) > 10 else ''}")
    pairs = [(entry, man.tensors[name]) for name, entry in want_t.items() if name in man.tensors]
    for entry, st in pairs:
        if tuple(entry.global_shape) != st.shape or entry.dtype != st.dtype:
            raise StateError(f"tensor '{entry.name}': state expects dtype {entry.dtype} shape "
                             f"{list(entry.global_shape)}, step {man.step} stores dtype {st.dtype} shape "
                             f"{list(st.shape)}")
    reader = PieceReader(man, tiers, verify, stats)
    try:
        reader.fill_all(pairs)
    finally:
        reader.close()
    for p, o in want_o.items():
        if p in stored_objects:
            set_path(state, o.path, _conform(stored_objects[p], o.value))


def _conform(stored: Any, like: Any) -> Any:
    """JSON has no tuples: give back tuples where the target state had them (e.g. Adam's betas)."""
    if isinstance(like, tuple) and isinstance(stored, list) and len(like) == len(stored):
        return tuple(_conform(s, x) for s, x in zip(stored, like, strict=True))
    if isinstance(like, list) and isinstance(stored, list) and len(like) == len(stored):
        return [_conform(s, x) for s, x in zip(stored, like, strict=True)]
    if isinstance(like, dict) and isinstance(stored, dict):  # JSON keys are strings: restore int keys
        keys = {str(k): k for k in like}
        return {keys.get(k, k): _conform(v, like[keys[k]]) if k in keys else v for k, v in stored.items()}
    return stored


def read_manifest(url_or_tiers: UrlOrTiers, step: int | None = None,
                  key: bytes | str | bool | None = None) -> tuple[Tier, mf.Manifest]:
    """The manifest of ``step`` (newest by default) from the fastest tier holding it (signed with
    ``key``, default ``$TIDAL_CKPT_KEY``, when there is one)."""
    chosen, held = _choose(url_or_tiers, step, None, None)
    return newest_manifest(held[chosen], chosen, mf.checkpoint_key(key))

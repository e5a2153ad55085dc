"""``tidal ckpt export``: one consolidated safetensors file from a checkpoint of any layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from tidal.ckpt import cli_common as cc
from tidal.ckpt.api import held_steps, pick
from tidal.ckpt.cli_common import JsonOpt, StepOpt, UrlArg
from tidal.ckpt.errors import CorruptionError, ManifestError
from tidal.ckpt.format.manifest import path_name
from tidal.console import console
from tidal.files import AS_OPEN, atomic_path


def _put(state: dict, path: tuple, value: Any) -> None:
    cur = state
    for i, k in enumerate(path[:-1]):
        nxt = cur.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ManifestError(f"entry '{path_name(path)}' lies inside '{path_name(path[: i + 1])}', "
                                "which is a value of its own")
        cur = nxt
    if not path:
        raise ManifestError("an entry has an empty path")
    if path[-1] in cur:
        raise ManifestError(f"entry '{path_name(path)}' appears twice")
    cur[path[-1]] = value


def _get(state: dict, path: tuple) -> Any:
    cur: Any = state
    for k in path:
        cur = cur[k]
    return cur


def _entry_prefix(entry: str | None, man: Any) -> tuple:
    """``--entry model/sub`` as a path prefix; ``ValueError`` naming the entries if it holds no tensor."""
    if entry is None:
        return ()
    prefix = tuple(x for x in entry.strip().strip("/").split("/") if x)
    if not prefix or not any(tuple(t.path[:len(prefix)]) == prefix for t in man.tensors.values()):
        tops = sorted({str(t.path[0]) for t in man.tensors.values() if t.path})
        raise ValueError(f"--entry {entry!r}: no tensor under it; the checkpoint's entries: "
                         f"{', '.join(tops)}")
    return prefix


def export_cmd(
    url: UrlArg,
    out: Annotated[Path, typer.Argument(help="Output .safetensors file (overwritten).", show_default=False)],
    step: StepOpt = None,
    as_json: JsonOpt = False,
    entry: Annotated[str | None, typer.Option(
        "--entry", help="Only this entry (e.g. model, or optim/state), its prefix stripped from the names: "
                        "a training_state checkpoint's --entry model is a plain state dict, as Hugging Face "
                        "tools load it.")] = None,
) -> None:
    """Write one consolidated safetensors file: every tensor assembled to its global shape.

    Plain (non-tensor) values go into the file's metadata as JSON under the key "tidal.objects".
    Names are the entries' paths joined by "/" (model/w); with --entry model, only that entry's
    tensors, named without the prefix (w).
    """
    import torch
    from safetensors.torch import save_file

    from tidal.ckpt.api import LoadStats, load, read_manifest  # torch: only this command needs it
    from tidal.ckpt.format.flatten import ST_TO_DTYPE

    with cc.errors():
        source, tiers, where = cc.source(url)
        notes: list[str] = []
        held = held_steps(tiers, notes, must_list=False)
        s = pick(where, held, step, notes)
        cc.note(notes)
        tier, man = read_manifest(source, s)  # the same copy load() reads (of step s: checked)
        # Shapes are bounded by the bytes the manifest lists; those must be present before allocating.
        sizes = [t.file_sizes(s) for t in held.get(s, [])]
        for f in man.files:
            if not any(sz.get(f["name"], -1) >= f["size_bytes"] for sz in sizes):
                raise CorruptionError(f"{tier.where(s, f['name'])}: the manifest lists {f['size_bytes']} "
                                      "bytes; no tier holds the file whole")
        prefix = _entry_prefix(entry, man)
        picked = {n: t for n, t in man.tensors.items() if tuple(t.path[:len(prefix)]) == prefix}
        plain = [(p, v) for p, v in man.objects if tuple(p[:len(prefix)]) == prefix and len(p) > len(prefix)]
        state: dict = {}
        for t in picked.values():
            _put(state, tuple(t.path), torch.empty(t.shape, dtype=ST_TO_DTYPE[t.dtype]))
        for p, v in plain:
            _put(state, tuple(p), v)
        stats = LoadStats()
        load(source, state, step=s, strict=not prefix, verify=True, stats=stats)  # reads only what is picked
        tensors = {("/".join(map(str, t.path[len(prefix):])) if prefix else name): _get(state, tuple(t.path))
                   for name, t in sorted(picked.items())}
        objects = [{"path": list(p[len(prefix):]), "value": _get(state, tuple(p))} for p, _ in plain]
        metadata = {"format": "pt", "tidal.objects": json.dumps(objects), "tidal.step": str(s),
                    "tidal.save_id": man.save_id, "tidal.layout": man.layout_summary(),
                    **({"tidal.entry": "/".join(prefix)} if prefix else {})}
        out = out.expanduser()
        if out.is_dir():
            raise IsADirectoryError(21, "output is a directory", str(out))
        with atomic_path(out, mode=AS_OPEN, durable=False) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
        size = out.stat().st_size
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if as_json:
        cc.emit_json({"step": s, "tier": tier.name, "out": str(out), "tensors": len(tensors),
                      "objects": len(objects), "bytes": nbytes, "file_bytes": size,
                      "bytes_read": stats.bytes_read, "bytes_by_tier": stats.bytes_by_tier,
                      "fallbacks": stats.fallbacks})
    else:
        con = console()
        con.print(Text(f"exported step {s} of {where} ({man.layout_summary()}) to {out}: "
                       f"{len(tensors)} tensor(s), {cc.human(nbytes)}; {len(objects)} plain value(s) in "
                       f"metadata 'tidal.objects'; file {cc.human(size)}"), soft_wrap=True)
        for fb in stats.fallbacks:
            con.print(Text(f"note: fell back to another tier: {fb}", style="yellow"), soft_wrap=True)

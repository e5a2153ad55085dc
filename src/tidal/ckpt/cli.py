"""``tidal ckpt``: list, inspect, verify and export checkpoints.

    tidal ckpt ls URL [--tier SPEC]...                  committed steps, tiers, size, saved layout, status
    tidal ckpt inspect URL [--step N] [--pieces]        entries, dtypes, shapes, pieces, plain values
    tidal ckpt verify URL [--step N | --all]            re-read every piece in every tier, check CRCs
    tidal ckpt export URL OUT.safetensors [--step N] [--entry model]   one consolidated safetensors file
    tidal ckpt agent --listen HOST:PORT --mem-dir DIR [--buddy HOST:PORT]   this node's checkpoint agent

URL is a location - a directory, ``s3://bucket/prefix`` (credentials and endpoint from the standard
``AWS_*`` variables, as for the S3 tier) or ``peer://NAME`` (agents from ``TIDAL_CKPT_AGENT`` /
``TIDAL_CKPT_PEERS``) - with this node's shm tier in front when it has one, or a tier list as JSON in
the syntax ``Checkpointer(tiers=...)`` takes, e.g. ``'["shm", "/ckpt/run1", "s3://bucket/run1"]'``.
Every command reads through the tier objects (ranged reads from S3 and the agents). For a directory,
``ls`` also lists the job's other tiers recorded in this node's status file (see ``status``).
Every command prints Rich tables for people and, with ``--json``, one JSON document on stdout for
programs. A missing directory, an unknown step or a damaged manifest prints one line on stderr and
exits 1; ``verify`` exits 1 when it finds any problem. Nothing here unpickles: manifests are JSON
and data files are safetensors.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table
from rich.text import Text

from tidal.ckpt.agent.cli import agent_cmd
from tidal.ckpt.api import LoadStats, load, read_manifest
from tidal.ckpt.engine.status import CheckpointStatus, read_status
from tidal.ckpt.errors import CheckpointError, CorruptionError, ManifestError, NotFoundError, TierSpecError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.format.flatten import ST_TO_DTYPE, path_name
from tidal.ckpt.tiers.config import build, describe, kind_of, normalize, read_tiers, resolve
from tidal.ckpt.tiers.directory import DirTier, is_peer_url, is_s3_url, local_path, shm_root_for, tiers_for
from tidal.ckpt.verify import Checked, Problem, _check_step, _read, _verify_tier
from tidal.console import console

app = typer.Typer(
    help="Inspect, verify and export checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_URL_HELP = (
    "Checkpoint location: a directory (path or file:// URL), s3://bucket/prefix or peer://NAME; or a tier "
    'list as JSON, e.g. \'["shm", "/ckpt/run1", "s3://bucket/run1"]\'.'
)
UrlArg = Annotated[str, typer.Argument(help=_URL_HELP, show_default=False)]
LsUrlArg = UrlArg
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]
StepOpt = Annotated[
    int | None, typer.Option("--step", min=0, help="Step to use (default: the newest committed step).")
]


# -- output helpers --------------------------------------------------------------------------------

def _fail(msg: str) -> NoReturn:
    console(stderr=True).print(Text.assemble(("error: ", "bold red"), " ".join(msg.split())), soft_wrap=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Turn the engine's and the OS's errors into one readable line on stderr and exit code 1."""
    try:
        yield
    except (CheckpointError, OSError, ValueError) as e:
        _fail(str(e) or type(e).__name__)


def _emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(ts: float) -> str:
    if not ts:
        return "?"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _iso(ts: float) -> str | None:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).isoformat() if ts else None


def _truncate(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _t(v: Any, style: str = "") -> Text:
    """A table cell that is shown verbatim (tensor names may contain Rich markup characters)."""
    return Text(str(v), style=style)


# -- locating steps --------------------------------------------------------------------------------

def _tiers(url: str) -> list[DirTier]:
    tiers = tiers_for(url)
    root = local_path(url)
    if root.exists() and not root.is_dir():
        raise NotFoundError(f"{root} is not a directory")
    if not root.exists() and all(t.name == "disk" for t in tiers):
        raise NotFoundError(f"checkpoint directory {root} does not exist")
    return tiers


def _tier_list(url: str) -> list | None:
    """The tier list ``url`` spells as JSON, or None when it is a location."""
    if not url.lstrip().startswith("["):
        return None
    try:
        specs = json.loads(url)
    except ValueError as e:
        raise TierSpecError(f"tier list {url!r} is not valid JSON ({e}); expected e.g. "
                            '\'["shm", "/ckpt/run1", "s3://bucket/run1"]\'') from None
    return specs


def _source(url: str) -> tuple[str | list, list, str]:
    """(what ``load`` takes, the tiers to read, fastest first, a name for messages) for a URL argument."""
    specs = _tier_list(url)
    if specs is not None:
        return specs, read_tiers(specs), describe(specs)
    if is_s3_url(url) or is_peer_url(url):
        return url, tiers_for(url), url.rstrip("/")
    return url, _tiers(url), str(local_path(url))


def _held(tiers: list, errors: list[str] | None = None,
          failed: list[tuple[Any, str]] | None = None) -> dict[int, list]:
    """Committed step -> the tiers holding it, fastest first. With ``errors``, a tier that cannot be
    listed is skipped and reported there (and as (tier, why) in ``failed``) instead of raising."""
    out: dict[int, list] = {}
    for t in tiers:
        try:
            steps = t.committed_steps()
        except OSError as e:
            if errors is None:
                raise
            errors.append(f"tier '{t.name}' ({t.location}) could not be listed: {e}")
            if failed is not None:
                failed.append((t, str(e)))
            continue
        for s in steps:
            out.setdefault(s, []).append(t)
    return dict(sorted(out.items()))


def _ls_tiers(url: str, extra: list[str]) -> tuple[list, CheckpointStatus | None]:
    """The location's tiers, plus ``extra`` tier specs - by default the job's other durable tiers
    as recorded in this node's status file for it (so an S3 tier shows up without naming it)."""
    specs_given = _tier_list(url)
    s3 = is_s3_url(url) or is_peer_url(url)  # (not a directory)
    if specs_given is not None:
        home = resolve(specs_given, default_keep=0)[0]
        tiers = read_tiers(specs_given)
    else:
        tiers = tiers_for(url) if s3 else _tiers(url)
        home = url.rstrip("/") if s3 else str(local_path(url))
    status = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        status = read_status(shm_root_for(url) / "status.json")
    specs: list[Any] = list(extra)
    if not specs and status is not None:
        specs = [{"url": t.location, "name": t.name} for t in status.tiers if t.kind != "shm"]
    have = {t.location for t in tiers} | {home}
    specs = [sp for sp in specs if normalize_location(sp["url"] if isinstance(sp, dict) else sp) not in have]
    if specs:
        _, cfgs = resolve(["shm", home, *specs], default_keep=0, home=home)
        tiers += [build(c, home) for c in cfgs[2:]]
    return tiers, status


def normalize_location(spec: str) -> str:
    try:
        return normalize(spec, kind_of(spec, repr(spec)))
    except (ValueError, CheckpointError):
        return spec


def _pick(where: str, held: dict[int, list], step: int | None, notes: list[str] | None = None) -> int:
    if not held:
        raise NotFoundError(
            f"no committed checkpoint step at {where}" + (f" ({'; '.join(notes)})" if notes else "")
        )
    if step is None:
        return max(held)
    if step not in held:
        raise NotFoundError(f"step {step} is not committed at {where}; committed steps: {sorted(held)[-10:]}")
    return step


def _note(lines: list[str]) -> None:
    con = console(stderr=True)
    for ln in lines:
        con.print(Text(f"note: {ln}", style="yellow"), soft_wrap=True)


def _manifests(tiers: list[DirTier], step: int) -> tuple[tuple[DirTier, mf.Manifest] | None, list[str]]:
    """The first tier's manifest of ``step`` that parses, and an error line per damaged copy."""
    good: tuple[DirTier, mf.Manifest] | None = None
    errors: list[str] = []
    for t in tiers:
        try:
            m = _read(t, step)
        except ManifestError as e:
            errors.append(f"tier '{t.name}' step {step}: {e}")
            continue
        if good is None:
            good = (t, m)
    return good, errors


# -- ls --------------------------------------------------------------------------------------------

TierOpt = Annotated[list[str] | None, typer.Option(
    "--tier", help="Also list this tier (a directory or s3://bucket/prefix); repeatable. Default: the job's "
                   "other tiers as recorded in this node's status file, if any.", show_default=False)]


@app.command("ls")
def ls_cmd(url: LsUrlArg, tier: TierOpt = None, as_json: JsonOpt = False) -> None:
    """List committed steps: tiers holding each, size, files, creation time, saved layout; and the
    job's durability status (newest durable step, its age, backlogs) when this node has it."""
    errors: list[str] = []
    with _errors():
        tiers, status = _ls_tiers(url, tier or [])
        held = _held(tiers, errors)
        where = describe(_tier_list(url) or url)
        if not held:
            raise NotFoundError(f"no committed checkpoint step at {where}" + (f" ({'; '.join(errors)})"
                                                                              if errors else ""))
        rows: list[dict] = []
        for step, holding in held.items():
            good, errs = _manifests(holding, step)
            errors += errs
            row: dict[str, Any] = {"step": step, "tiers": [t.name for t in holding]}
            if good is None:
                row["error"] = "manifest damaged in every tier"
            else:
                man = good[1]
                row.update({
                    "bytes": man.total_bytes,
                    "file_bytes": sum(int(f.get("size_bytes", 0) or 0) for f in man.files),
                    "files": len(man.files),
                    "tensors": len(man.tensors),
                    "objects": len(man.objects),
                    "created_unix_s": man.created_unix_s,
                    "created": _iso(man.created_unix_s),
                    "world_size": man.world_size,
                    "layout": man.layout_summary(),
                    "save_id": man.save_id,
                })
            rows.append(row)
    if as_json:
        _emit_json(
            {
                "url": where,
                "tiers": [{"name": t.name, "kind": t.kind, "location": t.location} for t in tiers],
                "steps": rows,
                "status": status.to_dict() if status else None,
                "errors": errors,
            }
        )
    else:
        table = Table(title=f"checkpoint {where}", title_justify="left")
        for col, just in (("step", "right"), ("tiers", "left"), ("bytes", "right"), ("files", "right"),
                          ("created", "left"), ("world", "right"), ("saved layout", "left")):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for r in rows:
            if "error" in r:
                table.add_row(_t(r["step"]), _t(" + ".join(r["tiers"])), *[_t("")] * 4, _t(r["error"], "red"))
            else:
                table.add_row(
                    _t(r["step"]),
                    _t(" + ".join(r["tiers"])),
                    _t(_human(r["bytes"])),
                    _t(r["files"]),
                    _t(_when(r["created_unix_s"])),
                    _t(r["world_size"]),
                    _t(r["layout"]),
                )
        con = console()
        con.print(table)
        con.print(Text("tiers: " + "; ".join(f"{t.name} = {t.location}" for t in tiers)), soft_wrap=True)
        if status is not None:
            con.print(_status_line(status), soft_wrap=True)
    if errors:
        _fail("; ".join(errors))


def _status_line(st: CheckpointStatus) -> Text:
    """One line from the job's status file: newest durable step and its age, backlogs, errors."""
    parts = [f"status ({_when(st.updated_unix_s)}):"]
    if st.newest_durable_step is None:
        parts.append("no durable step yet")
    else:
        age = max(0.0, time.time() - (st.newest_durable_unix_s or st.updated_unix_s))
        parts.append(f"newest durable step {st.newest_durable_step}, {age:.0f} s old, "
                     f"{st.durable_lag_steps} newer step(s) not durable")
    for t in st.tiers:
        if t.backlog:
            parts.append(f"{t.name} backlog {list(t.backlog)}")
        if t.last_error:
            parts.append(f"{t.name} last error: {_truncate(t.last_error, 160)}")
    return Text(" ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else ""),
                style="yellow" if st.durable_lag_steps or any(t.last_error for t in st.tiers) else "")


# -- inspect ---------------------------------------------------------------------------------------

def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


@app.command("inspect")
def inspect_cmd(
    url: UrlArg,
    step: StepOpt = None,
    pieces: Annotated[bool, typer.Option("--pieces", help="Also list every stored piece.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show a step's entries (name, dtype, global shape, pieces, bytes, saved layout) and plain values."""
    notes: list[str] = []
    with _errors():
        _, tiers, where = _source(url)
        held = _held(tiers, notes)
        s = _pick(where, held, step, notes)
        good, errors = _manifests(held[s], s)
        if good is None:
            raise ManifestError("; ".join(errors))
    _note(notes)
    tier, man = good
    tensors = sorted(man.tensors.values(), key=lambda t: t.name)
    if as_json:
        doc = {
            "step": man.step, "tier": tier.name, "dir": tier.where(s), "save_id": man.save_id,
            "created_unix_s": man.created_unix_s, "created": _iso(man.created_unix_s),
            "world_size": man.world_size, "layout": man.layout_summary(), "bytes": man.total_bytes,
            "files": man.files,
            "tensors": [
                {"name": t.name, "path": list(t.path), "dtype": t.dtype, "shape": list(t.shape),
                 "num_pieces": len(t.pieces), "bytes": t.nbytes, "layout": t.layout,
                 **({"pieces": [_piece_doc(p) for p in t.pieces]} if pieces else {})}
                for t in tensors
            ],
            "objects": [{"name": path_name(p), "path": list(p), "value": v} for p, v in man.objects],
            "errors": errors,
        }
        _emit_json(doc)
    else:
        con = console()
        con.print(Text(
            f"step {man.step} — tier {tier.name} ({tier.where(s)}), save {man.save_id}, "
            f"created {_when(man.created_unix_s)}\n{man.layout_summary()}; {len(tensors)} tensors, "
            f"{_human(man.total_bytes)} in {len(man.files)} file(s), {len(man.objects)} plain value(s)"
        ), soft_wrap=True)
        table = Table(title="tensors", title_justify="left")
        for col, just in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("pieces", "right"),
                          ("bytes", "right"), ("saved layout", "left")):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for t in tensors:
            table.add_row(
                _t(t.name),
                _t(t.dtype),
                _t(_shape(t.shape)),
                _t(len(t.pieces)),
                _t(_human(t.nbytes)),
                _t(t.layout),
            )
        con.print(table)
        if man.objects:
            ot = Table(title="plain values", title_justify="left")
            ot.add_column("path", overflow="fold")
            ot.add_column("value (JSON)", overflow="fold")
            for p, v in man.objects:
                ot.add_row(_t(path_name(p)), _t(_truncate(json.dumps(v, sort_keys=True))))
            con.print(ot)
        if pieces:
            pt = Table(title="pieces", title_justify="left")
            for col, just in (("tensor", "left"), ("offsets", "left"), ("lengths", "left"), ("file", "left"),
                              ("byte range", "left"), ("checksum", "left")):
                pt.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
            for t in tensors:
                for p in t.pieces:
                    pt.add_row(_t(t.name), _t(_shape(p.box.offsets)), _t(_shape(p.box.lengths)), _t(p.file),
                               _t(f"{p.start}..{p.start + p.nbytes}"), _t(_crc_text(p)))
            con.print(pt)
    if errors:
        _fail("; ".join(errors))


def _crc_text(p: mf.StoredPiece) -> str:
    if p.blocks is None:
        return f"crc32 0x{p.crc32 or 0:08x}"
    first = f" 0x{p.blocks[0]:08x}" + (" …" if len(p.blocks) > 1 else "") if len(p.blocks) else ""
    return f"{len(p.blocks)} block crc32{first}"


def _piece_doc(p: mf.StoredPiece) -> dict:
    return {"offsets": list(p.box.offsets), "lengths": list(p.box.lengths), "file": p.file, "key": p.key,
            "start": p.start, "end": p.start + p.nbytes, "nbytes": p.nbytes, "crc32": p.crc32,
            "blocks": None if p.blocks is None else len(p.blocks)}


# -- verify ----------------------------------------------------------------------------------------

@app.command("verify")
def verify_cmd(
    url: UrlArg,
    step: StepOpt = None,
    all_steps: Annotated[bool, typer.Option("--all", help="Verify every committed step.")] = False,
    tier: Annotated[
        str | None,
        typer.Option(
            "--tier",
            help="Only the tier of this name ('shm', 'disk', 's3', 'peer', or a name given in a tier list).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-read every piece from every tier holding the step; check CRC-32s, file sizes, safetensors headers."""
    if step is not None and all_steps:
        _fail("--step and --all cannot be used together")
    with _errors():
        _, tiers, where = _source(url)
        if tier is not None and tier not in {t.name for t in tiers}:
            raise NotFoundError(f"no tier named '{tier}' at {where}; its tiers: {[t.name for t in tiers]}")
        unreachable: list[str] = []
        failed: list[tuple[Any, str]] = []
        held = _held(tiers, unreachable, failed)
        steps = list(held) if all_steps and held else [_pick(where, held, step, unreachable)]
        results: list[Checked] = []
        problems: list[Problem] = [
            Problem(t.name, steps[-1], t.location, None, f"tier could not be listed: {e}")
            for t, e in failed
            if tier is None or t.name == tier
        ]
        for s in steps:
            holding = [t for t in held[s] if tier is None or t.name == tier]
            if tier is not None and not holding:
                raise NotFoundError(f"step {s} is not committed in tier '{tier}' at {where}")
            for t in holding:
                try:
                    c, ps = _verify_tier(t, s)
                except OSError as e:  # unreachable meanwhile
                    c, ps = (
                        Checked(t.name, s, ok=False),
                        [Problem(t.name, s, t.where(s), None, f"unreadable: {e}")],
                    )
                results.append(c)
                problems += ps
    if as_json:
        _emit_json({"ok": not problems, "checked": [asdict(c) for c in results],
                    "problems": [asdict(p) for p in problems]})
    else:
        con = console()
        for c in results:
            if c.note:
                con.print(Text.assemble(("SKIP ", "yellow"), f"step {c.step} tier {c.tier}: {c.note}"),
                          soft_wrap=True)
            elif c.ok:
                con.print(
                    Text.assemble(
                        ("OK   ", "green"),
                        f"step {c.step} tier {c.tier}: {c.pieces} piece(s) in "
                        f"{c.files} file(s), {_human(c.bytes)} checked",
                    ),
                    soft_wrap=True,
                )
        for p in problems:
            con.print(Text.assemble(("FAIL ", "bold red"), p.line()), soft_wrap=True)
        if problems:
            con.print(Text(f"{len(problems)} problem(s) found", style="bold red"))
        else:
            con.print(Text(f"OK: {len(results)} step cop{'y' if len(results) == 1 else 'ies'} verified",
                           style="green"))
    if problems:
        raise typer.Exit(1)


# -- export ----------------------------------------------------------------------------------------

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
    """``--entry model/sub`` as a path prefix; ``ValueError`` naming the entries there are if it holds
    no tensor."""
    if entry is None:
        return ()
    prefix = tuple(x for x in entry.strip().strip("/").split("/") if x)
    if not prefix or not any(tuple(t.path[:len(prefix)]) == prefix for t in man.tensors.values()):
        tops = sorted({str(t.path[0]) for t in man.tensors.values() if t.path})
        raise ValueError(f"--entry {entry!r}: no tensor under it; the checkpoint's entries: "
                         f"{', '.join(tops)}")
    return prefix


@app.command("export")
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

    with _errors():
        source, tiers, where = _source(url)
        notes: list[str] = []
        held = _held(tiers, notes)
        s = _pick(where, held, step, notes)
        _note(notes)
        tier, man = read_manifest(source, s)  # the same copy load() reads
        _check_step(tier, man, s)
        # Shapes are bounded by the bytes the manifest lists; those must be present before allocating.
        sizes = [t.file_sizes(s) for t in held.get(s, [])]
        for f in man.files:
            if not any(sz.get(f["name"], -1) >= f["size_bytes"] for sz in sizes):
                raise CorruptionError(
                    f"{tier.where(s, f['name'])}: the manifest lists {f['size_bytes']} bytes; "
                    "no tier holds the file whole"
                )
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
        metadata = {
            "format": "pt",
            "tidal.objects": json.dumps(objects),
            "tidal.step": str(s),
            "tidal.save_id": man.save_id,
            "tidal.layout": man.layout_summary(),
            **({"tidal.entry": "/".join(prefix)} if prefix else {}),
        }
        out = out.expanduser()
        if out.is_dir():
            raise IsADirectoryError(21, "output is a directory", str(out))
        tmp = out.with_name(f".{out.name}.part")
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        size = out.stat().st_size
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if as_json:
        _emit_json(
            {
                "step": s,
                "tier": tier.name,
                "out": str(out),
                "tensors": len(tensors),
                "objects": len(objects),
                "bytes": nbytes,
                "file_bytes": size,
                "bytes_read": stats.bytes_read,
                "bytes_by_tier": stats.bytes_by_tier,
                "fallbacks": stats.fallbacks,
            }
        )
    else:
        con = console()
        con.print(
            Text(
                f"exported step {s} of {where} ({man.layout_summary()}) to {out}: "
                f"{len(tensors)} tensor(s), {_human(nbytes)}; {len(objects)} plain value(s) in metadata "
                f"'tidal.objects'; file {_human(size)}"
            ),
            soft_wrap=True,
        )
        for fb in stats.fallbacks:
            con.print(Text(f"note: fell back to another tier: {fb}", style="yellow"), soft_wrap=True)


# -- agent (its own module: it only hands over to ``python -m tidal.ckpt.agent``) -------------------
app.command("agent")(agent_cmd)


if __name__ == "__main__":
    app()

"""``tidal ckpt``: list, inspect, verify and export checkpoints (``ls``, ``inspect``, ``verify``,
``export``; ``agent`` runs this node's checkpoint agent).

URL is a location or a tier list as JSON (``cli_common``). Rich tables, or one JSON document with
``--json``; any error is one line on stderr and exit code 1, and so is ``verify`` on any problem.
Nothing here unpickles."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from tidal.ckpt import cli_common as cc
from tidal.ckpt.agent.cli import SETTINGS as AGENT_SETTINGS
from tidal.ckpt.agent.cli import agent_cmd
from tidal.ckpt.api import held_steps, pick
from tidal.ckpt.cli_common import JsonOpt, StepOpt, UrlArg
from tidal.ckpt.cli_export import export_cmd
from tidal.ckpt.engine.status import CheckpointStatus
from tidal.ckpt.errors import ManifestError, NotFoundError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.config import describe
from tidal.ckpt.verify import Checked, Problem, _verify_tier
from tidal.console import console

app = typer.Typer(help="Inspect, verify and export checkpoints.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)


# -- ls --------------------------------------------------------------------------------------------

TierOpt = Annotated[list[str] | None, typer.Option(
    "--tier", help="Also list this tier (a directory or s3://bucket/prefix); repeatable. Default: the job's "
                   "other tiers as recorded in this node's status file, if any.", show_default=False)]


@app.command("ls")
def ls_cmd(url: UrlArg, tier: TierOpt = None, as_json: JsonOpt = False) -> None:
    """List committed steps: tiers holding each, size, files, creation time, saved layout; and the
    job's durability status (newest durable step, its age, backlogs) when this node has it."""
    errors: list[str] = []
    with cc.errors():
        tiers, status = cc.ls_tiers(url, tier or [])
        held = held_steps(tiers, errors, must_list=False)
        where = describe(cc.tier_list(url) or url)
        pick(where, held, None, errors)  # NotFoundError when no step is committed
        rows: list[dict] = []
        for step, holding in held.items():
            good, errs = cc.manifests(holding, step)
            errors += errs
            row: dict[str, Any] = {"step": step, "tiers": [t.name for t in holding]}
            if good is None:
                row["error"] = "manifest damaged in every tier"
            else:
                man = good[1]
                file_bytes = sum(int(f.get("size_bytes") or 0) for f in man.files)
                row.update({
                    "bytes": man.total_bytes, "file_bytes": file_bytes, "files": len(man.files),
                    "tensors": len(man.tensors), "objects": len(man.objects),
                    "created_unix_s": man.created_unix_s, "created": cc.iso(man.created_unix_s),
                    "world_size": man.world_size, "layout": man.layout_summary(), "save_id": man.save_id,
                })
            rows.append(row)
    if as_json:
        listed = [{"name": t.name, "kind": t.kind, "location": t.location} for t in tiers]
        cc.emit_json({"url": where, "tiers": listed, "steps": rows,
                      "status": status.to_dict() if status else None, "errors": errors})
    else:
        table = _table(f"checkpoint {where}", ">step", "tiers", ">bytes", ">files", "created", ">world",
                       "saved layout")
        for r in rows:
            head = [cc.cell(r["step"]), cc.cell(" + ".join(r["tiers"]))]
            if "error" in r:
                table.add_row(*head, *[cc.cell("")] * 4, cc.cell(r["error"], "red"))
            else:
                rest = (cc.human(r["bytes"]), r["files"], cc.when(r["created_unix_s"]), r["world_size"],
                        r["layout"])
                table.add_row(*head, *map(cc.cell, rest))
        con = console()
        con.print(table)
        con.print(Text("tiers: " + "; ".join(f"{t.name} = {t.location}" for t in tiers)), soft_wrap=True)
        if status is not None:
            con.print(_status_line(status), soft_wrap=True)
    if errors:
        cc.fail("; ".join(errors))


def _status_line(st: CheckpointStatus) -> Text:
    """One line from the job's status file: newest durable step and its age, backlogs, errors."""
    parts = [f"status ({cc.when(st.updated_unix_s)}):"]
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
            parts.append(f"{t.name} last error: {mf.clip(t.last_error, 160)}")
    return Text(" ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else ""),
                style="yellow" if st.durable_lag_steps or any(t.last_error for t in st.tiers) else "")


# -- inspect ---------------------------------------------------------------------------------------

def _table(title: str, *cols: str) -> Table:
    """A table of columns named ``cols`` (right-justified: named with a leading ``>``)."""
    table = Table(title=title, title_justify="left")
    for col in cols:
        table.add_column(col.lstrip(">"), justify="right" if col[0] == ">" else "left", overflow="fold")
    return table


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
    with cc.errors():
        _, tiers, where = cc.source(url)
        held = held_steps(tiers, notes, must_list=False)
        s = pick(where, held, step, notes)
        good, errors = cc.manifests(held[s], s)
        if good is None:
            raise ManifestError("; ".join(errors))
    cc.note(notes)
    tier, man = good
    tensors = sorted(man.tensors.values(), key=lambda t: t.name)
    if as_json:
        doc = {
            "step": man.step, "tier": tier.name, "dir": tier.where(s), "save_id": man.save_id,
            "created_unix_s": man.created_unix_s, "created": cc.iso(man.created_unix_s),
            "world_size": man.world_size, "layout": man.layout_summary(), "bytes": man.total_bytes,
            "files": man.files,
            "tensors": [
                {"name": t.name, "path": list(t.path), "dtype": t.dtype, "shape": list(t.shape),
                 "num_pieces": len(t.pieces), "bytes": t.nbytes, "layout": t.layout,
                 **({"pieces": [_piece_doc(p) for p in t.pieces]} if pieces else {})}
                for t in tensors
            ],
            "objects": [{"name": mf.path_name(p), "path": list(p), "value": v} for p, v in man.objects],
            "errors": errors,
        }
        cc.emit_json(doc)
    else:
        con = console()
        con.print(Text(
            f"step {man.step} — tier {tier.name} ({tier.where(s)}), save {man.save_id}, "
            f"created {cc.when(man.created_unix_s)}\n{man.layout_summary()}; {len(tensors)} tensors, "
            f"{cc.human(man.total_bytes)} in {len(man.files)} file(s), {len(man.objects)} plain value(s)"
        ), soft_wrap=True)
        table = _table("tensors", "name", "dtype", "shape", ">pieces", ">bytes", "saved layout")
        for t in tensors:
            table.add_row(*map(cc.cell, (t.name, t.dtype, _shape(t.shape), len(t.pieces), cc.human(t.nbytes),
                                         t.layout)))
        con.print(table)
        if man.objects:
            ot = _table("plain values", "path", "value (JSON)")
            for p, v in man.objects:
                ot.add_row(cc.cell(mf.path_name(p)), cc.cell(mf.clip(json.dumps(v, sort_keys=True), 80)))
            con.print(ot)
        if pieces:
            pt = _table("pieces", "tensor", "offsets", "lengths", "file", "byte range", "checksum")
            for t in tensors:
                for piece in t.pieces:
                    box, end = piece.box, piece.start + piece.nbytes
                    pt.add_row(*map(cc.cell, (t.name, _shape(box.offsets), _shape(box.lengths), piece.file,
                                              f"{piece.start}..{end}", _crc_text(piece))))
            con.print(pt)
    if errors:
        cc.fail("; ".join(errors))


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
    tier: Annotated[str | None, typer.Option(
        "--tier",
        help="Only the tier of this name ('shm', 'disk', 's3', 'peer', or a name given in a tier list).",
    )] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-read every piece from every tier holding the step; check CRC-32s, file sizes and safetensors
    headers."""
    if step is not None and all_steps:
        cc.fail("--step and --all cannot be used together")
    with cc.errors():
        _, tiers, where = cc.source(url)
        if tier is not None and tier not in {t.name for t in tiers}:
            raise NotFoundError(f"no tier named '{tier}' at {where}; its tiers: {[t.name for t in tiers]}")
        unreachable: list[str] = []
        failed: list[tuple[Any, str]] = []
        held = held_steps(tiers, unreachable, failed, must_list=False)
        steps = list(held) if all_steps and held else [pick(where, held, step, unreachable)]
        results: list[Checked] = []
        problems: list[Problem] = [
            Problem(t.name, steps[-1], t.location, None, f"tier could not be listed: {e}")
            for t, e in failed if tier is None or t.name == tier]
        for s in steps:
            holding = [t for t in held[s] if tier is None or t.name == tier]
            if tier is not None and not holding:
                raise NotFoundError(f"step {s} is not committed in tier '{tier}' at {where}")
            for t in holding:
                try:
                    c, ps = _verify_tier(t, s)
                except OSError as e:  # unreachable meanwhile
                    c = Checked(t.name, s, ok=False)
                    ps = [Problem(t.name, s, t.where(s), None, f"unreadable: {e}")]
                results.append(c)
                problems += ps
    if as_json:
        cc.emit_json({"ok": not problems, "checked": [asdict(c) for c in results],
                    "problems": [asdict(p) for p in problems]})
    else:
        con = console()
        for c in results:
            if c.note:
                con.print(Text.assemble(("SKIP ", "yellow"), f"step {c.step} tier {c.tier}: {c.note}"),
                          soft_wrap=True)
            elif c.ok:
                con.print(Text.assemble(("OK   ", "green"), f"step {c.step} tier {c.tier}: {c.pieces} "
                                        f"piece(s) in {c.files} file(s), {cc.human(c.bytes)} checked"),
                          soft_wrap=True)
        for p in problems:
            con.print(Text.assemble(("FAIL ", "bold red"), p.line()), soft_wrap=True)
        if problems:
            con.print(Text(f"{len(problems)} problem(s) found", style="bold red"))
        else:
            con.print(Text(f"OK: {len(results)} step cop{'y' if len(results) == 1 else 'ies'} verified",
                           style="green"))
    if problems:
        raise typer.Exit(1)


# -- export (cli_export.py) and agent (it only hands over to ``python -m tidal.ckpt.agent``) ------------
app.command("export")(export_cmd)
app.command("agent", context_settings=AGENT_SETTINGS, add_help_option=False)(agent_cmd)


if __name__ == "__main__":
    app()

"""What the ``tidal ckpt`` commands share: one-line errors, JSON and human output, and finding the
tiers and committed steps behind a URL argument (see :mod:`tidal.ckpt.cli`)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import sys
from collections.abc import Iterator
from typing import Annotated, Any, NoReturn

import typer
from rich.text import Text

from tidal.ckpt.engine.status import CheckpointStatus, read_status
from tidal.ckpt.errors import CheckpointError, ManifestError, NotFoundError, TierSpecError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.config import build, describe, kind_of, normalize, read_tiers, resolve
from tidal.ckpt.tiers.directory import is_peer_url, is_s3_url, local_path, shm_root_for, tiers_for
from tidal.ckpt.tiers.protocol import Tier
from tidal.ckpt.verify import _read
from tidal.console import console

_URL_HELP = (
    "Checkpoint location: a directory (path or file:// URL), s3://bucket/prefix or peer://NAME; or a tier "
    'list as JSON, e.g. \'["shm", "/ckpt/run1", "s3://bucket/run1"]\'.'
)
UrlArg = Annotated[str, typer.Argument(help=_URL_HELP, show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]
StepOpt = Annotated[int | None, typer.Option("--step", min=0,
                                             help="Step to use (default: the newest committed step).")]


# -- output helpers --------------------------------------------------------------------------------

def fail(msg: str) -> NoReturn:
    console(stderr=True).print(Text.assemble(("error: ", "bold red"), " ".join(msg.split())), soft_wrap=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """Turn the engine's and the OS's errors into one readable line on stderr and exit code 1."""
    try:
        yield
    except (CheckpointError, OSError, ValueError) as e:
        fail(str(e) or type(e).__name__)


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def when(ts: float) -> str:
    if not ts:
        return "?"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def iso(ts: float) -> str | None:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).isoformat() if ts else None


def cell(v: Any, style: str = "") -> Text:
    """A table cell that is shown verbatim (tensor names may contain Rich markup characters)."""
    return Text(str(v), style=style)


# -- locating steps --------------------------------------------------------------------------------

def tier_list(url: str) -> list | None:
    """The tier list ``url`` spells as JSON, or None when it is a location."""
    if not url.lstrip().startswith("["):
        return None
    try:
        specs = json.loads(url)
    except ValueError as e:
        raise TierSpecError(f"tier list {url!r} is not valid JSON ({e}); expected e.g. "
                            '\'["shm", "/ckpt/run1", "s3://bucket/run1"]\'') from None
    return specs


def source(url: str) -> tuple[str | list, list, str]:
    """(what ``load`` takes, the tiers to read, fastest first, a name for messages: for a location, its
    home) for a URL argument."""
    specs = tier_list(url)
    if specs is not None:
        return specs, read_tiers(specs), describe(specs)
    if is_s3_url(url) or is_peer_url(url):
        return url, tiers_for(url), url.rstrip("/")
    tiers, root = tiers_for(url), local_path(url)
    if root.exists() and not root.is_dir():
        raise NotFoundError(f"{root} is not a directory")
    if not root.exists() and all(t.name == "disk" for t in tiers):
        raise NotFoundError(f"checkpoint directory {root} does not exist")
    return url, tiers, str(root)


def ls_tiers(url: str, extra: list[str]) -> tuple[list, CheckpointStatus | None]:
    """The location's tiers, plus ``extra`` tier specs - by default the job's other durable tiers
    as recorded in this node's status file for it (so an S3 tier shows up without naming it)."""
    given, tiers, home = source(url)
    if isinstance(given, list):
        home = resolve(given, default_keep=0)[0]
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


def note(lines: list[str]) -> None:
    con = console(stderr=True)
    for ln in lines:
        con.print(Text(f"note: {ln}", style="yellow"), soft_wrap=True)


def manifests(tiers: list[Tier], step: int) -> tuple[tuple[Tier, mf.Manifest] | None, list[str]]:
    """The first tier's manifest of ``step`` that parses, and an error line per damaged copy."""
    good: tuple[Tier, mf.Manifest] | None = None
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

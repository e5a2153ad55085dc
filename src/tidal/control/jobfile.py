"""A job file as the command line submits it: YAML with its paths made absolute, then the overrides."""

from __future__ import annotations

from pathlib import Path


def load_spec_file(path: Path) -> dict:
    """Parse a job YAML; paths in it (workdir, a local checkpoint url) are relative to the file."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping (name, gpus, command, ...), got {type(doc).__name__}")
    base = path.resolve().parent
    wd = doc.get("workdir")
    if wd is None:
        doc["workdir"] = str(base)
    elif isinstance(wd, str) and not wd.startswith("/"):
        doc["workdir"] = str((base / wd).resolve())
    ck = doc.get("checkpoint")
    url = ck.get("url") if isinstance(ck, dict) else None
    if isinstance(ck, dict) and isinstance(url, str) and "://" not in url and not url.startswith(("/", "~")):
        ck["url"] = str((base / url).resolve())
    if isinstance(ck, dict) and isinstance(ck.get("tiers"), list):
        for i, t in enumerate(ck["tiers"]):  # "./dir" and "../dir" (a bare word is refused as a likely typo)
            if isinstance(t, str) and t.startswith(("./", "../")):
                ck["tiers"][i] = str((base / t).resolve())
            elif isinstance(t, dict) and isinstance(t.get("url"), str) and t["url"].startswith(("./", "../")):
                t["url"] = str((base / t["url"]).resolve())
    return doc


def apply_overrides(doc: dict, *, name: str | None = None, gpus: str | None = None,
                    env: list[str] | None = None, kind: str | None = None,
                    priority: int | None = None) -> dict:
    """The spec with the command line's overrides (``--gpus 4`` or ``2-8``, ``--env K=V``, ...); the
    server checks the result like any spec. ``ValueError`` names a malformed option."""
    out = dict(doc)
    out.update({k: v for k, v in (("name", name), ("kind", kind), ("priority", priority)) if v is not None})
    if gpus is not None:
        lo, sep, hi = gpus.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--gpus: expected N or MIN-MAX (e.g. 4 or 2-8), got {gpus!r}")
        g = out.get("gpus")
        keep = {"multiple_of": g["multiple_of"]} if isinstance(g, dict) and "multiple_of" in g else {}
        out["gpus"] = ({"min": int(lo), "max": int(hi), **keep} if sep
                       else ({"min": int(lo), **keep} if keep else int(lo)))
    if env:
        merged = dict(out.get("env") or {}) if isinstance(out.get("env"), dict) else {}
        for item in env:
            k, eq, v = item.partition("=")
            if not eq or not k:
                raise ValueError(f"--env: expected K=V, got {item!r}")
            merged[k] = v
        out["env"] = merged
    return out

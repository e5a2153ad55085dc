"""The main benchmark's side of the peer protocol: run each adapter in its venv, check and merge its JSON.

Every peer ends up in ``result["peers"][name]`` with a ``status``:

* ``ok`` — the adapter ran; its ``engines`` say, each, ``ok`` (with ``save``/``load`` medians) or
  ``unavailable`` with the one-line ``reason`` (needs CUDA, refuses this torch, ...);
* ``not installed`` — no venv (``reason`` names the setup script);
* ``failed`` — the adapter exited non-zero, timed out, or wrote a document that does not hold (``reason``:
  one line, the last line of its stderr where there is one).

Ratios against Tidal's medians of the same run go to ``result["peer_ratios"]``; :func:`render_peers` prints
them (with rich). Standard library only otherwise.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.peers import PEERS, PROTOCOL, SETUP_SCRIPT, pythonpath, venvs_root

# peer save metric -> Tidal's (competitor, metric) it is divided by
SAVE_RATIOS: dict[str, list[tuple[str, str, str]]] = {
    "stall_s": [
        ("tidal_stall", "tidal", "stall_s"),
        ("tidal_overlapped_stall", "tidal_overlapped", "stall_s"),
    ],
    "durable_s": [("tidal_commit", "tidal", "commit_s")],
}
# peer load metric -> Tidal's load metric of the same source
LOAD_RATIOS: dict[str, str] = {"load_s": "load_s", "load_disk_s": "load_disk_s",
                               "load_resharded_s": "load_resharded_s"}
STDERR_TAIL = 4000


@dataclass(frozen=True)
class Peer:
    """A peer adapter to run: ``command`` + the protocol's arguments, in the environment ``env``."""

    name: str
    command: tuple[str, ...]


def find_peers(root: Path | None = None) -> tuple[list[Peer], dict[str, str]]:
    """The installed peers (a venv with a python under ``root``), and ``{name: why not}`` for the others."""
    root = venvs_root() if root is None else root
    found, missing = [], {}
    for name, module in PEERS.items():
        python = root / name / "bin" / "python"
        if python.is_file() and os.access(python, os.X_OK):
            found.append(Peer(name, (str(python), "-m", module)))
        else:
            missing[name] = f"not installed: no venv at {root / name} (make it with {SETUP_SCRIPT} {name})"
    return found, missing


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else "(no output)"


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def check_document(doc: object, size_bytes: int, tensors: int) -> str | None:
    """None when ``doc`` is a protocol document for this state, else what is wrong (one line)."""
    if not isinstance(doc, dict):
        return "the document is not a JSON object"
    if doc.get("protocol") != PROTOCOL:
        return f"protocol {doc.get('protocol')!r}, expected {PROTOCOL}"
    if doc.get("size_bytes") != size_bytes or doc.get("tensors") != tensors:
        return (f"built another state: {doc.get('size_bytes')} bytes in {doc.get('tensors')} tensors, "
                f"expected {size_bytes} in {tensors}")
    memcpy = doc.get("memcpy")
    if not isinstance(memcpy, dict) or not _positive((memcpy.get("copy_s") or {}).get("median")):
        return "no memcpy median"
    engines = doc.get("engines")
    if not isinstance(engines, dict) or not engines:
        return "no engines"
    for name, e in engines.items():
        if not isinstance(e, dict) or e.get("status") not in ("ok", "unavailable"):
            return f"engine {name!r}: no status"
        if e["status"] == "unavailable":
            if not isinstance(e.get("reason"), str) or not e["reason"]:
                return f"engine {name!r}: unavailable without a reason"
            continue
        for group in ("save", "load"):
            metrics = e.get(group)
            if not isinstance(metrics, dict):
                return f"engine {name!r}: no {group} metrics"
            for m, s in metrics.items():
                samples = s.get("samples") if isinstance(s, dict) else None
                if not (isinstance(samples, list) and samples and all(map(_positive, samples))
                        and _positive(s.get("median"))):
                    return f"engine {name!r}: {group} {m!r} is not a list of times with a median"
        if not {"stall_s", "durable_s"} <= set(e["save"]):
            return f"engine {name!r}: save lacks stall_s or durable_s"
    return None


def run_peer(peer: Peer, *, size_bytes: int, expect: tuple[int, int], seed: int, repeat: int, scratch: Path,
             timeout_s: float, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run one adapter to its end (or ``timeout_s``) and return the peer's entry of ``result["peers"]``.

    ``size_bytes`` is the size asked of ``build_state``; ``expect`` = (bytes, tensors) of the state it built
    in the main process, which the adapter's state must match.
    """
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / f"{peer.name}.json"
    err_path = scratch / f"{peer.name}.stderr"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "PYTHONNOUSERSITE": "1"}
    env.pop("VIRTUAL_ENV", None)
    cmd = [*peer.command, "--size-bytes", str(size_bytes), "--seed", str(seed), "--repeat", str(repeat),
           "--dir", str(scratch / f"{peer.name}-work"), "--out", str(out)]
    t0 = time.perf_counter()
    with open(err_path, "w+b") as err:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                                    start_new_session=True)
        except OSError as e:
            return {"status": "failed", "reason": f"cannot start {cmd[0]}: {e}"}
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        # The adapter's own session: also whatever it left behind (an engine's saver process).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if rc is None:
            rc = proc.wait()
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - STDERR_TAIL))
        tail = err.read().decode(errors="replace")
    wall = time.perf_counter() - t0
    if timed_out:
        return {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s", "stderr_tail": tail}
    if rc != 0:
        return {"status": "failed", "reason": f"adapter exited {rc}: {_last_line(tail)}", "stderr_tail": tail}
    try:
        doc = json.loads(out.read_text())
    except (OSError, ValueError) as e:
        return {"status": "failed", "reason": f"no readable JSON document: {e}", "stderr_tail": tail}
    bad = check_document(doc, *expect)
    if bad:
        return {"status": "failed", "reason": f"bad document: {bad}", "stderr_tail": tail}
    log(f"{peer.name}: done in {wall:.1f} s")
    return {"status": "ok", "wall_s": wall, "versions": doc.get("versions", {}), "memcpy": doc["memcpy"],
            "engines": doc["engines"], "notes": doc.get("notes", [])}


def ratios(peers: dict[str, dict], save: dict, load: dict) -> dict[str, float | None]:
    """``<engine>_<metric>_over_<tidal metric>`` for every engine that ran, from medians of the same run."""
    out: dict[str, float | None] = {}

    def div(a: float, b: float | None) -> float | None:
        return a / b if b else None

    for entry in peers.values():
        if entry.get("status") != "ok":
            continue
        floor = entry["memcpy"]["copy_s"]["median"]
        for name, e in entry["engines"].items():
            if e["status"] != "ok":
                continue
            for metric, s in e["save"].items():
                for label, comp, tmetric in SAVE_RATIOS.get(metric, []):
                    t = save.get(comp, {}).get(tmetric)
                    out[f"{name}_{metric[:-2]}_over_{label}"] = div(s["median"], t and t["median"])
            out[f"{name}_stall_over_its_memcpy"] = div(e["save"]["stall_s"]["median"], floor)
            for metric, s in e["load"].items():
                if metric in LOAD_RATIOS:
                    t = load.get("tidal", {}).get(LOAD_RATIOS[metric])
                    out[f"{name}_{metric[:-2]}_over_tidal_{LOAD_RATIOS[metric][:-2]}"] = div(
                        s["median"], t and t["median"])
    return out


def run_peers(result: dict, *, peers: list[Peer], missing: dict[str, str], seed: int = 0,
              directory: str | os.PathLike | None = None, timeout_s: float | None = None,
              log: Callable[[str], None] = lambda s: None) -> dict:
    """Run ``peers`` one after another on the state of ``result`` and add ``peers``/``peer_ratios`` to it."""
    size_gb = result["size_gb_requested"]
    if timeout_s is None:  # generous: the slowest peer here writes ~0.1 GB/s, twice per round
        timeout_s = 300 + 60 * size_gb * (result["repeat"] + 2) * 2
    entries: dict[str, dict] = {
        name: {"status": "not installed", "reason": why} for name, why in missing.items()
    }
    with tempfile.TemporaryDirectory(prefix="tidal-bench-peers-", dir=directory) as tmp:
        for peer in peers:
            log(f"peer {peer.name}: running its adapter ({' '.join(peer.command[-2:])})")
            entries[peer.name] = run_peer(
                peer,
                size_bytes=int(size_gb * 10**9),
                expect=(result["size_bytes"], result["tensors"]),
                seed=seed,
                repeat=result["repeat"],
                scratch=Path(tmp),
                timeout_s=timeout_s,
                log=log,
            )
            if entries[peer.name]["status"] != "ok":
                log(f"peer {peer.name}: {entries[peer.name]['reason']}")
    result["peers"] = entries
    result["peer_ratios"] = ratios(entries, result["save"], result["load"])
    return result


def peer_lines(result: dict) -> list[str]:
    """One line per peer, and per engine of it, that did not run here, saying why."""
    lines = []
    for name, entry in result.get("peers", {}).items():
        if entry["status"] != "ok":
            lines.append(f"{name}: {entry['status']}: {entry['reason']}")
            continue
        for ename, e in entry["engines"].items():
            if e["status"] != "ok":
                lines.append(f"{name} / {ename}: cannot run here: {e['reason']}")
    return lines


def render_peers(result: dict, console: Any) -> None:
    """The peers' medians (run in their own venvs, same state, same run) with their ratio to Tidal's."""
    from rich.table import Table

    GB = 10**9
    size = result["size_bytes"]
    table = Table(title="peers (each in its own venv, same state and protocol, after Tidal in this run)")
    for col in ("engine", "metric"):
        table.add_column(col)
    for col in ("median s", "min s", "max s", "GB/s", "÷ Tidal"):
        table.add_column(col, justify="right")
    ratios = result.get("peer_ratios", {})
    for peer, entry in result["peers"].items():
        if entry["status"] != "ok":
            continue
        floor = entry["memcpy"]["copy_s"]
        table.add_row(f"{peer}: memcpy", "copy_s", f"{floor['median']:.4f}", f"{min(floor['samples']):.4f}",
                      f"{max(floor['samples']):.4f}", f"{size / floor['median'] / GB:.2f}", "")
        for name, e in entry["engines"].items():
            if e["status"] != "ok":
                continue
            for group in ("save", "load"):
                for metric, s in e[group].items():
                    med = s["median"]
                    key = next((k for k in ratios if k.startswith(f"{name}_{metric[:-2]}_over_tidal")), None)
                    r = ratios.get(key) if key else None
                    table.add_row(name if group == "save" else f"{name} (load)", metric, f"{med:.4f}",
                                  f"{min(s['samples']):.4f}", f"{max(s['samples']):.4f}",
                                  f"{size / med / GB:.2f}" if med > 0 else "-",
                                  f"{r:.2f}× ({key.split('_over_')[1]})" if r is not None else "")
        table.add_section()
    console.print(table)
    for entry in result["peers"].values():
        for name, e in entry.get("engines", {}).items():
            for note in e.get("notes", []) if e["status"] == "ok" else []:
                console.print(f"• {name}: {note}", highlight=False)
    for line in peer_lines(result):
        console.print(f"[yellow]• {line}[/]", highlight=False)


if __name__ == "__main__":  # pragma: no cover - a look at what is installed
    found, missing = find_peers()
    print("\n".join([f"{p.name}: {' '.join(p.command)}" for p in found] + list(missing.values())),
          file=sys.stdout)

"""The import rules of docs/architecture.md, read from the source with ``ast`` (nothing is imported):

* no import cycle among the modules of one room, a top-level folder with its subfolders (a package's
  ``__init__``, its face, is in it: a module importing its package's face, which imports it back, is a
  cycle);
* no upward arrow: a module imports its own folder or the rooms below it, never one above;
* ``tidal.policy`` is pure (no I/O, no clock): it imports nothing that does either;
* the product never imports the lab.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tidal"

# The rooms, bottom up (docs/architecture.md, "Which may import which"): a room may import its own
# modules and those of the rooms at its floor or below. Top-level modules of the package (tidal.model,
# tidal.contract, ...) are the ground floor.
FLOORS: dict[str, int] = {
    "": 0,  # tidal/*.py: plain data and contracts
    "ckpt": 1,
    "policy": 2, "train": 2,
    "exec": 3, "serving": 3, "bench": 3,
    "control": 4, "sim": 4,
    "demo": 5, "cli": 5,
}
PURE_BANNED = ("time", "os", "socket", "subprocess", "threading", "random", "pathlib", "shutil", "io",
               "tidal.exec", "tidal.control", "tidal.serving", "tidal.sim", "tidal.train", "tidal.ckpt")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours ``name`` imports, also for type checking only (``from pkg import mod``: the
    module and the package's face)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in ("tidal", "lab")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in ("tidal", "lab"):
                continue
            # ``from pkg import mod`` runs pkg's face too: both count
            out |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known} | {target}
    return {m for m in out if m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {n: imports_of(n, p, known) for n, p in mods.items()}


def room(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 2 and f"tidal.{parts[1]}" in modules() and parts[1] not in FLOORS:
        return ""  # a top-level module
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_inside_a_room(graph):
    """A room is a top-level folder (``tidal.ckpt`` with its subfolders) or the package's top-level
    modules; a package's ``__init__`` (its face) is in it."""
    by_room: dict[str, list[str]] = {}
    for n in modules():
        if n != "tidal":
            by_room.setdefault(room(n), []).append(n)
    cycles = []
    for members in by_room.values():
        inside = set(members)
        for scc in _sccs({m: graph[m] & inside for m in members}):
            if len(scc) > 1:
                cycles.append(sorted(scc))
    assert not cycles, f"import cycles inside a room: {cycles}"


def test_no_upward_arrow(graph):
    """Also: the two planes (control, sim) never import each other; policy, train and ckpt never import
    the plane."""
    up = []
    for n, deps in graph.items():
        if n == "tidal":
            continue
        here = FLOORS[room(n)]
        for d in deps:
            if d.startswith("lab") or d == "tidal":
                continue
            if FLOORS[room(d)] > here or {room(n), room(d)} == {"control", "sim"}:
                up.append(f"{n} -> {d}")
    assert not up, "imports pointing up the rooms (docs/architecture.md, the map):\n" + "\n".join(sorted(up))


def test_policy_is_pure(graph):
    bad = []
    for n, p in modules().items():
        if not n.startswith("tidal.policy"):
            continue
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{n} imports {x}" for x in names
                    if any(x == b or x.startswith(b + ".") for b in PURE_BANNED)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                bad.append(f"{n} calls open()")
    assert not bad, bad


def test_the_product_never_imports_the_lab(graph):
    assert not [f"{n} -> {d}" for n, ds in graph.items() for d in ds if d.split(".")[0] == "lab"]


def _sccs(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return out

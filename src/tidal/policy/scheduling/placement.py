"""Free GPUs per node and packing gangs onto them: a :class:`View` keeps a pool's nodes in buckets by
free count; :func:`place` packs a ``gpus_per_node`` gang on the tightest nodes that hold its share and
any other job on the fewest nodes. Deterministic; a blocked node (a loan ending soon) is never offered."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class View:
    """Free and draining GPUs of one pool's nodes during one scheduling call (mutable, call-local)."""

    __slots__ = ("name", "free", "draining", "blocked", "buckets", "total", "max_free")

    def __init__(self, name: str, max_free: int) -> None:
        self.name = name
        self.free: dict[str, int] = {}  # node -> GPUs nobody holds
        self.draining: dict[str, int] = {}  # node -> GPUs being released, not yet claimed this call
        self.blocked: set[str] = set()  # nodes not offered for placement
        self.buckets: list[dict[str, None]] = [{} for _ in range(max_free + 1)]  # [f]: nodes with f free
        self.total = 0  # free GPUs on placeable nodes
        self.max_free = max_free

    def add(self, node: str, free: int, draining: int = 0, placeable: bool = True) -> None:
        self.free[node] = free
        if draining:
            self.draining[node] = draining
        if not placeable:
            self.blocked.add(node)
        elif free > 0:
            self.buckets[free][node] = None
            self.total += free

    def take(self, node: str, gpus: int) -> None:
        """``gpus`` free GPUs of ``node`` are now used (or reserved)."""
        f = self.free[node]
        if gpus > f:
            raise AssertionError(f"take {gpus} GPUs on {node}, {f} free")
        self.free[node] = f - gpus
        if node not in self.blocked:
            del self.buckets[f][node]
            if f > gpus:
                self.buckets[f - gpus][node] = None
            self.total -= gpus

    def claim_draining(self, node: str, gpus: int) -> None:
        left = self.draining.get(node, 0) - gpus
        if left > 0:
            self.draining[node] = left
        else:
            self.draining.pop(node, None)

    def add_draining(self, node: str, gpus: int) -> None:
        self.draining[node] = self.draining.get(node, 0) + gpus


def _max_free(views: Sequence[View]) -> int:
    return max(v.max_free for v in views)


def _first(views: Sequence[View], frees: Iterable[int], skip: Mapping[str, int]) -> tuple[View, str] | None:
    """The first node not in ``skip`` with ``f`` free GPUs, for each ``f`` of ``frees`` in turn (earlier
    views win ties)."""
    for f in frees:
        for v in views:
            if f < len(v.buckets):
                for node in v.buckets[f]:
                    if node not in skip:
                        return v, node
    return None


def _tightest(views: Sequence[View], at_least: int, skip: Mapping[str, int]) -> tuple[View, str] | None:
    """The node with the fewest free GPUs that has at least ``at_least`` (earlier views win ties)."""
    return _first(views, range(max(at_least, 1), _max_free(views) + 1), skip)


def _fullest(views: Sequence[View], skip: Mapping[str, int]) -> tuple[View, str] | None:
    """The node with the most free GPUs (earlier views win ties)."""
    return _first(views, range(_max_free(views), 0, -1), skip)


def fits(views: Sequence[View], size: int, g: int | None) -> bool:
    """Whether :func:`place` would succeed (O(GPUs per node))."""
    n = 0  # (loops, not generator expressions: this runs for every job a call looks at)
    if g is None:
        for v in views:
            n += v.total
        return n >= size
    for v in views:
        n += sum(map(len, v.buckets[g:]))  # nodes with at least g free
    return n >= size // g


def place(views: Sequence[View], size: int, g: int | None, skip: Mapping[str, int] | None = None
          ) -> dict[str, int] | None:
    """Take ``size`` GPUs from ``views`` (earlier views preferred) by the packing rules; ``None`` (and
    nothing taken) if they do not fit. Nodes in ``skip`` are not used (with ``g``: nodes a growing job
    already occupies)."""
    skip = skip or {}
    out: dict[str, int] = {}
    if g is None:
        if sum(v.total for v in views) < size:
            return None
        rem = size
        while rem > 0:
            hit = _tightest(views, rem, skip)
            if hit is not None:
                v, node = hit
                v.take(node, rem)
                out[node] = out.get(node, 0) + rem
                return out
            full = _fullest(views, skip)
            assert full is not None, "total >= rem guarantees a node"
            v, node = full
            f = v.free[node]
            v.take(node, f)
            out[node] = out.get(node, 0) + f
            rem -= f
        return out
    k = size // g
    picked: list[tuple[View, str]] = []
    chosen: dict[str, int] = dict(skip)
    for _ in range(k):
        hit = _tightest(views, g, chosen)
        if hit is None:
            return None
        picked.append(hit)
        chosen[hit[1]] = g
    for v, node in picked:
        v.take(node, g)
        out[node] = g
    return out


def place_more(views: Sequence[View], add: int, g: int | None, current: Mapping[str, int]
               ) -> dict[str, int] | None:
    """Take ``add`` more GPUs for a job on ``current``: its own nodes first (locality), then packing."""
    if g is not None:
        return place(views, add, g, skip=current)
    if sum(v.total for v in views) < add:
        return None
    out: dict[str, int] = {}
    rem = add
    own = []
    for node in current:
        for v in views:
            f = v.free.get(node, 0)
            if f > 0 and node not in v.blocked:
                own.append((-f, node, v))
    for _, node, v in sorted(own, key=lambda t: (t[0], t[1])):
        t = min(rem, v.free[node])
        v.take(node, t)
        out[node] = t
        rem -= t
        if rem == 0:
            return out
    more = place(views, rem, None)
    assert more is not None  # total >= add
    for node, t in more.items():
        out[node] = out.get(node, 0) + t
    return out


def pack(free: Mapping[str, int], size: int, g: int | None) -> dict[str, int] | None:
    """:func:`place`'s rules on a plain node -> free map (O(n log n); the preemption path)."""
    items = sorted(((f, node) for node, f in free.items() if f > 0), key=lambda t: t[0])
    if g is not None:
        ok = [node for f, node in items if f >= g]
        return {node: g for node in ok[: size // g]} if len(ok) >= size // g else None
    if sum(f for f, _ in items) < size:
        return None
    out: dict[str, int] = {}
    rem = size
    i = len(items) - 1
    used: set[str] = set()
    while rem > 0:
        best = next(((f, node) for f, node in items if f >= rem and node not in used), None)
        if best is not None:
            out[best[1]] = rem
            return out
        while items[i][1] in used:
            i -= 1
        f, node = items[i]
        used.add(node)
        out[node] = f
        rem -= f
    return out

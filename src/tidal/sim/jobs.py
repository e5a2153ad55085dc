"""Training jobs for the simulator: the native CSV (:func:`load_native`), the ElasticFlow trace derived
from Microsoft Philly (:func:`load_philly`), told apart by :func:`load_jobs`, and a seeded synthetic
spot backlog (:class:`SpotBacklog`). The formats: docs/simulator.md, "Inputs"."""

from __future__ import annotations

import csv
import math
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal.model import KINDS


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a job asks for. ``synthetic``: made by the spot backlog (left out of queue-time metrics)."""

    id: str
    tenant: str
    kind: str
    priority: int
    min_gpus: int
    max_gpus: int
    work_gpu_s: float
    submit_s: float
    gpus_per_node: int | None = None
    multiple_of: int = 1
    synthetic: bool = False


NATIVE_COLUMNS = ("submit_s", "tenant", "kind", "priority", "min_gpus", "max_gpus", "work_gpu_s")
PHILLY_COLUMNS = ("job_id", "submit_time", "num_gpu", "duration")


def _rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    f = path.open(newline="")
    reader = csv.DictReader(f)
    header = [h.strip() for h in (reader.fieldnames or [])]

    def it() -> Iterator[tuple[int, dict[str, str]]]:
        with f:
            for row in reader:
                if not any((v or "").strip() for v in row.values()):
                    continue
                yield reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}

    return header, it()


def _require(path: Path, header: list[str], columns: Sequence[str], hint: str) -> None:
    """``ValueError`` naming the ``columns`` missing from ``header``, then ``hint``."""
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}{hint}")


def _num(path: Path, line: int, row: dict[str, str], col: str, kind: type, lo: float | None = None) -> float:
    text = row.get(col, "")
    try:
        v = kind(float(text)) if kind is int and "." in text else kind(text)
    except ValueError:
        raise ValueError(f"{path}:{line}: column {col!r} must be "
                         f"{'an integer' if kind is int else 'a number'}, "
                         f"got {text!r}") from None
    if kind is float and not math.isfinite(v):
        raise ValueError(f"{path}:{line}: column {col!r} must be finite, got {text!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{path}:{line}: column {col!r} must be >= {lo:g}, got {text!r}")
    return v


def load_native(path: str | Path) -> list[JobSpec]:
    """Jobs from the native CSV, in submission order; ``ValueError`` naming the file, line and column."""
    path = Path(path)
    header, rows = _rows(path)
    _require(path, header, NATIVE_COLUMNS,
             f"; a job trace needs {','.join(NATIVE_COLUMNS)} (columns found: {', '.join(header)})")
    out = []
    for i, (line, r) in enumerate(rows):
        kind = r["kind"]
        if kind not in KINDS:
            raise ValueError(f"{path}:{line}: column 'kind' must be one of {KINDS}, got {kind!r}")
        if not r["tenant"]:
            raise ValueError(f"{path}:{line}: column 'tenant' is empty")
        mn = int(_num(path, line, r, "min_gpus", int, 1))
        mx = int(_num(path, line, r, "max_gpus", int, 1)) if r["max_gpus"] else mn
        if mx < mn:
            raise ValueError(f"{path}:{line}: max_gpus ({mx}) < min_gpus ({mn})")
        gpn = int(_num(path, line, r, "gpus_per_node", int, 1)) if r.get("gpus_per_node") else None
        mult = int(_num(path, line, r, "multiple_of", int, 1)) if r.get("multiple_of") else 1
        step = math.lcm(mult, gpn or 1)
        if mn % step or mx % step:
            raise ValueError(f"{path}:{line}: min_gpus and max_gpus must be multiples of {step} "
                             f"(gpus_per_node={gpn}, multiple_of={mult})")
        out.append(JobSpec(id=r.get("id") or f"j{i:06d}", tenant=r["tenant"], kind=kind,
                           priority=int(_num(path, line, r, "priority", int)), min_gpus=mn, max_gpus=mx,
                           work_gpu_s=_num(path, line, r, "work_gpu_s", float, 0),
                           submit_s=_num(path, line, r, "submit_s", float, 0), gpus_per_node=gpn,
                           multiple_of=mult))
    if len({j.id for j in out}) != len(out):
        raise ValueError(f"{path}: job ids must be unique")
    out.sort(key=lambda j: (j.submit_s, j.id))
    return out


def load_philly(path: str | Path, kind: str = "dedicated", priority: int = 1) -> list[JobSpec]:
    """Jobs from the ElasticFlow trace derived from Microsoft Philly (see the module docstring)."""
    path = Path(path)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    header, rows = _rows(path)
    _require(path, header, PHILLY_COLUMNS, f" of the ElasticFlow format ({', '.join(PHILLY_COLUMNS)}, ...)")
    out = []
    for line, r in rows:
        g = int(_num(path, line, r, "num_gpu", int, 1))
        dur = _num(path, line, r, "duration", float, 0)
        jid = f"p{int(_num(path, line, r, 'job_id', int)):06d}"
        out.append(JobSpec(id=jid, tenant=r.get("model_name") or "philly", kind=kind, priority=priority,
                           min_gpus=g, max_gpus=g, work_gpu_s=g * dur,
                           submit_s=_num(path, line, r, "submit_time", float, 0)))
    out.sort(key=lambda j: (j.submit_s, j.id))
    return out


def load_jobs(path: str | Path, philly_kind: str = "dedicated") -> list[JobSpec]:
    """Native CSV or ElasticFlow/Philly, told apart by the header."""
    path = Path(path)
    with path.open(newline="") as f:
        header = [h.strip() for h in next(csv.reader(f), [])]
    if all(c in header for c in PHILLY_COLUMNS):
        return load_philly(path, kind=philly_kind)
    return load_native(path)


@dataclass(frozen=True)
class SpotBacklog:
    """Synthetic elastic spot jobs that keep the spot queue saturated: ``tenants`` tenants ``spot0..``;
    gang minimum from ``sizes`` (``size_weights``); maximum = minimum x ``elastic_factors``; duration on
    the minimum Pareto(``duration_alpha``) x ``duration_min_h`` hours, capped. At least ``pending_gpus``
    GPUs of minimums wait (``None``: the pool's size), and ``pending_per_size`` jobs of every size."""

    tenants: int = 4
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    size_weights: tuple[float, ...] = (0.25, 0.15, 0.15, 0.2, 0.12, 0.08, 0.05)
    elastic_factors: tuple[int, ...] = (1, 2, 4)
    elastic_weights: tuple[float, ...] = (0.3, 0.35, 0.35)
    duration_alpha: float = 1.3
    duration_min_h: float = 1.0
    duration_max_h: float = 14 * 24.0
    pending_gpus: int | None = None
    pending_per_size: int = 4

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.size_weights) or len(self.elastic_factors) != len(
                self.elastic_weights):
            raise ValueError("SpotBacklog: sizes/size_weights and elastic_factors/elastic_weights must "
                             "pair up")
        for name in ("size_weights", "elastic_weights"):
            w = getattr(self, name)
            if not all(math.isfinite(x) and x >= 0 for x in w) or not sum(w) > 0:
                raise ValueError(f"SpotBacklog.{name}: finite weights >= 0, not all 0, are needed; got {w!r}")
        if self.tenants < 1 or self.duration_alpha <= 0 or self.duration_min_h <= 0:
            raise ValueError("SpotBacklog: tenants >= 1, duration_alpha > 0 and duration_min_h > 0 are "
                             "required")


class BacklogSource:
    """Draws :class:`SpotBacklog` jobs from ``rng``; ids ``b0000000``, ... in draw order."""

    def __init__(self, backlog: SpotBacklog, gpus_per_node: int, rng: np.random.Generator,
                 max_gpus: int | None = None) -> None:
        self.b, self.gpn, self.rng = backlog, gpus_per_node, rng
        sizes = [s for s in backlog.sizes if max_gpus is None or s <= max_gpus] or [1]
        w = np.array([backlog.size_weights[backlog.sizes.index(s)] if s in backlog.sizes else 1.0
                      for s in sizes])
        if not w.sum() > 0:
            raise ValueError(f"SpotBacklog.size_weights: every size of at most {max_gpus} GPUs has weight 0")
        self.sizes = sizes
        # A size and an elastic factor each drawn by its inverse CDF from one uniform (what
        # ``Generator.choice(p=)`` does, at a fifteenth of its cost: it checks ``p`` and builds the CDF on
        # every call)
        self._size_cdf = _cdf(w)
        self._factor_cdf = _cdf(np.asarray(backlog.elastic_weights, dtype=float))
        self.max_gpus = max_gpus
        self.seq = 0

    def draw(self, now_s: float, size: int | None = None) -> JobSpec:
        """One job submitted at ``now_s``; its gang size drawn, or ``size``."""
        b, r = self.b, self.rng
        if size is None:
            size = int(self.sizes[bisect_right(self._size_cdf, r.random())])
        factor = int(b.elastic_factors[bisect_right(self._factor_cdf, r.random())])
        mx = size * factor
        if self.max_gpus is not None:
            mx = max(size, min(mx, self.max_gpus // size * size))
        gpn = self.gpn if size >= self.gpn and size % self.gpn == 0 else None
        if gpn is None and mx > self.gpn and size < self.gpn:
            mx = max(size, self.gpn // size * size)  # a small gang stays within a node
        hours = min(b.duration_max_h, b.duration_min_h * (1.0 + r.pareto(b.duration_alpha)))
        tenant = f"spot{int(r.integers(b.tenants))}"
        spec = JobSpec(id=f"b{self.seq:07d}", tenant=tenant, kind="spot", priority=0, min_gpus=size,
                       max_gpus=mx, work_gpu_s=hours * 3600.0 * size, submit_s=now_s, gpus_per_node=gpn,
                       synthetic=True)
        self.seq += 1
        return spec


def _cdf(weights: np.ndarray) -> list[float]:
    """The cumulative distribution of ``weights``, its last value exactly 1."""
    p = weights / weights.sum()
    cdf = p.cumsum()
    cdf /= cdf[-1]
    return cdf.tolist()

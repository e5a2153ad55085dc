"""Policy states as JSON and back, exactly (arrays bit for bit, read-only). Pure. A field with a default
may be absent, the fields of a removed option (:data:`DROPPED`) are ignored, and only :data:`CLASSES` are
rebuilt (a stored document never names code to run)."""

from __future__ import annotations

import base64
import dataclasses
import math
from typing import Any

import numpy as np

from tidal.policy.clients import ClientState
from tidal.policy.forecast import ForecastState
from tidal.policy.loan import TidalState

CLASSES: dict[str, type] = {c.__name__: c for c in (TidalState, ForecastState, ClientState)}
_DTYPES = {"float64", "float32", "int64", "int32", "bool"}
# Fields of removed options, ignored where a stored state still holds them (it loads after an upgrade).
DROPPED: dict[str, frozenset[str]] = {
    "TidalState": frozenset({"joint_excess", "joint_weight", "joint_paths"}),
    "ForecastState": frozenset({"lq_model", "lq_pending", "week_dev", "week_n", "shift_gpus", "shift_count"}),
}


def encode(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = type(x).__name__
        if name not in CLASSES:
            raise TypeError(f"codec: {name} is not a registered policy state")
        return {"__dc__": name, **{f.name: encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        return {"__nd__": [str(a.dtype), list(a.shape), base64.b64encode(a.tobytes()).decode()]}
    if isinstance(x, float | np.floating):
        v = float(x)
        return v if math.isfinite(v) else {"__f__": repr(v)}
    if isinstance(x, bool | int | str) or x is None:
        return x
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, tuple | list):
        return {"__t__": [encode(v) for v in x]}
    raise TypeError(f"codec: cannot encode {type(x).__name__}")


def decode(doc: Any, where: str = "state") -> Any:
    """The value :func:`encode` made; ``ValueError`` naming the place when ``doc`` is not one."""
    if isinstance(doc, dict):
        if "__dc__" in doc:
            cls = CLASSES.get(doc["__dc__"])
            if cls is None:
                raise ValueError(f"{where}: unknown state class {doc['__dc__']!r}")
            fs = dataclasses.fields(cls)
            names = {f.name for f in fs}
            required = {f.name for f in fs
                        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
            dropped = DROPPED.get(cls.__name__, frozenset())
            kw = {k: decode(v, f"{where}.{k}") for k, v in doc.items() if k != "__dc__" and k not in dropped}
            if not required <= set(kw) <= names:
                bad = sorted((set(kw) - names) | (required - set(kw)))
                raise ValueError(f"{where}: {cls.__name__} fields {bad} missing or unknown")
            return cls(**kw)
        if "__nd__" in doc:
            dtype, shape, data = doc["__nd__"]
            if dtype not in _DTYPES:
                raise ValueError(f"{where}: array dtype {dtype!r} not allowed")
            a = np.frombuffer(base64.b64decode(data), dtype=dtype).copy()
            if a.size != math.prod(shape):
                raise ValueError(f"{where}: array of shape {shape} holds {a.size} values")
            a = a.reshape(shape)
            a.flags.writeable = False
            return a
        if "__f__" in doc:
            if doc["__f__"] not in ("nan", "inf", "-inf"):
                raise ValueError(f"{where}: bad float {doc['__f__']!r}")
            return float(doc["__f__"])
        if "__t__" in doc:
            return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(doc["__t__"]))
        raise ValueError(f"{where}: unexpected mapping")
    if isinstance(doc, bool | int | float | str) or doc is None:
        return doc
    raise ValueError(f"{where}: unexpected {type(doc).__name__}")

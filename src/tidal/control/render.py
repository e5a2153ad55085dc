"""JSON answers of the API and the dashboard: :class:`SafeJSON` renders whatever the store holds, and
:func:`json_route` renders a handler's result in the handler's own thread."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response


class SafeJSON(JSONResponse):
    """JSON that renders whatever the store holds: a lone surrogate (not encodable as UTF-8) is escaped
    (``\\ud800``), a NaN or infinity becomes null. Plain content takes the fast path."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except (UnicodeEncodeError, ValueError):
            return json.dumps(_finite(content), ensure_ascii=True, allow_nan=False,
                              separators=(",", ":")).encode()


def json_bytes(content: Any) -> bytes:
    """``content`` rendered as :class:`SafeJSON` renders it."""
    return SafeJSON.render(_RENDER, content)


_RENDER = SafeJSON(None)


class Raw(bytes):
    """A value already rendered as JSON (:func:`json_bytes`), for :func:`json_object`."""


def json_object(fields: dict[str, Any], status: int = 200) -> Response:
    """The JSON object of ``fields`` in their order, each rendered as :class:`SafeJSON` would, but for the
    values already rendered (:class:`Raw`: a part kept from an earlier answer), put in as they are."""
    out = bytearray(b"{")
    for i, (k, v) in enumerate(fields.items()):
        out += b"," if i else b""
        out += json_bytes(k) + b":" + (v if isinstance(v, Raw) else json_bytes(v))
    out += b"}"
    return Response(bytes(out), status_code=status, media_type="application/json")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def json_route(status: int = 200) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Render a handler's result as JSON in the handler's own thread (a ``Response`` passes as is)."""

    def wrap(handler: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(handler)
        def run(*args: Any, **kwargs: Any) -> Any:
            out = handler(*args, **kwargs)
            return out if isinstance(out, Response) else SafeJSON(out, status_code=status)

        return run

    return wrap

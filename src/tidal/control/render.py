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

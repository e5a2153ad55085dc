"""A small client of the REST API, over any ``httpx.Client`` (the transport seam: the network, or a
``TestClient`` of the app in-process). Errors come back as :class:`ApiError` with the HTTP status and, for a
refused spec, one line per field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from tidal.contract import ENV_API_URL, ENV_STATE_DIR, ENV_TOKEN

DEFAULT_URL = "http://127.0.0.1:8470"
API_URL_FILE = "api.url"


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message if not errors else message + ":\n  " + "\n  ".join(errors))
        self.status, self.errors = status, errors or []


def state_dir() -> Path:
    """``$TIDAL_STATE_DIR``, else ``~/.tidal``: where ``tidal up`` keeps its database, jobs and tokens."""
    return Path(os.environ.get(ENV_STATE_DIR) or Path.home() / ".tidal")


def default_url() -> str:
    """``$TIDAL_API_URL``, else what a local ``tidal up`` wrote into its state dir, else port 8470."""
    if os.environ.get(ENV_API_URL):
        return os.environ[ENV_API_URL]
    f = state_dir() / API_URL_FILE
    return f.read_text().strip() if f.exists() else DEFAULT_URL


def default_token() -> str | None:
    """``$TIDAL_TOKEN``, else the admin token of a local ``tidal up``."""
    if os.environ.get(ENV_TOKEN):
        return os.environ[ENV_TOKEN]
    try:
        return (state_dir() / "admin.token").read_text().strip()
    except OSError:
        return None


def origin() -> str:
    """Where the API address and the token come from (for an error they may explain: a client whose state
    dir has no ``api.url`` reaches whatever listens on the default port, with a token that is not its)."""
    sd = state_dir()
    if os.environ.get(ENV_API_URL):
        url = f"API address from ${ENV_API_URL}"
    elif (sd / API_URL_FILE).exists():
        url = f"API address from {sd / API_URL_FILE}"
    else:
        url = (f"the default API address {DEFAULT_URL} (no {API_URL_FILE} in {sd}: no tidal up with this "
               "state dir)")
    if os.environ.get(ENV_TOKEN):
        token = f"token from ${ENV_TOKEN}"
    elif (sd / "admin.token").exists():
        token = f"token from {sd / 'admin.token'}"
    else:
        token = f"no token (no ${ENV_TOKEN}, no admin.token in {sd})"
    return f"{url}; {token}"


class TidalClient:
    def __init__(self, base_url: str | None = None, token: str | None = None, *,
                 http: httpx.Client | None = None, timeout_s: float = 30.0) -> None:
        self.http = http or httpx.Client(base_url=base_url or default_url(), timeout=timeout_s)
        self.token = token

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            try:
                r = self.http.request(method, path, headers=headers, **kw)
            except httpx.RemoteProtocolError:
                if method != "GET":
                    raise
                # The server closed an idle keep-alive connection as the request went out: a read is
                # safe to send again, on a new connection (``tidal logs -f`` must not stop for this).
                r = self.http.request(method, path, headers=headers, **kw)
        except httpx.TransportError as e:
            raise ApiError(
                0, f"cannot reach the Tidal API at {self.http.base_url} ({e}); is `tidal up` running? "
                "(TIDAL_API_URL)") from e
        if r.status_code >= 400:
            try:
                doc = r.json()
            except ValueError:
                doc = {"detail": r.text}
            errors = doc.get("errors") if isinstance(doc, dict) else None
            detail = doc.get("detail") if isinstance(doc, dict) else doc
            msg = detail if isinstance(detail, str) else f"HTTP {r.status_code}"
            if r.status_code == 422:
                msg = "the spec was refused"
            raise ApiError(r.status_code, msg, errors)
        return r.json() if r.content else None

    def whoami(self) -> dict:
        return self._call("GET", "/v1/whoami")

    def submit(self, spec: dict) -> dict:
        return self._call("POST", "/v1/jobs", json=spec)

    def jobs(self, *, states: list[str] | None = None, tenant: str | None = None) -> list[dict]:
        """Every job that matches, a bounded page per call."""
        params: dict = {k: v for k, v in (("state", states), ("tenant", tenant)) if v}
        out: list[dict] = []
        while len(page := self._call("GET", "/v1/jobs", params={**params, "offset": len(out), "limit": 1000})
                  ) == 1000:
            out += page
        return out + page

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def logs(self, job_id: str, *, rank: int = 0, offset: int = 0, limit: int = 65536) -> dict:
        return self._call(
            "GET", f"/v1/jobs/{job_id}/logs", params={"rank": rank, "offset": offset, "limit": limit}
        )

    def checkpoints(self, job_id: str) -> dict:
        """Committed checkpoint steps per tier, the newest durable step and its age."""
        return self._call("GET", f"/v1/jobs/{job_id}/checkpoints")

    def events(self, job_id: str | None = None, *, after: int = 0, limit: int = 1000) -> list[dict]:
        params = {"after": after, "limit": limit, **({"job": job_id} if job_id else {})}
        return self._call("GET", "/v1/events", params=params)

    def pool(self, offset: int = 0, limit: int = 512) -> dict:
        """The pool's totals and ``limit`` of its nodes from ``offset``."""
        return self._call("GET", "/v1/pool", params={"offset": offset, "limit": limit})

    def serving(self) -> dict:
        """The newest live loan plan (advice) and its source; 404 if the plane has no serving side."""
        return self._call("GET", "/v1/serving")

    def tenants(self) -> list[dict]:
        return self._call("GET", "/v1/tenants")

    def create_tenant(self, name: str, *, quota_gpus: int = 0, weight: float = 1.0,
                      max_priority: int = 0) -> dict:
        body = {"name": name, "quota_gpus": quota_gpus, "weight": weight, "max_priority": max_priority}
        return self._call("POST", "/v1/tenants", json=body)

    def metrics(self) -> str:
        """Prometheus text (the admin's token)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        r = self.http.get("/metrics", headers=headers)
        r.raise_for_status()
        return r.text

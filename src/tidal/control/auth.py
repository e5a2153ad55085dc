"""Tenants' bearer tokens: created here, shown once, stored only as a SHA-256 hash.

Tokens are 32 random bytes, so a plain hash is enough (nothing to brute-force, no constant-time compare
needed). The admin token is created at the first ``tidal up`` and kept in ``<state dir>/admin.token`` (mode
0600) for the command line; ``TIDAL_TOKEN`` overrides it.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from tidal.control.store import JobRow, NotFound, Store, TenantRow
from tidal.files import write_atomic

ADMIN = "admin"
ADMIN_TOKEN_FILE = "admin.token"


def new_token() -> str:
    return "tidal_" + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def authenticate(store: Store, token: str | None) -> TenantRow | None:
    return store.tenant_by_token_hash(token_hash(token)) if token else None


def create_tenant(store: Store, name: str, *, quota_gpus: int = 0, weight: float = 1.0, now_s: float = 0.0,
                  admin: bool = False, max_priority: int = 0) -> str:
    """Add a tenant; return its token (the only time it exists in clear)."""
    token = new_token()
    store.add_tenant(name, token_hash(token), quota_gpus=quota_gpus, weight=weight, admin=admin, now_s=now_s,
                     max_priority=max_priority)
    return token


def ensure_admin(store: Store, state_dir: Path, now_s: float) -> tuple[str, bool]:
    """The admin token, creating the admin and ``admin.token`` on first start: (token, created). A token file
    is registered in a new store; a lost one is replaced."""
    path = Path(state_dir) / ADMIN_TOKEN_FILE
    token = path.read_text().strip() if path.exists() else None
    row = store.admin()
    if row is not None and token is not None and row.token_hash == token_hash(token):
        return token, False
    token = token or new_token()
    if row is None:
        store.add_tenant(ADMIN, token_hash(token), admin=True, now_s=now_s)
    else:
        store.set_tenant_token(row.name, token_hash(token))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, token + "\n")
    return token, True


def visible_job(store: Store, job_id: str, caller: TenantRow) -> JobRow | None:
    """The job if ``caller`` may see it (its tenant's, or the admin), else None: a job of another tenant
    answers exactly as a job that does not exist (the API's 404), so ids are not probed."""
    try:
        job = store.job(job_id)
    except NotFound:
        return None
    return job if caller.admin or job.tenant == caller.name else None

"""Ray's token authentication for the Ray executor (Ray >= 2.52; docs/control.md, Isolation on Ray).

With ``RAY_AUTH_MODE=token`` every Ray process checks a shared token (``RAY_AUTH_TOKEN``, else the file
``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``) on each call. Without it a job that reaches the
cluster's ports runs tasks as the workers' user (root, when jobs run as their own uids).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from tidal.contract import RAY_AUTH_MODE_ENV as MODE_ENV
from tidal.contract import RAY_AUTH_TOKEN_ENV as TOKEN_ENV
from tidal.contract import RAY_AUTH_TOKEN_PATH_ENV as TOKEN_PATH_ENV
from tidal.files import write_atomic

PROBE_TIMEOUT_S = 5.0
TOKEN_FILE = "ray-auth-token"  # enable_local's file (0600) in its directory (0700)


def _set_mode(mode: str) -> None:
    """Token mode (or ``disabled``) for this process and what it starts from now on; Ray's config and
    token in this process are read again (both are cached: a second local cluster with a new token
    would not start)."""
    os.environ[MODE_ENV] = mode
    try:
        # ray's compiled module: its stub lacks these two (private API, hence the except below)
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # ray not imported yet (it reads the environment then) or its private API moved
        pass


def use_token_from_env() -> bool:
    """Token mode on when ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` is set and ``RAY_AUTH_MODE`` is
    not; whether this process now talks to Ray with a token."""
    mode = os.environ.get(MODE_ENV)
    if mode is None and (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV)):
        _set_mode("token")
        return True
    return (mode or "").lower() == "token"


def write_token(directory: Path) -> Path:
    """A fresh random token in ``directory/ray-auth-token`` (0700 directory, 0600 file); its path."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    path = directory / TOKEN_FILE
    write_atomic(path, secrets.token_hex(32))
    return path


def enable_local(directory: Path) -> Path:
    """Token authentication for the local clusters this process starts (``ray.cluster_utils.Cluster``)
    and its drivers: a fresh token file under ``directory`` (:func:`write_token`), named by
    ``RAY_AUTH_TOKEN_PATH`` in this process's environment (inherited by Ray's processes, never by a
    job's clean environment), and ``RAY_AUTH_MODE=token``. Its path."""
    path = write_token(directory)
    os.environ[TOKEN_PATH_ENV] = str(path)
    os.environ.pop(TOKEN_ENV, None)
    _set_mode("token")
    return path


def token_file() -> Path | None:
    """The file Ray reads the token from in this process: ``RAY_AUTH_TOKEN_PATH``, else
    ``~/.ray/auth_token`` when it exists; None when the token is in ``RAY_AUTH_TOKEN`` (Ray's order)."""
    if os.environ.get(TOKEN_ENV):
        return None
    if os.environ.get(TOKEN_PATH_ENV):
        return Path(os.environ[TOKEN_PATH_ENV])
    default = Path.home() / ".ray" / "auth_token"
    return default if default.exists() else None


def readable_by_others(path: Path) -> bool:
    """Whether any user may read ``path``: it is world-readable and every directory above it may be
    passed through by others (a job's uid has no group of the file's: no supplementary groups)."""
    try:
        real = path.resolve(strict=True)
        if not os.stat(real).st_mode & 0o004:
            return False
        return all(os.stat(d).st_mode & 0o001 for d in real.parents)
    except OSError:
        return False


def gcs_address(ray: Any) -> str | None:
    """The connected cluster's GCS ``HOST:PORT``; None for a Ray Client (``ray://``) connection."""
    try:
        return ray.get_runtime_context().gcs_address or None
    except Exception:
        return None


def anonymous_refused(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the GCS at ``address`` refuses a call that carries no token (``UNAUTHENTICATED``): True,
    it does; False, it answered; None, it could not tell (no answer, another error, no grpc)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2 as pb
        from ray.core.generated import gcs_service_pb2_grpc as pb_grpc
    except ImportError:
        return None
    with grpc.insecure_channel(address) as channel:  # no interceptors: nothing adds Ray's token
        try:
            pb_grpc.NodeInfoGcsServiceStub(channel).CheckAlive(pb.CheckAliveRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return True if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False

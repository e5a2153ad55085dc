"""What ``tidal up --executor ray`` checks of the cluster at start, each a one-line ``ValueError``: that
an address answers, that every node can sandbox ranks (``isolation.mode: sandbox``), and with
``isolation.uid_base`` that the cluster refuses clients without its token and that the Ray workers run
as root on every node (a rank actor starts its rank as the job's uid; a node that joins later without
root, or without bwrap, fails the rank's start with that reason in its log).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from tidal.contract import RAY_AUTH_MODE_ENV, RAY_AUTH_TOKEN_ENV, RAY_AUTH_TOKEN_PATH_ENV
from tidal.contract import RAY_NODE_LABEL as NODE_LABEL
from tidal.exec.ray_auth import anonymous_refused, gcs_address, readable_by_others, token_file
from tidal.exec.ray_shm import run_on_nodes

CHECK_TIMEOUT_S = 60.0  # a cold node starts a worker first (seconds on a busy machine)


def check_reachable_address(address: str | None) -> None:
    """A ``HOST:PORT`` address nothing answers at is one clear error now (``ray.init`` retries for
    minutes)."""
    if not address or "://" in address or address == "auto" or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not host:
        raise ValueError(f"--ray-address {address!r}: expected HOST:PORT, 'auto' or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(
            f"cannot join the Ray cluster at {address}: nothing answers there ({e.strerror or e})"
        ) from None


def token_auth_enabled() -> bool:
    """Whether this process talks to its Ray cluster with Ray's token authentication (``RAY_AUTH_MODE=token``,
    Ray >= 2.52); False when it cannot tell."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return bool(is_token_auth_enabled())
    except Exception:  # an older Ray, or the private API moved
        return False


def cluster_authenticates(ray: Any) -> bool:
    """Whether the connected cluster refuses a client without its token: its GCS asked without one
    (:func:`tidal.exec.ray_auth.anonymous_refused`); where that cannot tell (a Ray Client connection, no
    answer), whether this driver sends a token."""
    address = gcs_address(ray)
    refused = anonymous_refused(address) if address else None
    return token_auth_enabled() if refused is None else refused


OPEN_OPTION = "isolation.ray_open_cluster"


def check_auth(ray: Any, sandboxed: bool, allow_open: bool) -> bool:
    """Whether the connected cluster refuses clients without its token; with ``sandboxed`` ranks
    ``ValueError`` in one line when it does not (unless ``allow_open``: a rank that speaks Ray's protocol
    would run code as the workers' user outside its sandbox) or when the token's file here is readable by
    every user."""
    authenticated = cluster_authenticates(ray)
    if sandboxed:
        check_open_cluster(authenticated, allow_open)
        check_token_file(token_file())
    return authenticated


def join_error(address: str | None, e: BaseException) -> ValueError:
    """What ``tidal up`` says when ``ray.init`` fails with ``e``: Ray's first line, or that the cluster
    refuses clients without its token when its GCS says so."""
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    if address and "://" not in address and ":" in address and anonymous_refused(address, 2.0):
        why = (f"it refuses clients without its token ({RAY_AUTH_MODE_ENV}="
               f"{os.environ.get(RAY_AUTH_MODE_ENV, 'unset')}; give the cluster's token in "
               f"{RAY_AUTH_TOKEN_PATH_ENV} or {RAY_AUTH_TOKEN_ENV})")
    return ValueError(f"cannot join the Ray cluster at {address or 'a new local Ray'}: {why}")


def check_open_cluster(authenticated: bool, allowed: bool) -> None:
    """``ValueError`` in one line when jobs would run as their own uids on a cluster without token
    authentication, unless the operator said so (``isolation.ray_open_cluster: true``)."""
    if not authenticated and not allowed:
        raise ValueError(
            "isolation: the Ray cluster accepts clients without a token, so a job could run code as the "
            "Ray workers' user on any node, outside its sandbox: start Ray with RAY_AUTH_MODE=token and give "
            "tidal up the token "
            f"(RAY_AUTH_TOKEN_PATH), or set {OPEN_OPTION}: true to run anyway (docs/control.md, Isolation)"
        )


def check_token_file(path: Path | None) -> None:
    """``ValueError`` in one line when the file Ray reads its token from here (``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``) can be read by other users, among them the jobs' uids."""
    if path is not None and readable_by_others(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        raise ValueError(f"isolation: Ray's token file {path} is readable by every user (mode "
                         f"{mode:04o}): a job could read it and run code as the workers' user on any node; "
                         "chmod 600 it")


def open_cluster_warning() -> str:
    """What ``tidal up`` says at start when ``isolation.ray_open_cluster`` lets sandboxed jobs run on a
    cluster without token authentication."""
    return ("warning: the Ray cluster has no token authentication: a job that reaches its ports and speaks "
            "Ray's protocol runs code as the workers' user on any node, outside its sandbox; start "
            f"Ray with RAY_AUTH_MODE=token ({OPEN_OPTION} is set; docs/control.md, Isolation)")


def _euid() -> int:
    """On the node: the uid the Ray worker runs as."""
    return os.geteuid()


def check_workers_root(ray: Any, nodes: Mapping[str, str], timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """``ValueError`` in one line unless a worker on every node (name -> Ray node id) answers it runs as
    root."""
    answers, late = run_on_nodes(ray, nodes, _euid, {n: () for n in nodes}, cancel_late=True,
                                 timeout_s=timeout_s)
    msg = verdict(answers, late, list(nodes), timeout_s)
    if msg is not None:
        raise ValueError(msg)


def workers_root(ray: Any, nodes: Mapping[str, str], timeout_s: float = CHECK_TIMEOUT_S) -> bool:
    """Whether a worker on every node (name -> Ray node id; none: True) answers it runs as root."""
    answers, late = run_on_nodes(ray, nodes, _euid, {n: () for n in nodes}, cancel_late=True,
                                 timeout_s=timeout_s)
    return verdict(answers, late, list(nodes), timeout_s) is None


def verdict(euids: Mapping[str, int], late: list[str], nodes: list[str],
            timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """What ``tidal up`` says of the workers' uids per node (``euids``; ``late``: not answered in
    time), in one line; None when every node of ``nodes`` answered root."""
    missing = sorted(set(nodes) - set(euids))
    if missing:
        return (f"isolation.uid_base: no Ray worker answered on {', '.join(missing)} within {timeout_s:g} s "
                "(each node's workers must run as root to start ranks as jobs' uids)")
    other = {n: u for n, u in sorted(euids.items()) if u != 0}
    if other:
        return ("isolation.uid_base: the Ray workers run as "
                + ", ".join(f"uid {u} on {n}" for n, u in other.items())
                + ", not root: they cannot start ranks as jobs' uids (start Ray as root, or remove uid_base)")
    return None


def check_serving(serving: Mapping[str, int], have: Mapping[str, int],
                  tolerate: Collection[str] = ()) -> None:
    """``ValueError`` in one line when a serving node (name -> GPUs the serving side says) is not among
    ``have`` (the cluster's alive GPU nodes by their ``tidal.io/node`` label -> GPUs) or has other GPUs
    there; nodes in ``tolerate`` may."""
    missing = sorted(set(serving) - set(have) - set(tolerate))
    if missing:
        raise ValueError(
            f"serving.nodes: {', '.join(missing)} not in the Ray cluster (a serving node is the "
            f"Ray node labelled {NODE_LABEL}=NAME; the cluster has {sorted(have) or 'no GPU nodes'})"
        )
    other = {n: (g, have[n]) for n, g in serving.items() if n in have and have[n] != g and n not in tolerate}
    if other:
        raise ValueError("serving.nodes: " + "; ".join(
            f"{n} has {g} GPUs there but {h} in the Ray cluster" for n, (g, h) in sorted(other.items())))


def _sandbox_verdict(paths: list[str]) -> str | None:
    """On the node: why a rank cannot be sandboxed here (no working ``bwrap``, or one of the plane's
    ``paths`` missing: its interpreter and code must be at the same paths), or None."""
    from tidal.exec.sandbox import find_bwrap

    try:
        find_bwrap()
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return str(e).removeprefix("isolation: ")
    missing = [p for p in paths if not os.path.isdir(p)]
    return f"{missing[0]} is not there (tidal up's interpreter and code must be at the same paths)" \
        if missing else None


def check_sandbox(ray: Any, nodes: Mapping[str, str], paths: list[str],
                  timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """``ValueError`` in one line unless a worker on every node (name -> Ray node id) answers that it can
    sandbox ranks (:func:`_sandbox_verdict` of ``paths``)."""
    answers, _ = run_on_nodes(ray, nodes, _sandbox_verdict, {n: (list(paths),) for n in nodes},
                              cancel_late=True, timeout_s=timeout_s)
    msg = sandbox_verdict(answers, list(nodes), timeout_s)
    if msg is not None:
        raise ValueError(msg)


def sandbox_verdict(answers: Mapping[str, str | None], nodes: list[str],
                    timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """What ``tidal up`` says of the nodes' answers (node -> why it cannot sandbox, or None), in one line;
    None when every node of ``nodes`` answered that it can."""
    missing = sorted(set(nodes) - set(answers))
    if missing:
        return (f"isolation: no Ray worker answered on {', '.join(missing)} within {timeout_s:g} s (asked "
                "whether it can sandbox ranks)")
    bad = sorted((n, why) for n, why in answers.items() if why)
    if not bad:
        return None
    more = f" (and on {', '.join(n for n, _ in bad[1:])})" if len(bad) > 1 else ""
    return f"isolation: Ray node {bad[0][0]} cannot sandbox ranks{more}: {bad[0][1]}"

"""Credentials of the checkpoint agents (standard library only): the plane's **key** (:data:`KEY_FILE`,
0600), a job's **token** (HMAC of its namespace), the agents' own token (HMAC with another label), a
job's **checkpoint key** (:func:`job_ckpt_key`), and the check an agent makes (:class:`Guard`).
Requests carry ``Authorization: Bearer <token>``; an agent without a key accepts everything. How the
key reaches the agents and who gets which token: docs/checkpoint.md, "Authentication"."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from tidal.files import write_atomic

KEY_FILE = ".ckpt-agent.key"  # in the executor's root (<state dir>/jobs), 0600
KEY_BYTES = 32
HEADER = "Authorization"
SCHEME = "Bearer "
_JOB = b"tidal-ckpt-agent/job\0"
_AGENT = b"tidal-ckpt-agent/agent\0"
_CKPT = b"tidal-ckpt/manifest\0"


def parse_key(text: str, where: str) -> bytes:
    """The key written as hex (surrounding whitespace ignored); ValueError naming ``where``."""
    s = text.strip()
    try:
        key = bytes.fromhex(s)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{where}: expected {KEY_BYTES * 2} hex digits (a checkpoint agent key)")
    return key


def read_key(path: str | os.PathLike) -> bytes:
    """The key in ``path`` (a regular file, not a link, that no other user may read or write)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"key file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"key file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"key file {path}: mode {oct(stat.S_IMODE(st.st_mode))}; expected 0600 "
                             "(no access for others)")
        return parse_key(f.read(4096).decode("ascii", "replace"), f"key file {path}")


def load_or_create_key(directory: str | os.PathLike) -> bytes:
    """The plane's key in ``directory``/:data:`KEY_FILE`, created (0600, never torn; a racing start reads
    the winner's) if there is none yet."""
    path = Path(directory) / KEY_FILE
    if os.path.lexists(path):
        return read_key(path)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        write_atomic(path, key.hex() + "\n", exclusive=True)
    except FileExistsError:
        return read_key(path)
    return key


def job_token(key: bytes, namespace: str) -> str:
    """The token for the steps of ``namespace`` (a job's namespace in the agents)."""
    return hmac.new(key, _JOB + namespace.encode(), hashlib.sha256).hexdigest()


def job_ckpt_key(key: bytes, job_id: str) -> str:
    """The checkpoint key of job ``job_id`` (hex), derived from the plane's key."""
    return hmac.new(key, _CKPT + job_id.encode(), hashlib.sha256).hexdigest()


def agent_token(key: bytes) -> str:
    """The token of the agents themselves and of the plane: accepted for everything."""
    return hmac.new(key, _AGENT, hashlib.sha256).hexdigest()


def headers(token: str | None) -> dict[str, str]:
    return {HEADER: SCHEME + token} if token else {}


class Guard:
    """An agent's check of a request's token (``key`` None: everything is allowed)."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self._agent = agent_token(key).encode() if key is not None else b""

    @property
    def open(self) -> bool:
        return self.key is None

    @staticmethod
    def _given(value: str | None) -> bytes | None:
        if not value or not value.startswith(SCHEME):
            return None
        return value[len(SCHEME):].strip().encode("latin-1", "replace")

    def is_agent(self, value: str | None) -> bool:
        """Whether the ``Authorization`` header ``value`` carries the agent token (or no key is set)."""
        if self.key is None:
            return True
        given = self._given(value)
        return given is not None and hmac.compare_digest(given, self._agent)

    def refusal(self, value: str | None, namespace: str | None) -> str | None:
        """Why a request with ``Authorization`` header ``value`` may not touch ``namespace``'s steps
        (None: the agents' own endpoints), or None when it may."""
        if self.key is None or self.is_agent(value):
            return None
        given = self._given(value)
        if namespace is None:
            return "this endpoint is the agents' own: " + ("no token given" if given is None else
                                                           "the token given is not theirs")
        if given is None:
            return f"the steps of {namespace!r} need a token (Authorization: Bearer $TIDAL_CKPT_AGENT_TOKEN)"
        if hmac.compare_digest(given, job_token(self.key, namespace).encode()):
            return None
        return f"the steps of {namespace!r}: the token given is not valid for them"

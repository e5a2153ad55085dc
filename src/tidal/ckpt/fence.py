"""The fence of a checkpoint location: which job and attempt own it now (docs/checkpoint.md, Fencing).

The executor writes ``fence.json`` (:data:`tidal.contract.FENCE_FILE`: ``{"job", "attempt"}``) into a
directory home before an attempt's ranks start (:func:`fence_launch`); an S3 home's rank 0 claims it
when its checkpointer starts (:func:`claim_s3`). Rank 0 checks it before every commit
(:func:`check`, :func:`check_s3`): another job or a newer attempt is a ``FencedError``. No fence, or no
claim, is not checked. Stdlib only (no torch)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal import contract as c
from tidal.ckpt.errors import FencedError
from tidal.files import NotPlainFile, open_plain, write_atomic

log = logging.getLogger(__name__)

MAX_FENCE_BYTES = 4096  # a fence is ~60 bytes; anything bigger is not one of ours


@dataclass(frozen=True)
class Claim:
    """The job and attempt a rank belongs to."""

    job: str
    attempt: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Claim | None:
        """``TIDAL_JOB_ID`` + ``TIDAL_ATTEMPT``; ``None`` when either is missing (not launched by the plane)
        or the attempt is not a positive integer (then with a warning: the fence is not checked)."""
        e = os.environ if environ is None else environ
        job, raw = e.get(c.ENV_JOB_ID), e.get(c.ENV_ATTEMPT)
        if not job or not raw:
            return None
        try:
            attempt = int(raw)
        except ValueError:
            attempt = 0
        if attempt < 1:
            log.warning("%s=%r is not a positive integer: the checkpoint fence is not checked",
                        c.ENV_ATTEMPT, raw)
            return None
        return cls(job, attempt)


def tier_specs(env: Mapping[str, str]) -> list | None:
    """The tier list of a launch's ``TIDAL_CKPT_TIERS`` (JSON, or comma-separated), unchecked; None
    without one or when it is not a list."""
    raw = env.get(c.ENV_CKPT_TIERS)
    if not raw:
        return None
    try:
        tiers = json.loads(raw)
    except ValueError:
        tiers = [t.strip() for t in raw.split(",")]
    return tiers if isinstance(tiers, list) else None


def home_dir(env: Mapping[str, str], cwd: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint directory a job's ranks commit under, from their variables (``TIDAL_CKPT_TIERS``,
    else ``TIDAL_CKPT_URL``: the home :func:`tidal.ckpt.tiers.config.resolve` picks); ``None`` when it is
    not a directory (S3: claimed by rank 0, :func:`claim_s3`; peer: not fenced) or the variables are
    malformed (the runtime reports those). A relative path is taken from ``cwd``, the ranks' working
    directory."""
    from tidal.ckpt.errors import CheckpointError
    from tidal.ckpt.tiers.config import kind_of, resolve
    from tidal.ckpt.tiers.directory import local_path

    try:
        if env.get(c.ENV_CKPT_TIERS):
            tiers = tier_specs(env)
            home = resolve(tiers, default_keep=0)[0] if tiers is not None else ""
        else:
            home = env.get(c.ENV_CKPT_URL) or ""
        if not home or kind_of(home, "checkpoint url") != "dir":
            return None
    except (CheckpointError, ValueError, TypeError):
        return None
    path = Path(home.removeprefix("file://")).expanduser()
    return Path(cwd, path) if cwd is not None and not path.is_absolute() else local_path(path)


def read(directory: str | os.PathLike) -> dict | None:
    """The fence of ``directory``: ``{"job", "attempt", ...}``, or ``None`` when there is none.
    ``FencedError`` (naming the file) when it is there but unreadable or not a fence: a commit under a
    fence that cannot be read would defeat it."""
    path = Path(directory) / c.FENCE_FILE
    try:
        with open_plain(path) as f:
            data = f.read(MAX_FENCE_BYTES + 1)
    except FileNotFoundError:
        return None
    except NotPlainFile:
        raise FencedError(f"checkpoint fence {path}: not a regular file") from None
    except OSError as e:
        raise FencedError(f"checkpoint fence {path}: cannot be read ({e.strerror or e})") from None
    return _parse(data, os.fspath(path))


def _parse(data: bytes, where: str) -> dict:
    try:
        doc = json.loads(data) if len(data) <= MAX_FENCE_BYTES else None
    except ValueError:
        doc = None
    if not (isinstance(doc, dict) and isinstance(doc.get("job"), str) and type(doc.get("attempt")) is int):
        raise FencedError(f"checkpoint fence {where}: not a fence (expected a JSON object with a string "
                          "'job' and an integer 'attempt')")
    return doc


def _refuse(doc: dict | None, where: str, claim: Claim, step: int) -> None:
    if doc is not None and (doc["job"] != claim.job or doc["attempt"] > claim.attempt):
        raise FencedError(f"step {step}: commit refused: checkpoint location {where} is fenced for job "
                          f"{doc['job']!r} attempt {doc['attempt']} ({c.FENCE_FILE}); this rank is job "
                          f"{claim.job!r} attempt {claim.attempt}; nothing of this step becomes visible")


def check(directory: str | os.PathLike, claim: Claim, step: int) -> None:
    """Raise ``FencedError`` naming the location, the fence and the step when ``directory`` belongs to
    another job or to a newer attempt than ``claim``'s (an older attempt's fence: the plane could not
    write the newer one; ``claim`` is the newest known, so the commit goes on)."""
    _refuse(read(directory), os.fspath(directory), claim, step)


def read_s3(tier: Any) -> dict | None:
    """The fence of an S3 home (``<prefix>/fence.json``): None when there is none, ``FencedError`` when it
    is not a fence, ``OSError`` when it cannot be reached."""
    where = f"{tier.location}/{c.FENCE_FILE}"
    try:
        data = tier.read_top(c.FENCE_FILE, limit=MAX_FENCE_BYTES)
    except ValueError:
        data = b"x" * (MAX_FENCE_BYTES + 1)  # larger than any fence: not one
    return None if data is None else _parse(data, where)


def check_s3(tier: Any, claim: Claim, step: int) -> None:
    """:func:`check` for an S3 home: one GET before the manifest's PUT. A fence that cannot be *reached*
    (nothing reaches the store meanwhile) lets the commit go on, with a warning."""
    try:
        doc = read_s3(tier)
    except OSError as e:
        log.warning("step %d: checkpoint fence %s/%s cannot be read (%s); committing unchecked", step,
                    tier.location, c.FENCE_FILE, e)
        return
    _refuse(doc, tier.location, claim, step)


def claim_s3(tier: Any, claim: Claim) -> bool:
    """Rank 0 of an attempt whose home is S3, at start: write the fence for ``claim`` unless it names a
    newer attempt of the same job. Whether it wrote; an unreachable store is a warning."""
    try:
        try:
            doc = read_s3(tier)
        except FencedError:
            doc = None  # not a fence: replaced by this attempt's
        if doc is not None and doc["job"] == claim.job and doc["attempt"] >= claim.attempt:
            return False
        body = {"job": claim.job, "attempt": claim.attempt, "written_s": round(time.time(), 3)}
        tier.write_top(c.FENCE_FILE, json.dumps(body).encode())
        return True
    except OSError as e:
        log.warning("checkpoint fence %s/%s cannot be written (%s); a stale attempt could still commit "
                    "there", tier.location, c.FENCE_FILE, e)
        return False


_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def _open_dir_trusted(path: Path) -> int:
    """A descriptor of directory ``path``, resolved one component at a time: a symbolic link is followed
    only if it belongs to this process's user or root (e.g. an administrator's ``/data -> /mnt/data``),
    never one a job's uid planted anywhere in the path. ``OSError`` (``ELOOP``) for such a link,
    ``FileNotFoundError`` for a missing component."""
    trusted = {0, os.geteuid()}
    todo = list(Path(os.path.abspath(path)).parts[1:])
    fd, hops = os.open("/", os.O_RDONLY | os.O_DIRECTORY), 0
    try:
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            st = os.lstat(part, dir_fd=fd)
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if st.st_uid not in trusted or hops > _MAX_LINKS:
                    raise OSError(errno.ELOOP, f"{part}: a link this plane does not trust (uid {st.st_uid})")
                target = os.readlink(part, dir_fd=fd)
                todo = [*Path(target).parts, *todo]
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
                    todo.pop(0)
                continue
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def write(directory: str | os.PathLike, job: str, attempt: int) -> Path | None:
    """Record that ``directory`` belongs to ``job``'s ``attempt`` (the executor, before the attempt's ranks
    start). Atomic, never following a link the job may have planted. ``None`` when the directory does
    not exist yet (no step to protect); ``OSError`` when it cannot be written."""
    d = Path(directory)
    try:
        dfd = _open_dir_trusted(d)
    except FileNotFoundError:
        return None
    try:
        data = json.dumps({"job": job, "attempt": int(attempt), "written_s": round(time.time(), 3)})
        # world-readable whatever the umask (group: set by fchmod): every rank, whatever its uid, checks it
        write_atomic(c.FENCE_FILE, data, mode=0o644, group=os.getegid(), dir_fd=dfd)
    finally:
        os.close(dfd)
    return d / c.FENCE_FILE


def fence_launch(env: Mapping[str, str], job: str, attempt: int,
                 cwd: str | os.PathLike | None = None) -> Path | None:
    """The executor's part: fence the home directory named by a launch's variables (``cwd``: the ranks'
    working directory) for ``job``'s ``attempt``. A location that cannot be fenced (S3, peer, not there
    yet, not writable) is launched unfenced, with a warning for the last."""
    home = home_dir(env, cwd)
    if home is None:
        return None
    try:
        done = write(home, job, attempt)
        if done is None and attempt > 1:  # e.g. a Ray plane that does not see the shared filesystem
            log.warning("job %s attempt %d: its checkpoint location %s is not on this machine; not fenced",
                        job, attempt, home)
        return done
    except OSError as e:
        log.warning("job %s attempt %d: cannot fence its checkpoint location %s (%s); a stale attempt could "
                    "still commit there", job, attempt, home, e)
        return None


"""The node checkpoint agent: holds this node's recent steps in memory and replicates them to a buddy.

    tidal ckpt agent --listen 0.0.0.0:7070 --mem-dir /dev/shm/tidal-agent --buddy node2:7070

Objects are stored under the memory directory (``store``) and pushed to the buddy (``replicator``);
the HTTP layer and its bounds are ``handler``, credentials ``auth``. The HTTP API, its refusals (403,
409, 503, 507) and its threads are in docs/checkpoint.md, "Peer memory: checkpoint agents"."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

from tidal.ckpt.agent.auth import Guard, agent_token, parse_key, read_key
from tidal.ckpt.agent.handler import Handler, Server
from tidal.ckpt.agent.peercred import peer_uid
from tidal.ckpt.agent.replicator import Growing, Handoff, HTTPError, Replicator
from tidal.ckpt.agent.store import MANIFEST, Store, check_name, parse_step, step_dirname
from tidal.ckpt.tiers.directory import sidecar_name
from tidal.ckpt.tiers.peer import parse_address
from tidal.contract import ENV_CKPT_AGENT_KEY, ENV_SHM_DIR

log = logging.getLogger("tidal.ckpt.agent")
FORMAT = "tidal-ckpt-agent"
CHUNK = 16 << 20  # copy granularity, bytes: a push to the buddy follows the copy this far behind
HANDOFF_KEEP_S = 600.0  # how long a held handoff's record is kept after its copy ended (commit checks use it)


def _copy(src: int, dst: int, offset: int, n: int) -> int:
    """Copy up to ``n`` bytes at ``offset`` from ``src`` to the same offset of ``dst`` in the kernel."""
    try:
        return os.copy_file_range(src, dst, n, offset, offset)
    except OSError:  # (EXDEV, ENOSYS, EINVAL on older kernels): through user space
        data = os.pread(src, n, offset)
        return os.pwrite(dst, data, offset) if data else 0


def default_copy_roots() -> list[str]:
    return [str(Path(os.environ.get(ENV_SHM_DIR, "/dev/shm")) / "tidal")]


class Agent:
    """One node's checkpoint agent. ``start`` serves in a background thread; ``close`` stops it."""

    def __init__(self, listen: str, mem_dir: str | os.PathLike, *, buddy: str | None = None,
                 node: str | None = None, allow_copy_from: list[str] | None = None, resync_s: float = 2.0,
                 sync_timeout_s: float = 240.0, reserve_bytes: int = 64 << 20,
                 key: bytes | None = None, max_connections: int = 128,
                 min_upload_rate_bytes_per_s: float = 1 << 20, upload_grace_s: float = 10.0) -> None:
        host, _, port = parse_address(listen, "--listen", any_port=True).rpartition(":")
        self.store = Store(mem_dir)
        found = self.store.open()
        self._server = Server((host, int(port)), Handler, max_connections=max_connections,
                              min_rate_bytes_per_s=min_upload_rate_bytes_per_s, grace_s=upload_grace_s)
        self._server.agent = self
        self.address = f"{host}:{self._server.server_address[1]}"
        self.node = check_name(node or self.address.replace(":", "_"), "--node")
        self.buddy = parse_address(buddy, "--buddy") if buddy else None
        roots = default_copy_roots() if allow_copy_from is None else allow_copy_from  # []: copy nothing
        self.copy_roots = [os.path.realpath(p) for p in roots]
        self.sync_timeout_s, self.reserve_bytes = sync_timeout_s, reserve_bytes
        self._reserved = 0  # bytes promised to uploads and copies under way (their room was checked)
        self._rlock = threading.Lock()
        self.started_unix_s = time.time()
        self.copied_bytes = 0  # handed off by copying a staging slot (no bytes through HTTP)
        self.received_bytes = 0  # received in request bodies (from this node's ranks or other agents)
        self.stall_s = 1.0  # a held handoff's local copy waits this long at most for a push that stalls
        self._handoffs: dict[tuple[str, int, str], Handoff] = {}  # held handoffs, kept a while after they end
        self._hlock = threading.Lock()
        self.guard = Guard(key)  # no key: open
        self.replicator = Replicator(self.store, self.node, self.buddy, resync_s=resync_s,
                                     handoffs=self.step_handoffs,
                                     token=agent_token(key) if key is not None else None)
        self._thread: threading.Thread | None = None
        log.info("agent %s on %s: memory dir %s (%d steps found), buddy %s, %s", self.node, self.address,
                 self.store.root, found, self.buddy or "none",
                 "open (no key)" if key is None else "tokens required")

    def start(self) -> Agent:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="tidal-agent",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.1)

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
        self._server.server_close()
        self.replicator.close()

    # -- the API -----------------------------------------------------------------------------------
    def status(self, steps: bool = True) -> dict:
        """``GET /status``; ``steps`` False: without the steps held (a caller without the agent token)."""
        rows = []
        for r in self.store.summary():
            origin = r.pop("origin")
            if origin is None:
                files = self.store.step_files(None, r["job"], r["step"])
                r.update({"from": "own", "node": self.node,
                          "replicated": self.replicator.replicated(r["job"], r["step"], files)})
            else:
                r.update({"from": "replica", "node": origin})
            rows.append(r)
        st = os.statvfs(self.store.root)
        return {
            "format": FORMAT, "version": 1, "node": self.node, "address": self.address, "pid": os.getpid(),
            "mem_dir": str(self.store.root), "started_unix_s": self.started_unix_s, "now_unix_s": time.time(),
            "buddy": self.replicator.status(), "copied_bytes": self.copied_bytes,
            "received_bytes": self.received_bytes, "held_bytes": sum(r["bytes"] for r in rows),
            "free_bytes": st.f_bavail * st.f_frsize, "auth": not self.guard.open,
            **({"steps": rows} if steps else {}),
        }

    def route(self, h: Handler, method: str, parts: list[str], query: dict[str, str]) -> None:
        if parts == ["status"] and method == "GET":
            return h.send_json(200, self.status(steps=self.guard.is_agent(h.headers.get("Authorization"))))
        if len(parts) < 3 or parts[0] != "v1" or parts[1] not in ("jobs", "replicas"):
            raise HTTPError(404, f"no such endpoint: {method} {h.path}")
        if parts[1] == "replicas":
            self._authorize(h, None)
            return self._replica(h, method, parts[2:], query)
        job, rest = check_name(parts[2], "job"), parts[3:]
        self._authorize(h, job)
        if not rest and method == "GET":
            steps = {str(s): i for s, i in self.store.job_index(job).items()}
            return h.send_json(200, {"job": job, "steps": steps})
        step, name = self._target(h, method, rest)
        if method == "DELETE":
            with self._hlock:
                self._cancel(job, step, name)
                removed = self.store.remove(job, step, name)
            self.replicator.forget(job, step, name)
            return h.send_json(200, {"removed": removed})
        if name is None:
            if method == "GET":
                info = self.store.step_info(job, step)
                if info is None:
                    raise HTTPError(404, f"{job}/{step_dirname(step)}: not held here")
                return h.send_json(200, info)
        elif method in ("GET", "HEAD"):
            path = self.store.locate(job, step, name)
            if path is None:
                raise HTTPError(404, f"{job}/{step_dirname(step)}/{name}: not held here")
            return h.send_file(path, method == "HEAD")
        elif method == "PUT":
            return self._put(h, job, step, name, sync=query.get("sync") == "1")
        elif method == "POST" and "copy_from" in query:
            return self._copy_in(h, job, step, name, query)
        elif method == "POST" and query.get("wait") == "copy":
            return self._wait_copy(h, job, step, name)
        raise HTTPError(405, f"{method} not allowed on {h.path}")

    @staticmethod
    def _target(h: Handler, method: str, rest: list[str]) -> tuple[int, str | None]:
        """``<step>[/<name>]`` of a request path; 404 when it is not that."""
        step = parse_step(rest[0]) if rest else None
        if step is None or len(rest) > 2:
            raise HTTPError(404, f"no such endpoint: {method} {h.path}")
        return step, check_name(rest[1], "object") if len(rest) == 2 else None

    def _authorize(self, h: Handler, job: str | None) -> None:
        """403 unless the request's token may touch ``job``'s steps (None: the agents' endpoints)."""
        why = self.guard.refusal(h.headers.get("Authorization"), job)
        if why is not None:
            raise HTTPError(403, why)

    def _reserve(self, n: int) -> None:
        """Promise ``n`` bytes of the memory directory to one upload or copy (507 when the free space, less
        what is promised to those under way and ``reserve_bytes``, is short); :meth:`_release` after."""
        with self._rlock:
            st = os.statvfs(self.store.root)
            free = st.f_bavail * st.f_frsize - self._reserved
            if free < n + self.reserve_bytes:
                raise HTTPError(507, f"memory directory {self.store.root} has {free} bytes free (less "
                                     f"{self._reserved} promised to uploads under way); {n} needed")
            self._reserved += n

    def _release(self, n: int) -> None:
        with self._rlock:
            self._reserved -= n

    def _put(self, h: Handler, job: str, step: int, name: str, sync: bool,
             origin: str | None = None) -> None:
        """Receive a file into the store (not ``write_atomic``: the bytes stream to the store's temporary
        name and go to the replicator before they are published)."""
        size = h.content_length()
        self._reserve(size)
        tmp, final = self.store.temp_path(origin, job, step, name)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                h.body_to(fd)
            finally:
                os.close(fd)
            self.received_bytes += size
            if origin is None and sync:
                if name == MANIFEST:
                    self._check_commit(job, step, tmp)
                self.replicator.sync(job, step, name, tmp, self.sync_timeout_s)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            self._release(size)
        if origin is None and not sync:
            self.replicator.push_later(job, step, name, os.open(final, os.O_RDONLY), os.stat(final).st_size)
        h.send_json(200, {"bytes": os.stat(final).st_size})

    def _check_commit(self, job: str, step: int, manifest: Path) -> None:
        """Refuse a manifest naming a data file that a rank handed to this agent but is not here whole."""
        try:
            doc = json.loads(manifest.read_bytes())
            files, save_id = doc["files"], doc["save_id"]
        except (ValueError, KeyError, TypeError) as e:
            raise HTTPError(400, f"manifest of step {step} is not valid JSON with 'files' and 'save_id': "
                                 f"{e}") from None
        held = self.store.step_files(None, job, step)
        handoffs = self.step_handoffs(job, step)
        for f in files:
            name, size = f["name"], f.get("size_bytes")
            if sidecar_name(int(f["rank"]), save_id) not in held or held.get(name) == size:
                continue
            ho = handoffs.get(name)
            if ho is not None and ho.size == size and ho.copied is None:
                if ho.pushed == "":
                    continue  # whole at the buddy; the local copy from the (still held) slot follows
                # No buddy, or the push failed: the commit needs the local copy.
                copied = ho.wait_copied(self.sync_timeout_s)
                if copied and self.store.step_files(None, job, step).get(name) == size:
                    continue
                if ho.copied is None:
                    raise HTTPError(503, f"step {step}: data file {name} of rank {f['rank']} is still being "
                                         f"copied in and not at the buddy ({ho.pushed or 'pushing'}); try "
                                         "again")
            why = f"its copy from the staging slot failed: {ho.copied}" if ho is not None and ho.copied else (
                f"{held.get(name, 'missing')} bytes here")
            raise HTTPError(409, f"step {step}: data file {name} of rank {f['rank']} is {why}, manifest says "
                                 f"{size}")

    def _copy_in(self, h: Handler, job: str, step: int, name: str, query: dict[str, str]) -> None:
        """``copy_from``: take a rank's data file from its staging slot. ``hold=1``: answer 202 at once,
        push, then copy (``_copy_held``). Without it: copy, then answer (the push streams behind)."""
        src, length = query["copy_from"], int(query.get("length", "-1"))
        real = os.path.realpath(src)
        if not any(real == r or real.startswith(r + os.sep) for r in self.copy_roots):
            raise HTTPError(403, f"copy_from {src!r} is outside the allowed roots {self.copy_roots}")
        try:  # FileNotFoundError -> 404: the client sends the bytes instead
            sfd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:
            raise HTTPError(403, f"copy_from {src!r}: this agent may not read it") from None
        try:
            st, caller = os.fstat(sfd), peer_uid(h.connection)
            if not stat.S_ISREG(st.st_mode) or caller is None or caller not in (0, st.st_uid):
                who = "not on this node" if caller is None else f"uid {caller}"
                raise HTTPError(403, f"copy_from {src!r}: not a file of the caller (a file of uid "
                                     f"{st.st_uid}; the caller is {who})")
            if length < 0 or st.st_size < length:
                raise HTTPError(400, f"copy_from {src!r}: length {length} outside the file")
            self._reserve(length)
        except BaseException:
            os.close(sfd)
            raise
        try:
            tmp, final = self.store.temp_path(None, job, step, name)
            dfd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except BaseException:
            os.close(sfd)
            self._release(length)
            raise
        if query.get("hold") == "1":
            ho = Handoff(length)
            with self._hlock:
                now = time.monotonic()
                for k in [k for k, v in self._handoffs.items() if v.finished_at is not None
                          and now - v.finished_at > HANDOFF_KEEP_S]:
                    del self._handoffs[k]
                self._handoffs[(job, step, name)] = ho
            self.replicator.push_later(job, step, name, os.dup(sfd), length, handoff=ho)
            threading.Thread(target=self._copy_held, args=(ho, src, sfd, dfd, tmp, final), daemon=True,
                             name=f"tidal-agent-copy-{step}").start()
            return h.send_json(202, {"bytes": length, "held": True})
        growing = Growing(length)
        self.replicator.push_later(job, step, name, os.open(tmp, os.O_RDONLY), length, growing)
        try:
            self._copy_all(src, sfd, dfd, length, growing)
            os.replace(tmp, final)
            self.copied_bytes += length
        except BaseException as e:
            growing.fail(str(e))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(dfd)
            os.close(sfd)
            self._release(length)
        h.send_json(200, {"bytes": length})

    @staticmethod
    def _copy_all(src: str, sfd: int, dfd: int, length: int, growing: Growing | None = None) -> None:
        done = 0
        while done < length:
            n = _copy(sfd, dfd, done, min(CHUNK, length - done))
            if n <= 0:
                raise HTTPError(400, f"copy_from {src!r} ended after {done} of {length} bytes")
            done += n
            if growing is not None:
                growing.advance(n)

    def _copy_held(self, ho: Handoff, src: str, sfd: int, dfd: int, tmp: Path, final: Path) -> None:
        """The local copy of a held handoff, after its push (thread); published unless removed meanwhile."""
        try:
            ho.wait_push(self.stall_s)
            self._copy_all(src, sfd, dfd, ho.size)
            with self._hlock:
                if ho.cancelled:
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
                    self.copied_bytes += ho.size
            ho.copy_done(None)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if not ho.cancelled:
                log.warning("copying %s from %s failed: %s", final, src, e)
            ho.copy_done(f"{type(e).__name__}: {e}")
        finally:
            os.close(dfd)
            os.close(sfd)
            self._release(ho.size)

    def _wait_copy(self, h: Handler, job: str, step: int, name: str) -> None:
        """Answer once this agent no longer reads the staging slot of a held handoff."""
        with self._hlock:
            ho = self._handoffs.get((job, step, name))
        if ho is None:
            if self.store.locate(job, step, name) is None:
                raise HTTPError(404, f"{job}/{step_dirname(step)}/{name}: no handoff of it here")
            return h.send_json(200, {"copied": True, "error": None})
        if not ho.wait_copied(self.sync_timeout_s):
            raise HTTPError(503, f"{job}/{step_dirname(step)}/{name}: still copying after "
                                 f"{self.sync_timeout_s:.0f} s")
        return h.send_json(200, {"copied": ho.copied == "" and not ho.cancelled, "error": ho.copied or None})

    def step_handoffs(self, job: str, step: int) -> dict[str, Handoff]:
        """Held handoffs of one step (in flight or ended recently), by data file name."""
        with self._hlock:
            return {n: ho for (j, s, n), ho in self._handoffs.items()
                    if j == job and s == step and not ho.cancelled}

    def _cancel(self, job: str, step: int, name: str | None) -> None:
        """Under ``_hlock``: held handoffs of a removed step or object must not reappear when copied."""
        for key in [k for k in self._handoffs if k[0] == job and k[1] == step and name in (None, k[2])]:
            self._handoffs.pop(key).cancelled = True

    def _replica(self, h: Handler, method: str, parts: list[str], query: dict[str, str]) -> None:
        origin = check_name(parts[0], "origin")
        if len(parts) == 1 and method == "GET":
            jobs = {j: {str(s): f for s, f in st.items()} for j, st in self.store.tree_index(origin).items()}
            return h.send_json(200, {"origin": origin, "jobs": jobs})
        job = check_name(parts[1], "job") if len(parts) > 1 else ""
        step, name = self._target(h, method, parts[2:])
        if method == "PUT" and name is not None:
            return self._put(h, job, step, name, sync=False, origin=origin)
        if method == "DELETE":
            return h.send_json(200, {"removed": self.store.remove(job, step, name, origin=origin)})
        raise HTTPError(405, f"{method} not allowed on {h.path}")


def _restart_without_key_in_environ(key: bytes) -> None:
    """Run this program again, same pid, with the key on a pipe instead of in the environment:
    ``/proc/<pid>/environ`` shows the environment a program started with, whatever ``os.environ``
    says after (readable by this user, and by root)."""
    r, w = os.pipe()
    os.write(w, key.hex().encode())
    os.close(w)
    os.set_inheritable(r, True)
    argv = [sys.executable, "-m", "tidal.ckpt.agent", *sys.argv[1:], "--key-fd", str(r)]
    os.execve(sys.executable, argv, dict(os.environ))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tidal ckpt agent", description="The node checkpoint agent (peer tier).")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve on (port 0: any free port)")
    p.add_argument("--mem-dir", required=True,
                   help="memory directory holding the steps (e.g. under /dev/shm)")
    p.add_argument("--buddy", help="HOST:PORT of the agent on another node that gets a copy of everything")
    p.add_argument("--node",
                   help="this node's name in the buddy's replica tree (default: the listen address)")
    p.add_argument("--allow-copy-from", action="append", help="directory staging slots may be copied from "
                   "(repeatable; default $TIDAL_SHM_DIR/tidal or /dev/shm/tidal)")
    p.add_argument("--no-copy-from", action="store_true", help="copy no file a client names (ranks send "
                   "the bytes): for an agent that can read files its clients may not, e.g. as root with jobs "
                   "under their own uids")
    p.add_argument("--key-file", help="file with the key that job tokens are checked with (64 hex digits, "
                   "mode 0600; what `tidal up --ckpt-agents` keeps in <state dir>/jobs/.ckpt-agent.key). "
                   f"Also ${ENV_CKPT_AGENT_KEY} in the agent's environment. Without either the agent is "
                   "open: anyone who reaches its port reads, writes and deletes every job's steps")
    p.add_argument("--resync-s", type=float, default=2.0, help="seconds between checks of the buddy's copy")
    p.add_argument("--max-connections", type=int, default=128, help="connections served at once (more are "
                   "answered 503 and closed)")
    p.add_argument("--min-upload-rate", type=float, default=float(1 << 20), metavar="BYTES_PER_S",
                   help="an upload slower than this on average after its first 10 s, or pausing longer than "
                   "10 s, is cut (408)")
    p.add_argument("--key-fd", type=int, help=argparse.SUPPRESS)  # the key, handed over by _restart_without
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.no_copy_from and a.allow_copy_from:
        p.error("--no-copy-from and --allow-copy-from exclude each other")
    env_key = os.environ.pop(ENV_CKPT_AGENT_KEY, None)  # read once; nothing this process starts inherits it
    if a.key_fd is not None:
        with os.fdopen(a.key_fd, "rb") as f:
            env_key = f.read(4096).decode("ascii", "replace")
    if a.key_file and env_key:
        p.error(f"--key-file and ${ENV_CKPT_AGENT_KEY} exclude each other")
    try:
        key = read_key(a.key_file) if a.key_file else (
            parse_key(env_key, f"${ENV_CKPT_AGENT_KEY}") if env_key else None)
    except ValueError as e:
        p.error(str(e))
    if key is not None and a.key_fd is None and not a.key_file and argv is None:
        _restart_without_key_in_environ(key)
    agent = Agent(a.listen, a.mem_dir, buddy=a.buddy, node=a.node,
                  allow_copy_from=[] if a.no_copy_from else a.allow_copy_from,
                  resync_s=a.resync_s, key=key, max_connections=a.max_connections,
                  min_upload_rate_bytes_per_s=a.min_upload_rate)

    def stop(signum, frame) -> None:
        threading.Thread(target=agent._server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        f"tidal ckpt agent {agent.node}: listening on http://{agent.address}, memory dir {agent.store.root}, "
        f"buddy {agent.buddy or 'none'}, {'tokens required' if key else 'open: no key, no authentication'}",
        file=sys.stderr, flush=True)
    agent.serve_forever()
    agent.close()


if __name__ == "__main__":
    main()

"""Control-plane load check: many submissions, then many log followers, against one real ``tidal up``.

    python lab/control_load.py [--submissions 1000] [--submitters 16] [--followers 100] [--json]

A program, not a test. It starts ``tidal up --gpus SLOTS --port 0`` as a subprocess on loopback
with a temporary state dir (stopped by pid at the end, also on error, together with every worker
process it launched), creates ``--tenants`` tenants, and runs two phases with asyncio:

1. **Submissions.** ``--submissions`` job specs (``[python, -c, "print('hi')"]``, 1 GPU, round-robin
   over the tenants) from ``--submitters`` concurrent clients, each sending its next spec as soon as
   the previous one was answered. The pool has ``--slots`` declared CPU slots (default 8), so the
   plane also admits and launches jobs while submissions arrive (about ``slots`` per reconcile
   step) and the rest queue, as on a real pool with a deep queue. Afterwards the admin cancels
   every job that has not ended (timed as well) and the check waits for the queue to drain.
2. **Log followers.** ``--talkers`` jobs of ``--ranks`` ranks each print ``--lines`` numbered lines
   (with a non-ASCII character, so chunk boundaries can split a UTF-8 sequence) every
   ``--line-interval-s``. Once they run, ``--followers`` clients follow their rank logs as
   ``tidal logs -f`` does (poll ``GET /v1/jobs/{id}/logs`` from the returned byte offset; sleep
   ``--poll-s`` when caught up; stop when the job has ended and the whole log is read), while
   ``--background`` clients loop over the other calls of ``tidal jobs`` / ``tidal status`` /
   ``tidal pool`` (list the tenant's jobs, get a job, its events, the pool), pausing
   ``--think-s`` between calls. Every follower's bytes are compared with the log file on disk.

Each simulated client has its own keep-alive connection and speaks HTTP/1.1 through a minimal
asyncio client (``Conn`` below, about 0.1 ms of CPU a call; httpx's async client spent about 8 ms
a call here, more than the server, on the same 2 cores). Latencies are measured in the client
(request written to response read), on the same machine as the server, so the client's CPU still
competes with the server's: on a small machine read them as upper bounds.
Prints a table; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode, urlsplit

TALKER = ("import os, sys, time\n"
          "r, n, dt, pad = os.environ['RANK'], int(sys.argv[1]), float(sys.argv[2]), 'x' * int(sys.argv[3])\n"
          "for i in range(n):\n"
          "    print(f'rank {r} line {i:06d} \\u2192 {pad}', flush=True)\n"
          "    time.sleep(dt)\n")
ACTIVE = ["pending", "admitted", "running", "resizing", "preempting", "cancelling", "backoff"]


# ----------------------------------------------------------------------------------------- stats
def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 100)) - 1))
    return s[k]


@dataclass
class Calls:
    """Latencies (seconds) and failures of one kind of call."""

    name: str
    lat: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self, wall_s: float) -> dict:
        ms = [x * 1000 for x in self.lat]
        return {"calls": len(self.lat), "errors": len(self.errors), "first_errors": self.errors[:3],
                "per_s": round(len(self.lat) / wall_s, 1) if wall_s > 0 else None,
                **{k: (round(v, 2) if v is not None else None) for k, v in
                   (("p50_ms", pct(ms, 50)), ("p95_ms", pct(ms, 95)), ("p99_ms", pct(ms, 99)),
                    ("max_ms", max(ms) if ms else None))}}


class Conn:
    """One client's keep-alive HTTP/1.1 connection (the server always sends Content-Length). A GET
    that finds the connection closed by the server's idle timeout is sent again on a new one."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, token: str, *, params: dict | None = None,
                      json_body: object = None) -> tuple[int, object]:
        if params:
            path += "?" + urlencode(params, doseq=True)
        body = json.dumps(json_body).encode() if json_body is not None else b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for attempt in (0, 1):
            fresh = self.writer is None
            if fresh:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(head + body)  # type: ignore[union-attr]
                await self.writer.drain()  # type: ignore[union-attr]
                status_line = await self.reader.readline()  # type: ignore[union-attr]
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
                headers = await self.reader.readuntil(b"\r\n\r\n")  # type: ignore[union-attr]
                length = 0
                for line in headers.split(b"\r\n"):
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                data = await self.reader.readexactly(length)  # type: ignore[union-attr]
                return int(status_line.split()[1]), json.loads(data) if data else None
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt or fresh or method != "GET":
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def timed(conn: Conn, calls: Calls, method: str, path: str, token: str, **kw) -> object | None:
    """One call, its latency recorded in ``calls``; the parsed JSON answer, or None after an error."""
    t0 = time.perf_counter()
    try:
        status, doc = await conn.request(method, path, token, **kw)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        calls.errors.append(f"{method} {path}: {type(e).__name__}: {e}")
        return None
    calls.lat.append(time.perf_counter() - t0)
    if status >= 400:
        calls.errors.append(f"{method} {path}: HTTP {status}: {str(doc)[:200]}")
        return None
    return doc


async def call(conn: Conn, method: str, path: str, token: str, **kw) -> object:
    """A set-up call that must succeed."""
    status, doc = await conn.request(method, path, token, **kw)
    if status >= 400:
        raise SystemExit(f"{method} {path}: HTTP {status}: {doc}")
    return doc


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------- server
class Server:
    """``tidal up`` as a subprocess on a free loopback port, in a temporary state dir."""

    def __init__(self, slots: int, keep: bool) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="tidal-load-"))
        self.state, self.slots, self.keep = self.tmp / "state", slots, keep
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        out = self.tmp / "up.log"
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tidal.cli import main; main()", "up", "--gpus", str(self.slots),
                 "--port", "0", "--state-dir", str(self.state)],
                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        url_file = self.state / "api.url"
        deadline = time.monotonic() + 60
        while not url_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise SystemExit(f"tidal up did not start:\n{out.read_text()}")
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        self.admin = (self.state / "admin.token").read_text().strip()
        return self

    def log_file(self, job: str, rank: int) -> Path:
        return self.state / "jobs" / job / "logs" / f"rank-{rank}.log"

    def __exit__(self, *exc) -> None:
        from tidal.exec import procs

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        for launch in self.state.glob("jobs/*/attempt-*/launch.json"):  # workers it started outlive it
            try:
                ranks = json.loads(launch.read_text())["ranks"]
            except (OSError, ValueError, KeyError):
                continue
            for r in ranks:
                if procs.alive(r["pid"], r.get("started")):
                    procs.kill_group(r["pid"])
        if not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            print(f"state kept in {self.tmp}", file=sys.stderr)


# ---------------------------------------------------------------------------------------- phases
async def submissions(
    srv: Server, tokens: list[str], n: int, concurrency: int
) -> tuple[Calls, float, list[str]]:
    calls, ids, nxt = Calls("submit"), [], iter(range(n))

    async def submitter() -> None:
        conn = Conn(srv.url)
        for i in nxt:
            spec = {"name": f"load-{i}", "gpus": 1, "workdir": str(srv.tmp),
                    "command": [sys.executable, "-c", "print('hi')"]}
            r = await timed(conn, calls, "POST", "/v1/jobs", tokens[i % len(tokens)], json_body=spec)
            if r is not None:
                ids.append(r["id"])  # type: ignore[index]
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(submitter() for _ in range(concurrency)))
    return calls, time.perf_counter() - t0, ids


async def drain(srv: Server, concurrency: int, timeout_s: float = 60) -> tuple[Calls, float, float, dict]:
    """Cancel every job that has not ended; wait until none is active. Returns the cancel calls, their
    wall time, the time until the queue was empty, and the final states."""
    calls, admin = Calls("cancel"), Conn(srv.url)
    todo = iter([j["id"] for j in await call(admin, "GET", "/v1/jobs", srv.admin, params={"state": ACTIVE})])  # type: ignore[attr-defined]
    t0 = time.perf_counter()

    async def canceller() -> None:
        conn = Conn(srv.url)
        for j in todo:
            await timed(conn, calls, "POST", f"/v1/jobs/{j}/cancel", srv.admin)
        conn.close()

    await asyncio.gather(*(canceller() for _ in range(concurrency)))
    cancel_wall = time.perf_counter() - t0
    calls.errors = [e for e in calls.errors if "HTTP 409" not in e]  # ended meanwhile: fine
    deadline = time.monotonic() + timeout_s
    while active := await call(admin, "GET", "/v1/jobs", srv.admin, params={"state": ACTIVE}):
        if time.monotonic() > deadline:
            stuck = [f"{j['id']} {j['state']}: {j['message']}" for j in active][:10]  # type: ignore[attr-defined]
            raise SystemExit(f"the queue did not drain within {timeout_s:g} s; e.g.\n  " + "\n  ".join(stuck))
        await asyncio.sleep(0.5)
    drained = time.perf_counter() - t0
    states: dict[str, int] = {}
    for j in await call(admin, "GET", "/v1/jobs", srv.admin):  # type: ignore[attr-defined]
        states[j["state"]] = states.get(j["state"], 0) + 1
    admin.close()
    return calls, cancel_wall, drained, states


async def follow_phase(srv: Server, tokens: list[str], a: argparse.Namespace) -> dict:
    admin = Conn(srv.url)
    talkers = []  # (job id, owner's token)
    for t in range(a.talkers):
        tok = tokens[t % len(tokens)]
        spec = {"name": f"talker-{t}", "gpus": a.ranks, "workdir": str(srv.tmp), "max_restarts": 0,
                "command": [sys.executable, "-c", TALKER, str(a.lines), str(a.line_interval_s), str(a.pad)]}
        talkers.append(((await call(admin, "POST", "/v1/jobs", tok, json_body=spec))["id"], tok))  # type: ignore[index]
    deadline = time.monotonic() + 120
    while True:  # followers start on running jobs
        states = [(await call(admin, "GET", f"/v1/jobs/{j}", srv.admin))["state"] for j, _ in talkers]  # type: ignore[index]
        if all(s == "running" for s in states):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"talker jobs did not all start within 120 s: {states}")
        await asyncio.sleep(0.1)

    logs, other = Calls("logs"), Calls("other")
    got: dict[int, bytearray] = {}
    stop = asyncio.Event()

    async def follower(k: int) -> None:
        job, tok = talkers[k % len(talkers)]
        rank = (k // len(talkers)) % a.ranks
        buf, offset, conn = bytearray(), 0, Conn(srv.url)
        got[k] = buf
        while True:
            c = await timed(
                conn, logs, "GET", f"/v1/jobs/{job}/logs", tok, params={"rank": rank, "offset": offset}
            )
            if not isinstance(c, dict):
                await asyncio.sleep(a.poll_s)
                continue
            buf += c["data"].encode()
            offset = c["offset"]
            if c["done"] and offset >= c["size"]:
                conn.close()
                return
            if offset >= c["size"]:
                await asyncio.sleep(a.poll_s)

    async def background(k: int) -> None:
        tok = tokens[k % len(tokens)]
        job = next((j for j, t in talkers if t == tok), None)
        i, conn = 0, Conn(srv.url)
        while not stop.is_set():
            what = i % 4
            if what == 0:
                await timed(conn, other, "GET", "/v1/jobs", tok)
            elif what == 1 and job:
                await timed(conn, other, "GET", f"/v1/jobs/{job}", tok)
            elif what == 2 and job:
                await timed(conn, other, "GET", "/v1/events", tok, params={"job": job})
            else:
                await timed(conn, other, "GET", "/v1/pool", tok)
            i += 1
            await asyncio.sleep(a.think_s)
        conn.close()

    t0 = time.perf_counter()
    bg = [asyncio.create_task(background(k)) for k in range(a.background)]
    await asyncio.gather(*(follower(k) for k in range(a.followers)))
    wall = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*bg)
    end_states = [(await call(admin, "GET", f"/v1/jobs/{j}", srv.admin))["state"] for j, _ in talkers]  # type: ignore[index]
    admin.close()

    complete, lines_ok = 0, 0
    for k, buf in got.items():
        job = talkers[k % len(talkers)][0]
        rank = (k // len(talkers)) % a.ranks
        on_disk = srv.log_file(job, rank).read_bytes()
        complete += bytes(buf) == on_disk
        want = [f"rank {rank} line {i:06d} \u2192 {'x' * a.pad}" for i in range(a.lines)]
        lines_ok += [ln for ln in buf.decode().splitlines() if ln.startswith("rank ")] == want
    total_bytes = sum(len(b) for b in got.values())
    return {"wall_s": round(wall, 2), "logs": logs.summary(wall), "other": other.summary(wall),
            "followers": a.followers, "followers_complete": complete, "followers_all_lines": lines_ok,
            "bytes_followed": total_bytes, "talker_states": end_states,
            "log_streams": a.talkers * a.ranks}


# ------------------------------------------------------------------------------------------ main
def machine() -> str:
    cpu = mem = ""
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    with contextlib.suppress(OSError, StopIteration, ValueError):
        kb = int(
            next(
                ln.split()[1]
                for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")
            )
        )
        mem = f", {kb / 2**20:.0f} GiB"
    return f"{os.cpu_count()} CPUs {cpu}{mem}, Python {platform.python_version()}"


def own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def run(a: argparse.Namespace) -> dict:
    load0 = os.getloadavg()
    with Server(a.slots, a.keep) as srv:
        admin = Conn(srv.url)
        tokens = [(await call(admin, "POST", "/v1/tenants", srv.admin,
                              json_body={"name": f"team-{t}", "quota_gpus": 0, "weight": 1.0}))["token"]  # type: ignore[index]
                  for t in range(a.tenants)]
        admin.close()
        pid = srv.proc.pid  # type: ignore[union-attr]
        c0, o0 = cpu_s(pid), own_cpu_s()
        sub, sub_wall, ids = await submissions(srv, tokens, a.submissions, a.submitters)
        c1, o1 = cpu_s(pid), own_cpu_s()
        cancels, cancel_wall, drained_s, states = await drain(srv, a.submitters)
        c2, o2 = cpu_s(pid), own_cpu_s()
        fol = await follow_phase(srv, tokens, a)
        c3, o3 = cpu_s(pid), own_cpu_s()
    return {
        "machine": machine(), "load_avg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "args": {k: v for k, v in vars(a).items() if k not in ("json", "keep")},
        "submit": {"wall_s": round(sub_wall, 2), "jobs": len(ids), **sub.summary(sub_wall),
                   "server_cpu_s": round(c1 - c0, 2), "client_cpu_s": round(o1 - o0, 2)},
        "drain": {"cancel": cancels.summary(cancel_wall), "cancel_wall_s": round(cancel_wall, 2),
                  "until_empty_s": round(drained_s, 2), "states": states, "server_cpu_s": round(c2 - c1, 2),
                  "client_cpu_s": round(o2 - o1, 2)},
        "follow": {**fol, "server_cpu_s": round(c3 - c2, 2), "client_cpu_s": round(o3 - o2, 2)},
    }


def _row(name: str, s: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:g}"
    return (f"{name:<34} {s['calls']:>7} {f(s['per_s']):>8} {f(s['p50_ms']):>8} {f(s['p95_ms']):>8} "
            f"{f(s['p99_ms']):>8} {f(s['max_ms']):>8} {s['errors']:>6}")


def report(r: dict) -> None:
    a, s, d, f = r["args"], r["submit"], r["drain"], r["follow"]
    load = r.get("load_avg_1m")
    print(
        f"machine: {r['machine']}"
        + (f"; 1-min load average {load[0]} at start, {load[1]} at end" if load else "")
    )
    print(f"tidal up --gpus {a['slots']} (CPU slots); {a['tenants']} tenants")
    print(
        f"{'calls':<34} {'n':>7} {'per s':>8} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'p99 ms':>8} {'max ms':>8} {'errors':>6}"
    )
    print(_row(f"submit ({a['submitters']} concurrent)", s))
    print(_row(f"cancel, drain ({a['submitters']} concurrent)", d["cancel"]))
    print(_row(f"logs, {f['followers']} followers", f["logs"]))
    print(_row(f"jobs/status/pool, {a['background']} clients", f["other"]))
    print(f"submit: {s['jobs']} jobs in {s['wall_s']} s, server CPU {s['server_cpu_s']} s "
          f"(client {s.get('client_cpu_s', '-')} s); queue drained "
          f"{d['until_empty_s']} s after the cancels began ({d['states']})")
    print(
        f"follow: {f['wall_s']} s over {f['log_streams']} rank logs, {f['bytes_followed']} bytes, server CPU "
        f"{f['server_cpu_s']} s (client {f.get('client_cpu_s', '-')} s); "
        f"followers with every byte: {f['followers_complete']}/{f['followers']}, "
        f"every line in order: {f['followers_all_lines']}/{f['followers']}; talkers {f['talker_states']}"
    )
    for name, x in (("submit", s), ("cancel", d["cancel"]), ("logs", f["logs"]), ("other", f["other"])):
        for e in x["first_errors"]:
            print(f"  {name} error: {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--submissions", type=int, default=1000)
    p.add_argument("--submitters", type=int, default=16, help="concurrent submitting clients")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--slots", type=int, default=8, help="tidal up --gpus N (declared CPU slots)")
    p.add_argument("--followers", type=int, default=100)
    p.add_argument("--talkers", type=int, default=4, help="jobs whose ranks write the followed logs")
    p.add_argument("--ranks", type=int, default=2, help="ranks per talker job")
    p.add_argument("--lines", type=int, default=400, help="lines per rank")
    p.add_argument("--line-interval-s", type=float, default=0.05)
    p.add_argument("--pad", type=int, default=100, help="filler characters per line")
    p.add_argument(
        "--poll-s", type=float, default=0.5, help="follower's sleep when caught up (tidal logs -f: 0.5)"
    )
    p.add_argument("--background", type=int, default=4, help="clients calling jobs/status/pool meanwhile")
    p.add_argument("--think-s", type=float, default=0.1, help="pause between a background client's calls")
    p.add_argument("--keep", action="store_true", help="keep the temporary state dir")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.talkers * a.ranks > a.slots:
        p.error(f"--talkers x --ranks ({a.talkers * a.ranks}) must fit in --slots ({a.slots})")
    r = asyncio.run(run(a))
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        report(r)


if __name__ == "__main__":
    main()

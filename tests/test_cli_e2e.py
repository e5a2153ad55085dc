"""The command line as a user runs it: the real ``tidal`` command in a subprocess (piped, and in a pty
for the terminal case) against a real ``tidal up`` on a loopback port, with real worker processes.

Covers what a user meets in the first hour: bracketed text is printed as written, never
read as markup; ``submit --wait`` streams the job's output and a failure shows the failing rank's
last log lines; ``-o json|yaml|wide``, ``--version`` and shell completion; why a job waits, from the
scheduler; ``logs -f`` (all ranks interleaved) and ``submit --wait`` through a restart of ``tidal up``;
the Prometheus label names. Every process started here is stopped at the end, also on failure, by pid.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from plane_proc import Plane, wait_until

pytestmark = pytest.mark.slow
RUN = "import sys; from tidal.cli import main; sys.argv[0] = 'tidal'; main()"
CONFIG = """
restart_backoff_s: 0.2
startup_timeout_s: 600
loop_interval_s: 0.2
scheduler: {min_runtime_before_preempt_s: 0, preempt_grace_s: 30}
"""


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(tmp_path_factory.mktemp("cliplane"), CONFIG)
    try:
        p.start()
        yield p
    finally:
        p.stop()


def env_for(plane: Plane, **extra: str) -> dict[str, str]:
    """The plane's state dir only (no TIDAL_API_URL): the client reads api.url and the admin token there,
    again after a restart, as on the machine running ``tidal up``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_API_URL", "TIDAL_TOKEN", "COLUMNS")}
    return {**env, "TIDAL_STATE_DIR": str(plane.state), "OMP_NUM_THREADS": "1", **extra}


def tidal(plane: Plane, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RUN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_for(plane, **env),
    )


def in_pty(plane: Plane, *args: str, timeout: float = 120) -> tuple[int, str]:
    """Run ``tidal ARGS`` with a pseudo-terminal as stdout and stderr; (exit code, what it printed)."""
    main, sub = pty.openpty()
    p = subprocess.Popen(
        [sys.executable, "-c", RUN, *args],
        stdout=sub,
        stderr=sub,
        stdin=subprocess.DEVNULL,
        env=env_for(plane, TERM="xterm", COLUMNS="200"),
        close_fds=True,
    )
    os.close(sub)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([main], [], [], 0.2)
            if r:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                out += data
            elif p.poll() is not None:
                break
        return p.wait(timeout=30), out.decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(main)


def job_file(tmp: Path, name: str, body: str) -> str:
    f = tmp / f"{name}.yaml"
    f.write_text(f"name: {name}\n" + body)
    return str(f)


def submitted(out: str) -> str:
    return out.split("submitted ")[1].split()[0]


def py(code: str) -> str:
    return f"command: [{sys.executable}, -c, {json.dumps(code)}]\n"


# ------------------------------------------------------------------------------------ 1. no markup
def test_bracketed_text_is_printed_as_written(plane, tmp_path):
    r = tidal(plane, "submit", job_file(tmp_path, "str", "gpus: 1\ncommand: python train.py\n"))
    assert r.returncode == 1
    assert "e.g. [python, train.py, --steps, '100']" in r.stderr, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncommand: [python, [unclosed\n")
    r = tidal(plane, "submit", str(bad))
    assert r.returncode == 1 and "not valid YAML" in r.stderr and "[python, [unclosed" in r.stderr, r.stderr


# ----------------------------------------------------- 2. submit --wait streams; a failure says why
def test_submit_wait_streams_output_and_a_failure_shows_the_failing_rank_log(plane, tmp_path):
    ok = job_file(tmp_path, "hello", "gpus: 1\n" + py("print('hello [bold]from[/bold] rank 0', flush=True)"))
    r = tidal(plane, "submit", ok, "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    said = lines.index("hello [bold]from[/bold] rank 0")
    done = next(i for i, ln in enumerate(lines) if ": succeeded — its only rank exited 0" in ln)
    assert said < done, r.stdout
    assert "submitted hello-" in r.stdout and "(spot, 1 GPU)" in r.stdout
    assert "restarts 0, preemptions 0, shrinks 0, grows 0, lost work 0.0 s (0 steps)" in r.stdout
    typo = job_file(tmp_path, "typo", f"gpus: 1\nmax_restarts: 0\ncommand: [{sys.executable}, trian.py]\n")
    r = tidal(plane, "submit", typo, "--wait")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed: rank 0 exited with code 2" in r.stdout, r.stdout
    tail = r.stdout.split("the last lines of rank 0's log")[1]
    assert "can't open file" in tail and "trian.py': [Errno 2]" in tail, r.stdout
    job = submitted(r.stdout)
    r = tidal(plane, "status", job)
    assert r.returncode == 0 and "the last lines of rank 0's log" in r.stdout and "[Errno 2]" in r.stdout, (
        r.stdout
    )


def test_submit_wait_in_a_terminal(plane, tmp_path):
    code, out = in_pty(
        plane,
        "submit",
        job_file(
            tmp_path,
            "tty",
            "gpus: 1\n"
            + py("import time\nfor i in range(3): print(f'tick {i}', flush=True); time.sleep(0.3)"),
        ),
        "--wait",
    )
    assert code == 0, out
    for i in range(3):
        assert f"tick {i}" in out
    assert "succeeded" in out and "\x1b[" in out  # a terminal gets colours (and the live progress line)


# ------------------------------------------------- 10. overrides at submit time, a run: shell script
def test_overrides_and_a_run_script(plane, tmp_path):
    f = job_file(
        tmp_path,
        "script",
        'gpus: 1\nrun: |\n  echo "$GREETING from rank $RANK of $WORLD_SIZE" | tr a-z A-Z\n',
    )
    r = tidal(plane, "submit", f, "--gpus", "2", "--env", "GREETING=hi", "--name", "shouty", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted shouty-" in r.stdout and "(spot, 2 GPUs)" in r.stdout
    assert "HI FROM RANK 0 OF 2" in r.stdout.splitlines(), r.stdout
    job = submitted(r.stdout)
    assert "HI FROM RANK 1 OF 2" in tidal(plane, "logs", job, "--rank", "1").stdout
    assert plane.admin.job(job)["spec"]["command"][:2] == ["bash", "-c"]
    r = tidal(plane, "submit", f, "--gpus", "two")
    assert r.returncode == 1 and "--gpus: expected N or MIN-MAX" in r.stderr


# --------------------------------------------------------------------------- 7. misleading messages
def test_a_busy_port_and_a_client_without_its_server_say_so(plane, tmp_path):
    port = plane.url.rsplit(":", 1)[1]
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            RUN,
            "up",
            "--gpus",
            "1",
            "--port",
            port,
            "--state-dir",
            str(tmp_path / "second"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_for(plane),
    )
    assert (
        r.returncode == 1 and f"port {port} on 127.0.0.1 is already in use (another tidal up?" in r.stderr
    ), r.stderr
    assert "Errno" not in r.stderr and not (tmp_path / "second" / "tidal.db").exists()
    lonely = str(tmp_path / "lonely")
    r = tidal(plane, "jobs", TIDAL_STATE_DIR=lonely)
    assert (
        r.returncode == 1
        and f"the default API address http://127.0.0.1:8470 (no api.url in {lonely}" in r.stderr
    )
    r = tidal(plane, "jobs", TIDAL_STATE_DIR=lonely, TIDAL_API_URL=plane.url)
    assert r.returncode == 1 and "missing or unknown bearer token" in r.stderr, r.stderr
    assert (
        f"API address from $TIDAL_API_URL; no token (no $TIDAL_TOKEN, no admin.token in {lonely})" in r.stderr
    )


# ----------------------------------------------------------- 3. -o json|yaml|wide, --version, completion
def test_machine_readable_output_version_and_completion(plane, tmp_path):
    r = tidal(plane, "submit", job_file(tmp_path, "out", "gpus: 1\n" + py("print('x')")), "--wait")
    job = submitted(r.stdout)
    rows = json.loads(tidal(plane, "jobs", "-o", "json").stdout)
    assert job in {j["id"] for j in rows}
    assert json.loads(tidal(plane, "jobs", "--json").stdout) == rows
    doc = json.loads(tidal(plane, "status", job, "--json").stdout)
    assert doc["job"]["state"] == "succeeded" and doc["events"] and doc["checkpoints"]["job"] == job
    evs = yaml.safe_load(tidal(plane, "events", job, "-o", "yaml").stdout)
    assert "succeeded" in [e["to"] for e in evs]
    assert json.loads(tidal(plane, "pool", "-o", "json").stdout)["gpus"] == 2
    assert "admin" in {t["name"] for t in json.loads(tidal(plane, "tenants", "list", "--json").stdout)}
    wide = tidal(plane, "jobs", "-o", "wide").stdout
    assert "PREEMPTIONS" in wide and "PLACEMENT" in wide and "PREEMPTIONS" not in tidal(plane, "jobs").stdout
    r = tidal(plane, "jobs", "-o", "xml")
    assert r.returncode == 2 and "xml" in r.stderr
    r = tidal(plane, "--version")
    assert r.returncode == 0 and r.stdout.startswith("tidal ")
    r = subprocess.run(
        [sys.executable, "-c", RUN],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_for(plane, _TIDAL_COMPLETE="complete_bash", COMP_WORDS="tidal jo", COMP_CWORD="1"),
    )
    assert "jobs" in r.stdout.split(), r.stdout + r.stderr
    # the script `tidal --show-completion` prints (it picks the shell from its parent processes, which
    # differ between a terminal, make and pytest: ask for bash's by name, as the script itself does)
    r = tidal(plane, _TIDAL_COMPLETE="source_bash")
    assert r.returncode == 0 and "_TIDAL_COMPLETE=complete_bash" in r.stdout, r.stderr


# ------------------------------------------------------------------- 4. why a job waits (the scheduler's)
def test_a_waiting_job_says_why(plane, tmp_path):
    sleeper = py("import time; time.sleep(600)")
    big = submitted(tidal(plane, "submit", job_file(tmp_path, "big", "gpus: 2\n" + sleeper)).stdout)
    small = submitted(tidal(plane, "submit", job_file(tmp_path, "small", "gpus: 1\n" + sleeper)).stdout)
    try:
        w = wait_until("a waiting reason", lambda: plane.admin.job(small).get("waiting"))
        assert w["reason"].startswith("waiting: needs 1 GPU, 0 free"), w
        table = tidal(plane, "jobs").stdout
        row = next(ln for ln in table.splitlines() if ln.strip().startswith(small))
        assert "waiting: needs 1 GPU, 0 free" in row, table
        assert (
            "\n  waiting: needs 1 GPU, 0 free; nothing may be preempted"
            in tidal(plane, "status", small).stdout
        )
        assert plane.admin.job(big)["waiting"] is None
    finally:  # the waiting one first: cancelled while pending, it never starts (nor takes its grace to stop)
        for j in (small, big):
            tidal(plane, "cancel", j)
        wait_until(
            "both cancelled", lambda: all(plane.admin.job(j)["state"] == "cancelled" for j in (big, small))
        )


# -------------------------------------------------------------------------- 11. Prometheus label names
def test_metrics_use_job_id_not_prometheus_job_label(plane, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    job = submitted(
        tidal(
            plane, "submit", job_file(tmp_path, "m", "gpus: 1\n" + py("import time; time.sleep(600)"))
        ).stdout
    )
    try:
        wait_until("running", lambda: plane.admin.job(job)["state"] == "running")
        fams = list(text_string_to_metric_families(plane.admin.metrics()))
        labels = {k for f in fams for s in f.samples for k in s.labels}
        assert (
            "job_id" in labels
            and not labels & {"job", "instance"}
            and not any(k.startswith("__") for k in labels)
        )
        gpus = next(f for f in fams if f.name == "tidal_job_gpus")
        assert any(s.labels["job_id"] == job and s.value == 1 for s in gpus.samples)
        assert all(f.name.startswith("tidal_") for f in fams)
    finally:
        plane.admin.cancel(job)
        wait_until("cancelled", lambda: plane.admin.job(job)["state"] == "cancelled")


# --------------------------------------------- 5. logs -f through a restart of tidal up, all ranks
def test_logs_follow_all_ranks_through_a_restart_of_the_plane(plane, tmp_path):
    code = (
        "import os, time\nr = os.environ['RANK']\nfor i in range(30):\n"
        "    print(f'r{r} line {i}', flush=True); time.sleep(0.25)"
    )
    w = subprocess.Popen(
        [sys.executable, "-c", RUN, "submit", job_file(tmp_path, "chatty", "gpus: 2\n" + py(code)), "--wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_for(plane),
    )
    f = None
    try:
        job = submitted(
            w.stdout.readline()
        )  # submit --wait and logs -f follow the same job through the restart
        f = subprocess.Popen(
            [sys.executable, "-c", RUN, "logs", job, "-f", "--rank", "all"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_for(plane),
        )
        wait_until("the job running", lambda: plane.admin.job(job)["state"] == "running")
        time.sleep(1.0)
        plane.crash()
        time.sleep(1.0)
        plane.start()
        out, err = f.communicate(timeout=120)
        wout, werr = w.communicate(timeout=120)
    finally:
        for proc in (w, f):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert w.returncode == 0, wout + werr
    assert "lost the Tidal API" in wout and "the Tidal API is back" in wout and "succeeded" in wout, wout
    streamed = [ln for ln in wout.splitlines() if ln.startswith("r0 line ")]
    assert streamed == [f"r0 line {i}" for i in range(30)], (
        wout
    )  # rank 0's output, whole, through the restart
    assert f.returncode == 0, err
    assert "lost the Tidal API" in err and "the Tidal API is back" in err, err
    lines = out.splitlines()
    for r in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[rank {r}] ")]
        assert mine[0].startswith(f"[rank {r}] === tidal: {job} attempt 1, rank {r} of 2"), mine[:2]
        assert mine[1:] == [f"[rank {r}] r{r} line {i}" for i in range(30)]
    assert plane.admin.job(job)["state"] == "succeeded"
    assert any(e["kind"] == "adopted" for e in plane.admin.events(job))

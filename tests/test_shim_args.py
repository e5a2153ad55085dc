"""The rank's shim (``tidal.exec.shim``) refuses a wrong command line with its usage and exit code 2,
running nothing; a right one waits for ``go`` and, on EOF instead, runs nothing either."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.exec import shim


def _shim(tmp_path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", shim.__file__, str(tmp_path / "exit.json"),
                           str(tmp_path / "pid.json"), *args], input=stdin, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args", [
    ["--", ],  # no command
    ["touch", "x"],  # no --
    ["--rlimit", "stack=1", "--", "touch", "x"],  # a limit it does not know
    ["--cgroup", "/nowhere", "--", "touch", "x"],  # a cgroup without --memory
    ["--cgroup", "/nowhere", "--memory", "1", "--", "touch", "x"],  # ... without --cgroup-version
    ["--cgroup", "/nowhere", "--memory", "1", "--cgroup-version", "3", "--", "touch", "x"],
    ["--uid", "me", "--", "touch", "x"],
])
def test_a_wrong_command_line_is_refused_and_runs_nothing(tmp_path, args):
    out = _shim(tmp_path, *[a.replace("x", str(tmp_path / "ran")) for a in args], stdin="go\n")
    assert out.returncode == 2 and "usage: shim.py EXIT_FILE PID_FILE" in out.stderr, out
    assert not (tmp_path / "ran").exists() and not (tmp_path / "exit.json").exists()


def test_it_runs_the_command_after_go_only(tmp_path):
    ran = tmp_path / "ran"
    args = ["--rlimit", "core=0", "--rlimit", "nofile=256", "--", "sh", "-c", f"ulimit -n > {ran}", "--", "x"]
    assert _shim(tmp_path, *args).returncode == 0 and not ran.exists()  # EOF: the plane went away
    assert _shim(tmp_path, *args, stdin="go\n").returncode == 0
    assert ran.read_text().strip() == "256" and '"code": 0' in (tmp_path / "exit.json").read_text()

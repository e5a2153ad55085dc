"""The README's command-line session, run as written: the block between ``<!-- readme-session: begin -->``
and ``<!-- readme-session: end -->`` goes through ``bash -euo pipefail`` with ``tidal`` and ``python``
on the PATH, against a real ``tidal up``. Its first line, ``tidal up ... &``, is run as ``Plane``
runs it (the same options, plus ``--port 0`` and a temporary state dir, so that it cannot meet
another plane on this machine); every other line runs unchanged, in a scratch directory where
``src/`` is the repository's (the session's paths are relative to the repository root)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from plane_proc import Plane

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from tidal.cli import main; sys.argv[0] = 'tidal'; main()"


def session() -> tuple[list[str], str]:
    """(the ``tidal up`` line's arguments, the rest of the block)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(
        r"<!-- readme-session: begin -->\n```sh\n(.*?)```\n<!-- readme-session: end -->", text, re.S
    )
    assert m, "README.md: no readme-session block"
    first, rest = m.group(1).split("\n", 1)
    cmd = shlex.split(first.split("#", 1)[0])
    assert cmd[:2] == ["tidal", "up"] and cmd[-1] == "&", first
    return cmd[2:-1], rest


def test_the_readme_session_runs_as_written(tmp_path, monkeypatch):
    up_args, script = session()
    assert up_args[0] == "--gpus"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, run in (
        ("tidal", f'-c "{RUN}" '),
        ("python", ""),
    ):  # scripts: a venv's python found by its path
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {run}"$@"\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv(
        "PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    )  # the plane's jobs find python too
    work = tmp_path / "work"
    work.mkdir()
    (work / "src").symlink_to(ROOT / "src")
    (tmp_path / "plane").mkdir()
    plane = Plane(tmp_path / "plane", "loop_interval_s: 0.2\nstartup_timeout_s: 600\n", gpus=int(up_args[1]))
    try:
        plane.start()
        env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_API_URL", "TIDAL_TOKEN")}
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, "TIDAL_STATE_DIR": str(plane.state), "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
        )
    finally:
        plane.stop()
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = r.stdout
    assert "hello from rank 0 \n" in out or "hello from rank 0\n" in out, out
    assert "submitted vision-run-2 (spot, 2 GPUs)" in out and "hello from rank 0 hi" in out, out
    assert "hello-1" in out and '"to": "succeeded"' in out
    assert "exported step 1 of " in out and "2 tensor(s)" in out and "recommended lead time" in out
    assert set(load_file(str(work / "model.safetensors"))) == {"weight", "bias"}

"""The ``tidal`` command: every subcommand is reachable by name, registered lazily or all at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.cli import _COMMANDS

RUN = "import sys; from tidal.cli import main; sys.argv[0] = 'tidal'; main()"


@pytest.mark.parametrize("name", sorted(_COMMANDS))
def test_every_subcommand_answers_help(name):
    out = subprocess.run(
        [sys.executable, "-c", RUN, name, "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "Usage: tidal " + name in " ".join(out.stdout.split())


def test_no_command_lists_them_all():
    out = subprocess.run([sys.executable, "-c", RUN, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in _COMMANDS:
        assert name in out.stdout


def test_the_summary_counts_shrinks_and_grows_apart_from_preemptions():
    from tidal.control.cli_show import resizes as _resizes

    evs = [{"kind": "transition", "to": "resizing", "message": "shrink to 1 GPUs (demand, for b-2)"},
           {"kind": "transition", "to": "running", "message": "1 rank running"},
           {"kind": "transition", "to": "resizing", "message": "grow to 2 GPUs"},
           {"kind": "transition", "to": "resizing", "message": "shrink to 1 GPUs (reclaim)"},
           {"kind": "ckpt_interval", "to": None, "message": "shrink"}]
    assert _resizes(evs) == ", shrinks 2, grows 1"
    assert _resizes(None) == ""

"""The ``tidal`` command: every subcommand is reachable by name, registered lazily or all at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.cli import _COMMANDS

RUN = "import sys; from tidal.cli import main; sys.argv[0] = 'tidal'; main()"


@pytest.mark.slow
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


def test_following_logs_loses_no_line_when_the_api_goes_away_between_two_ranks():
    """``logs -f --rank all``: a poll that read rank 0's new lines and then lost the API on rank 1 (the plane
    restarting) hands those lines out on the next poll, once, in order (httpx's transport is the fake)."""
    import httpx

    from tidal.control.client import TidalClient
    from tidal.control.follow import LogFollower, Reconnecting

    logs = {0: "a0\na1\n", 1: "b0\n"}
    calls = {"n": 0}

    def serve(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 2:  # rank 1's first read: the API is away
            raise httpx.ConnectError("refused", request=req)
        text, offset = logs[int(req.url.params["rank"])], int(req.url.params["offset"])
        return httpx.Response(200, json={"data": text[offset:], "offset": len(text), "size": len(text),
                                         "done": True})

    def client() -> TidalClient:
        return TidalClient(http=httpx.Client(base_url="http://plane", transport=httpx.MockTransport(serve)))

    said: list[str] = []
    follower = LogFollower("j-1", [0, 1])
    got = Reconnecting(client, said.append, sleep=lambda s: None).call(follower.poll)
    assert got == [(0, "a0"), (0, "a1"), (1, "b0")] and follower.done
    assert said[0].startswith("lost the Tidal API") and said[1].startswith("the Tidal API is back")
    assert follower.poll(client()) == []

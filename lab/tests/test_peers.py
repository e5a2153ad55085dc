"""The peer protocol of ``python -m lab ckpt-peers``: adapters run as subprocesses, their JSON checked and
merged.

Most tests use ``tests/peer_fake.py`` (our own seam: real subprocess, real files, torch.save as the
engine); ``test_real_peers`` runs the real peers and is skipped where their venvs were not made
(``lab/peers/setup.sh``; CI does not make them).
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

from lab.peers import PEERS, PROTOCOL, SETUP_SCRIPT, VENVS_ENV
from lab.peers.runner import (
    Peer,
    check_document,
    find_peers,
    peer_lines,
    render_peers,
    run_peer,
    run_peers,
)
from tidal.bench.ckpt_state import build_state, state_bytes, tensors

FAKE = (sys.executable, str(Path(__file__).with_name("peer_fake.py")))
SIZE_GB = 0.002


def _result(repeat: int = 2) -> dict:
    """What ``tidal.bench.ckpt.run`` returns, as far as the peers use it (Tidal's medians made up)."""
    _, _, state, _ = build_state(int(SIZE_GB * 10**9))
    med = {"samples": [0.01], "median": 0.01}
    return {
        "benchmark": "ckpt",
        "size_gb_requested": SIZE_GB,
        "size_bytes": state_bytes(state),
        "tensors": len(list(tensors(state))),
        "repeat": repeat,
        "warmup_rounds": 1,
        "model": {},
        "machine": {"cpu_count": 2, "cpu": "x", "torch": "t", "cuda": False, "platform": "p"},
        "save": {
            "memcpy": {"copy_s": med},
            "tidal": {"stall_s": med, "commit_s": {"samples": [0.1], "median": 0.1}},
            "tidal_overlapped": {"stall_s": {"samples": [0.002], "median": 0.002}},
        },
        "load": {"tidal": {"load_s": med, "load_disk_s": {"samples": [0.02], "median": 0.02}}},
        "ratios": {},
        "targets": {},
        "notes": [],
    }


def test_fake_peer_merged(tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_PEER_MODE", raising=False)
    modules = tmp_path.parent / f"{tmp_path.name}-modules"
    monkeypatch.setenv("FAKE_PEER_MODULES", str(modules))
    result = _result(repeat=2)
    missing = {"absent": "not installed: no venv (make it with setup.sh absent)"}
    run_peers(result, peers=[Peer("fake", FAKE)], missing=missing, directory=tmp_path, timeout_s=120)
    # The adapter side (protocol, ckpt_state) loaded none of Tidal's other dependencies: peer venvs lack them.
    assert modules.read_text() == ""

    assert result["peers"]["absent"] == {"status": "not installed", "reason": missing["absent"]}
    fake = result["peers"]["fake"]
    assert fake["status"] == "ok", fake
    assert fake["versions"]["torch"]
    assert len(fake["memcpy"]["copy_s"]["samples"]) == 2
    ok = fake["engines"]["fake_save"]
    assert ok["status"] == "ok" and ok["notes"] == ["torch.save + fsync"]
    assert set(ok["save"]) == {"stall_s", "durable_s"} and set(ok["load"]) == {"load_disk_s"}
    for s in [*ok["save"].values(), *ok["load"].values()]:
        assert len(s["samples"]) == 2 and all(x > 0 for x in s["samples"])
    # An engine that cannot be opened: the first line of its error is the reason.
    assert fake["engines"]["fake_cuda"] == {"status": "unavailable", "reason": "RuntimeError: needs CUDA"}
    # An engine whose load gives other values is refused by the warm-up check, never timed.
    wrong = fake["engines"]["fake_wrong"]
    assert wrong["status"] == "unavailable" and "warm-up load disk" in wrong["reason"]
    assert "differ from the saved state" in wrong["reason"] and "save" not in wrong
    # An engine failing in a timed round is reported with the round; the others were timed to the end.
    assert fake["engines"]["fake_flaky"] == {"status": "unavailable", "notes": ["torch.save + fsync"],
                                             "reason": "failed in save repeat 2: OSError: disk full"}

    ratios = result["peer_ratios"]
    stall = ok["save"]["stall_s"]["median"]
    assert ratios["fake_save_stall_over_tidal_stall"] == pytest.approx(stall / 0.01)
    assert ratios["fake_save_stall_over_tidal_overlapped_stall"] == pytest.approx(stall / 0.002)
    assert ratios["fake_save_durable_over_tidal_commit"] == pytest.approx(
        ok["save"]["durable_s"]["median"] / 0.1
    )
    assert ratios["fake_save_stall_over_its_memcpy"] == pytest.approx(
        stall / fake["memcpy"]["copy_s"]["median"]
    )
    assert ratios["fake_save_load_disk_over_tidal_load_disk"] == pytest.approx(
        ok["load"]["load_disk_s"]["median"] / 0.02)
    assert not any(k.startswith(("fake_cuda", "fake_wrong", "fake_flaky")) for k in ratios)

    lines = peer_lines(result)
    assert lines == [f"absent: not installed: {missing['absent']}",
                     "fake / fake_cuda: cannot run here: RuntimeError: needs CUDA",
                     f"fake / fake_wrong: cannot run here: {wrong['reason']}",
                     "fake / fake_flaky: cannot run here: failed in save repeat 2: OSError: disk full"]
    # The table shows the peer's rows and, one line each, what could not run here.
    from rich.console import Console

    buf = io.StringIO()
    render_peers(result, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "fake_save" in text and "fake: memcpy" in text
    assert "fake / fake_cuda: cannot run here: RuntimeError: needs CUDA" in text
    assert list(tmp_path.iterdir()) == []  # the peers' scratch directory is gone


@pytest.mark.parametrize(("mode", "reason"), [
    ("crash", "adapter exited 3: fake peer: ImportError: no module named 'fakepeer'"),
    ("garbage", "no readable JSON document"),
])
def test_fake_peer_failures(tmp_path, monkeypatch, mode, reason):
    monkeypatch.setenv("FAKE_PEER_MODE", mode)
    result = _result(repeat=1)
    entry = run_peer(Peer("fake", FAKE), size_bytes=int(SIZE_GB * 10**9),
                     expect=(result["size_bytes"], result["tensors"]), seed=0, repeat=1, scratch=tmp_path,
                     timeout_s=120)
    assert entry["status"] == "failed" and entry["reason"].startswith(reason), entry
    assert "\n" not in entry["reason"]


@pytest.mark.slow
def test_fake_peer_timeout_ends_its_processes(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_PEER_MODE", "hang")
    monkeypatch.setenv("FAKE_PEER_CHILD_PID", str(pid_file))
    entry = run_peer(Peer("fake", FAKE), size_bytes=1000, expect=(1, 1), seed=0, repeat=1,
                     scratch=tmp_path / "s", timeout_s=5)
    assert entry == {"status": "failed", "reason": "timed out after 5 s", "stderr_tail": ""}
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{child}/stat").read_text() if Path(f"/proc/{child}/stat").exists() else ""
        if ") Z " in stat:  # a zombie of the (killed) adapter: gone as a process
            break
        time.sleep(0.05)
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or ") Z " in stat.read_text(), "the adapter's child outlived the timeout"


def test_check_document_refuses():
    good = {"protocol": PROTOCOL, "size_bytes": 10, "tensors": 2,
            "memcpy": {"copy_s": {"samples": [0.1], "median": 0.1}},
            "engines": {"e": {"status": "ok", "save": {"stall_s": {"samples": [0.1], "median": 0.1},
                                                      "durable_s": {"samples": [0.2], "median": 0.2}},
                              "load": {}}}}
    assert check_document(good, 10, 2) is None
    import copy

    def bad(path: list, value) -> dict:
        d = copy.deepcopy(good)
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return d

    cases = [
        ([], None),
        (["protocol"], 2),
        (["tensors"], 3),
        (["memcpy"], {}),
        (["engines"], {}),
        (["engines", "e", "status"], "maybe"),
        (["engines", "e"], {"status": "unavailable", "reason": ""}),
        (["engines", "e", "save", "stall_s", "samples"], [float("nan")]),
        (["engines", "e", "save", "stall_s", "samples"], [-1.0]),
        (["engines", "e", "save", "stall_s", "samples"], ["1"]),
        (["engines", "e", "save", "stall_s", "median"], True),
        (["engines", "e", "save"], {"stall_s": {"samples": [0.1], "median": 0.1}}),
        (["engines", "e", "load"], [1]),
    ]
    for path, value in cases:
        doc = "not a dict" if not path else bad(path, value)
        why = check_document(doc, 10, 2)
        assert why and "\n" not in why, (path, value)


def test_find_peers(tmp_path, monkeypatch):
    monkeypatch.setenv(VENVS_ENV, str(tmp_path))
    (tmp_path / "dlrover" / "bin").mkdir(parents=True)
    (tmp_path / "dlrover" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "bytecheckpoint" / "bin").mkdir(parents=True)  # a venv without its python
    found, missing = find_peers()
    assert found == [Peer("dlrover", (str(tmp_path / "dlrover" / "bin" / "python"), "-m", PEERS["dlrover"]))]
    assert set(missing) == set(PEERS) - {"dlrover"}
    assert all(SETUP_SCRIPT in why and name in why for name, why in missing.items())


def test_real_peers(tmp_path):
    """The real peers, where their venvs exist: each adapter runs; an engine runs or says why not."""
    found, missing = find_peers()
    if not found:
        pytest.skip(f"no peer venvs ({'; '.join(missing.values())})")
    result = _result(repeat=1)
    run_peers(result, peers=found, missing=missing, directory=tmp_path, timeout_s=400)
    for peer in found:
        entry = result["peers"][peer.name]
        assert entry["status"] == "ok", (peer.name, entry.get("reason"), entry.get("stderr_tail", "")[-2000:])
        for name, e in entry["engines"].items():
            if e["status"] == "ok":
                assert e["save"]["stall_s"]["median"] > 0 and e["load"], name
                assert f"{name}_stall_over_tidal_stall" in result["peer_ratios"]
            else:
                assert e["reason"] and "\n" not in e["reason"], name
    ran = {n for p in result["peers"].values() if p["status"] == "ok"
           for n, e in p["engines"].items() if e["status"] == "ok"}
    # What runs on a CPU-only machine (docs/checkpoint.md says which do not, and why).
    if "bytecheckpoint" in result["peers"]:
        assert "bytecheckpoint" in ran
    if "dlrover" in result["peers"]:
        assert "dlrover_flash" in ran


def test_one_line_names_a_bare_assert(tmp_path):
    import importlib.util

    from lab.peers.protocol import one_line

    src = tmp_path / "site-packages" / "peerlib.py"  # a module pytest does not rewrite, as a peer's is
    src.parent.mkdir()
    src.write_text("def check(t):\n    assert t.is_cuda\n")
    spec = importlib.util.spec_from_file_location("peerlib", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(AssertionError) as info:
        mod.check(type("T", (), {"is_cuda": False})())
    assert one_line(info.value) == "AssertionError at peerlib.py:2 (assert t.is_cuda)"
    assert one_line(RuntimeError("x" * 1000)) == "RuntimeError: " + "x" * 385 + "…"


def test_adapter_prepare_failure_is_the_reason(tmp_path):
    """An adapter whose set-up before the state (a launcher's part) fails still writes its document."""
    import json

    from lab.peers.protocol import main

    def prepare():
        raise ConnectionError("saver did not start")

    def never(ctx):
        raise AssertionError("open_engines must not run after prepare failed")

    out = tmp_path / "doc.json"
    argv = ["--size-bytes", "20000", "--repeat", "1", "--dir", str(tmp_path / "w"), "--out", str(out)]
    assert main("p", [], never, argv, prepare=prepare) == 0
    doc = json.loads(out.read_text())
    assert doc["engines"] == {
        "p": {"status": "unavailable", "reason": "ConnectionError: saver did not start"}
    }
    assert check_document(doc, doc["size_bytes"], doc["tensors"]) is None
    assert not (tmp_path / "w").exists()


def test_ckpt_peers_command_lists_every_peer_not_installed(tmp_path, monkeypatch):
    """``python -m lab ckpt-peers`` runs tidal bench ckpt's benchmark (stood in for here: it has its own
    test), then the peers; with no venvs (as in CI) each is listed with how to install it."""
    import json

    from typer.testing import CliRunner

    import tidal.bench.ckpt
    from lab.cli import app

    monkeypatch.setenv(VENVS_ENV, str(tmp_path / "no-venvs"))
    asked = []
    monkeypatch.setattr(tidal.bench.ckpt, "run", lambda *a, **kw: asked.append(a) or _result(repeat=1))
    res = CliRunner().invoke(app, ["ckpt-peers", "--size-gb", str(SIZE_GB), "--repeat", "1", "--json",
                                   "--dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert asked == [(SIZE_GB, 1, tmp_path)]
    result = json.loads(res.stdout)
    assert set(result["peers"]) == set(PEERS) and result["peer_ratios"] == {}
    for name, entry in result["peers"].items():
        assert entry["status"] == "not installed" and f"{SETUP_SCRIPT} {name}" in entry["reason"]
    assert f"{SETUP_SCRIPT} dlrover" in res.stderr  # the table says so too, one line per peer
    assert "tidal bench ckpt" in res.stderr  # and Tidal's own tables come first

"""Ports a server binds later are drawn where the kernel never hands one out by itself."""

from __future__ import annotations

import socket
from pathlib import Path

from tidal.net import free_port, free_ports, unclaimed_ports


def test_unclaimed_ports_lie_outside_the_ephemeral_range(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert unclaimed_ports(f) == range(20000, 32768)
    f.write_text("1024 50000\n")
    assert unclaimed_ports(f) == range(50001, 65536)
    f.write_text("1024 65000\n")
    assert unclaimed_ports(f) is None  # too few either side: the OS picks
    assert unclaimed_ports(tmp_path / "absent") is None
    f.write_text("garbage")
    assert unclaimed_ports(f) is None


def test_a_picked_port_is_never_one_an_outgoing_connection_can_take() -> None:
    pool = unclaimed_ports()
    ports = free_ports(64)
    assert len(set(ports)) == 64
    if pool is not None:  # Linux: every pick is one that connect() and bind(0) never use
        assert all(p in pool for p in ports)
    with socket.socket() as s:  # and it is free: a server binds it
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        taken = s.getsockname()[1]
        with socket.socket() as t:
            t.connect(("127.0.0.1", taken))
            if pool is not None:
                assert t.getsockname()[1] not in pool

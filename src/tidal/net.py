"""Free TCP ports. Standard library only, no imports of ours: every layer may import it."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (the OS picks them; all held until all are
    picked, so none repeats). ``host`` ``""``: free on every interface (a rendezvous other nodes reach)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on ``host`` right now (:func:`free_ports`)."""
    return free_ports(1, host)[0]

"""Free TCP ports. Standard library only, no imports of ours: every layer may import it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below it sit well-known services and Ray's worker ports (10002-19999)
_rng = random.Random()  # seeded from the OS: two processes draw different ports


def unclaimed_ports(ephemeral: Path = EPHEMERAL_RANGE_FILE) -> range | None:
    """The ports the kernel never hands out by itself (``bind(0)``, an outgoing connection's local port):
    those below its ephemeral range, else above it; None where the range is unknown or leaves too few."""
    try:
        lo, hi = map(int, ephemeral.read_text().split())
    except (OSError, ValueError):
        return None
    if lo - LOWEST >= 1000:
        return range(LOWEST, lo)
    return range(hi + 1, 65536) if 65535 - hi >= 1000 else None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now, all held until all are picked. Drawn at random
    from :func:`unclaimed_ports`: a server binds its port later, and a port from the ephemeral range can be
    taken in between by any outgoing connection; one outside it only by another explicit pick. ``host``
    ``""``: free on every interface (a rendezvous other nodes reach)."""
    pool = unclaimed_ports()
    socks: list[socket.socket] = []
    misses = 0
    try:
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, _rng.choice(pool) if pool is not None and misses < 100 else 0))
            except OSError:
                s.close()
                misses += 1
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on ``host`` right now (:func:`free_ports`)."""
    return free_ports(1, host)[0]

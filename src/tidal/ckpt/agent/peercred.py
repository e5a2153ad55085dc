"""The uid owning the client end of a TCP connection from this node, from the kernel's socket tables
(``/proc/net/tcp``, ``tcp6``): the agent copies a file a client names only when that uid owns it (or is
root). None when the client is not on this node: then the client sends the bytes."""

from __future__ import annotations

import socket
import struct


def _hex(addr: tuple) -> str:
    """An address as the kernel's tables print it: the IP's 32-bit words in host order, then the port."""
    host, port = addr[0], addr[1]
    if ":" in host:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, host))
        return "".join(f"{w:08X}" for w in words) + f":{port:04X}"
    return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}:{port:04X}"


def peer_uid(conn: socket.socket) -> int | None:
    """The uid owning the client end of ``conn`` (an accepted connection), or None when not found here."""
    try:
        mine, theirs = _hex(conn.getsockname()), _hex(conn.getpeername())
    except (OSError, ValueError):
        return None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 7 and cols[1] == theirs and cols[2] == mine:
                        return int(cols[7])
        except OSError:
            continue
    return None

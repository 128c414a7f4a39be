"""Ports for the servers a test starts by number (a service told `--port N`, a rendezvous).

A port picked by binding 0 comes from the kernel's ephemeral range, the same range every
outgoing connection's own end is drawn from: between the pick and the server's bind, a client
socket, a gRPC channel or a gloo connection made meanwhile can take it (the server then fails
with "address already in use"). So a port is picked below that range, where only explicit
binds land, and never twice in one test process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below the ephemeral range, above the well-known and most registered service ports.
_LOWEST = 10000
_given: set[int] = set()
_rng = random.Random()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0: unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, outside the ephemeral range when
    the kernel says where that is, and not handed out before in this process."""
    high = _ephemeral_low()
    if high - _LOWEST >= 1000:
        for _ in range(500):
            port = _rng.randrange(_LOWEST, high)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    while True:  # no room below the range: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port

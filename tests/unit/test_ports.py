"""The test ports helper (tests/ports.py): ports below the kernel's ephemeral range, where no
outgoing connection's own end can take them between the pick and a server's bind; never the
same twice; each free when handed out."""

from __future__ import annotations

import socket

from tests.ports import _ephemeral_low, free_port


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    low = _ephemeral_low()
    if low > 11000:
        assert all(10000 <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if something holds it


def test_a_port_in_use_is_not_handed_out() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in {free_port() for _ in range(50)}

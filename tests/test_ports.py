"""The harness's port picker: free ports outside the range the kernel hands to outgoing connections."""

from __future__ import annotations

import socket

from loadtest.ports import ephemeral_start, free_port, free_ports


def test_ports_are_below_the_ephemeral_range_bindable_and_never_repeated():
    picked = [free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert all(port < ephemeral_start() for port in picked)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", picked[-1]))


def test_consecutive_ports_are_all_free_and_under_the_bound():
    first = free_ports(8, below=20000)
    assert first + 8 <= 20000
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", first))
        b.bind(("127.0.0.1", first + 7))
    assert free_port() not in range(first, first + 8)

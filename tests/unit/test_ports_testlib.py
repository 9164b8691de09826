"""``ports_testlib.free_port``: the tests' rendezvous ports come from below the kernel's ephemeral range, where no
outgoing connection can take one between the probe and the job's bind."""

import socket

from ports_testlib import LOWEST, ephemeral_low, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn at random, not one fixed port every test would share
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))

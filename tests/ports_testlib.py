"""Loopback ports for the tests' rendezvous (``tests/`` is on ``sys.path`` through ``tests/conftest.py``).

A port from ``bind(0)`` is ephemeral: once the probe closes it, the kernel may hand it to any outgoing
connection (a gloo pair, a launcher's daemon) before the job told to listen on it binds it, and that job's
rank 0 dies with EADDRINUSE. That happened once in CI (2026-12-04, ``test_killed_rank_ends_job_within_60s
[mpirun]``, port 59169). A port below the ephemeral range is never handed out by the kernel, only taken by
an explicit bind, so the window between the probe and the job's bind is safe from everything but another
test picking the same port, and the suite runs its tests one at a time.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000
"""Below it: well-known services, and ``tests/ops/slurmharness.free_port_block``'s blocks (from 17000)."""


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port on loopback, outside the ephemeral range (each distributed test rendezvouses on its
    own). Falls back to ``bind(0)`` where the range leaves too little room below it."""
    low = ephemeral_low()
    if low - LOWEST >= 1000:
        rng = random.SystemRandom()
        for port in (rng.randrange(LOWEST, low) for _ in range(100)):
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Free loopback ports for a rendezvous that this process picks and another process (or itself, later) binds.

A port from ``bind(0)`` is ephemeral: once the probe closes it, the kernel may hand it to any outgoing
connection (a gloo pair, a launcher's daemon, another job's TCPStore client) before the rank told to
listen on it binds it, and that rank dies with EADDRINUSE. The test suite met it once (2026-12-04,
``test_killed_rank_ends_job_within_60s[mpirun]``, port 59169). A port below the ephemeral range is never
handed out by the kernel, only taken by an explicit bind, so the window between the probe and the bind is
open only to another process picking the same port at random.

Imports nothing heavy: ``launch/gpu_check.sh`` calls ``python -m comera_dist.engine.ports``.
"""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOWEST = 20000
"""Below it: well-known services, and the tests' Slurm port blocks (``tests/ops/slurmharness``, from 17000)."""


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port on loopback, drawn at random below the ephemeral range. Falls back to ``bind(0)``
    where the range leaves too little room below it (fewer than 1000 ports) or 100 draws found none free."""
    low = ephemeral_low()
    if low - LOWEST >= 1000:
        rng = random.SystemRandom()
        for port in (rng.randrange(LOWEST, low) for _ in range(100)):
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


USAGE = "usage: python -m comera_dist.engine.ports   (prints a free loopback port below the ephemeral range)"

if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(USAGE)
    elif sys.argv[1:]:
        sys.exit(f"comera_dist.engine.ports takes no arguments, got {sys.argv[1:]}\n{USAGE}")
    else:
        print(free_port())

"""A test's own process group: its output, or the whole group killed and the test failed when it hangs."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def communicate_or_kill(proc: subprocess.Popen, timeout_s: float, hung: str) -> tuple[str, str]:
    """``proc.communicate()`` within ``timeout_s``; past it, every process of ``proc``'s session (started with
    ``start_new_session=True``: mpirun's ranks, inductor's compile workers) is killed and the test fails with
    ``hung`` and the output's tail."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{hung}:\n{((out or '') + (err or ''))[-4000:]}")

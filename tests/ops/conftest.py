"""Fixtures for the operations tests: a real Slurm cluster on loopback, free ports, a repo path."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from opsmarks import REPO

sys.path.insert(0, str(REPO / "monitoring/ci"))

from slurmharness import SlurmCluster, free_port_block

# CI sets COMERA_REQUIRE_SERVICES=1: there every skip in this folder (a missing program, not
# root, or any other reason) is a failure that names the reason, never a quiet "s".
REQUIRE_SERVICES = os.environ.get("COMERA_REQUIRE_SERVICES") == "1"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if REQUIRE_SERVICES and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"COMERA_REQUIRE_SERVICES=1 turns this skip into a failure: {reason}"
    return report


@pytest.fixture(scope="session")
def slurm():
    """The session's Slurm cluster (started on first use by ``ensure``); every daemon stopped at the end."""
    # not under pytest's 0700 tmp dirs: munged runs as user munge and must reach its socket dir
    workdir = Path(tempfile.mkdtemp(prefix="comera-slurm-"))
    workdir.chmod(0o755)
    cluster = SlurmCluster(workdir, free_port_block(16))
    yield cluster
    cluster.down()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def slurm_1node(slurm: SlurmCluster) -> SlurmCluster:
    return slurm.ensure(1)


@pytest.fixture
def slurm_2nodes(slurm: SlurmCluster) -> SlurmCluster:
    """Two emulated nodes n1, n2 at NodeAddr 127.0.0.2 and 127.0.0.3 (loopback), each with 2 fake GPUs (GRES on /dev/tty0-1)."""
    return slurm.ensure(2, gpus=2)

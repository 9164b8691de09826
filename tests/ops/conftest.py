"""Fixtures for the operations tests: a real Slurm cluster on loopback, free ports, a repo path."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "monitoring/ci"))

from slurmharness import SlurmCluster, free_port_block

NEEDS_SLURM = [b for b in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(b) is None]
NEEDS_PROM = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]

# CI sets COMERA_REQUIRE_SERVICES=1: there a missing program is an install failure, never a skip.
if os.environ.get("COMERA_REQUIRE_SERVICES") == "1" and (NEEDS_SLURM or NEEDS_PROM):
    raise RuntimeError(f"COMERA_REQUIRE_SERVICES=1 but these programs are missing: {NEEDS_SLURM + NEEDS_PROM}")

requires_slurm = pytest.mark.skipif(
    bool(NEEDS_SLURM) or os.geteuid() != 0,
    reason=f"real Slurm needs root and Debian slurmctld/slurmd/munge (missing: {NEEDS_SLURM}); "
           "launch/setup.sh --dev installs them")
requires_prometheus = pytest.mark.skipif(
    bool(NEEDS_PROM), reason=f"needs Debian prometheus/promtool (missing: {NEEDS_PROM}); launch/setup.sh --dev")


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
    """Two emulated nodes n1, n2 on 127.0.0.1, each with 2 fake GPUs (GRES on /dev/tty0-1)."""
    return slurm.ensure(2, gpus=2)

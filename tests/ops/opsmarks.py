"""What the operations tests need and their skip marks: imported by name, not as ``conftest``.

Every folder under tests/ has a ``conftest.py``; pytest imports each under that one module name,
so ``from conftest import ...`` in a test here found tests/unit's when both folders were collected
in one call (``pytest tests/ops tests/unit``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

NEEDS_SLURM = [b for b in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(b) is None]
NEEDS_PROM = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
# the daemons run as root here (slurmd spawns jobs as their user, munged drops to user munge)
SLURM_UNMET = [f"{b} not on PATH" for b in NEEDS_SLURM] + ([] if os.geteuid() == 0 else [f"euid {os.geteuid()} is not root"])

requires_slurm = pytest.mark.skipif(
    bool(SLURM_UNMET), reason=f"real Slurm needs root and Debian slurmctld/slurmd/munge ({'; '.join(SLURM_UNMET)}); "
                              "launch/setup.sh --dev installs them")
requires_prometheus = pytest.mark.skipif(
    bool(NEEDS_PROM), reason=f"needs Debian prometheus/promtool (missing: {NEEDS_PROM}); launch/setup.sh --dev")

"""The launch/ scripts themselves: strict bash with a usage line, and ``--dry-run`` printing the exact
command (one process each, milliseconds; the real 2-rank jobs are in tests/distributed/test_launchers.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "configs/tiny-cpu.yaml"


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment without the variables the scripts read, CPU DeepSpeed, then ``extra``."""
    read = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC", "NP", "NNODES", "NODE_RANK",
            "TORCHRUN", "MPIRUN", "MPIRUN_ARGS")
    return {k: v for k, v in os.environ.items() if k not in read} | {"DS_ACCELERATOR": "cpu"} | extra


@pytest.mark.parametrize("script", ["pretrain_local.sh", "torchrun.sh", "mpirun.sh"])
def test_launch_script_is_strict_and_has_usage(script):
    text = (REPO / "launch" / script).read_text()
    assert "set -euo pipefail" in text and "# usage: launch/" + script in text
    assert subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=False).returncode == 0


def test_launch_scripts_dry_run_print_the_command():
    env = _env(MASTER_PORT="29555", NPROC="3", NP="3", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.7")
    run = lambda *a: subprocess.run([*a], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    p = run("launch/torchrun.sh", "--dry-run", "--config", TINY)
    assert p.returncode == 0
    assert p.stdout.split() == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3",
                                "--master-addr", "10.0.0.7", "--master-port", "29555", "--max-restarts", "0",
                                "launch/train.py", "--config", TINY]
    p = run("launch/mpirun.sh", "--dry-run", "--config", TINY)
    assert p.returncode == 0 and " -np 3 " in p.stdout and "--allow-run-as-root --oversubscribe" in p.stdout
    for script in ("launch/torchrun.sh", "launch/mpirun.sh"):
        p = run(script)  # no trainer arguments: the usage, exit 2
        assert p.returncode == 2 and "usage:" in p.stderr

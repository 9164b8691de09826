"""Ranks from a real Slurm job step on 2 emulated nodes: ``srun -n 4`` and ``deepspeed --launcher slurm``.

srun sets only Slurm's variables (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ...), none of torch's. Before
``engine.slurm_ranks`` each of the 4 tasks took itself for a single process and trained alone into the same
output directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opsmarks import REPO, requires_slurm

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires_slurm]
PROGRAM = REPO / "tests/ops/programs/rank_report.py"
TASK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _env(cluster) -> dict[str, str]:
    """The cluster's environment without any rank a surrounding launcher left: the step's tasks get Slurm's only."""
    env = {k: v for k, v in cluster.env.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return env | TASK_ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


def _run(argv: list[str], env: dict[str, str], timeout: float) -> str:
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"{' '.join(argv)} -> {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def test_srun_tasks_form_one_process_group_across_nodes(slurm_2nodes, tmp_path):
    _run(["srun", "--nodes=2", "--ntasks=4", sys.executable, str(PROGRAM), str(tmp_path)], _env(slurm_2nodes), 120)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    port = results[0]["master"].split(":")[1]
    for r, res in enumerate(results):
        assert res["seen"] == dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")), res
        assert (res["source"], res["procid"], res["rank"], res["world_size"]) == ("slurm", str(r), r, 4), res
        assert res["local_rank"] == r % 2, res  # srun's block distribution: tasks 0, 1 on n1 and 2, 3 on n2
        # across nodes: the head node n1's NodeAddr (scontrol), one port for every task, below the ephemeral range
        assert res["master"] == f"127.0.0.2:{port}" and 20000 <= int(port) < 32000, res
        assert res["all_reduce"] == 10.0 and res["all_gather"] == [[0, "n1"], [1, "n1"], [2, "n2"], [3, "n2"]], res


def test_deepspeed_slurm_launcher_trains_one_run_of_four_ranks(slurm_2nodes, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    out = tmp_path / "run"
    log = _run([str(Path(sys.executable).with_name("deepspeed")), "--launcher", "slurm", "--hostfile", str(hostfile),
                "--no_ssh_check", "--master_addr", "127.0.0.1", "launch/train.py", "--config", "configs/tiny-cpu.yaml",
                "--set", "train.steps=3", "--set", f"train.output_dir={out}",
                "--set", f"data.cache_dir={tmp_path / 'cache'}"], _env(slurm_2nodes), 300)
    assert "cmd = srun -n 4" in log  # DeepSpeed's own SlurmRunner started the tasks, not a launcher of ours
    for r in range(4):
        assert f"rank {r}/4 up (local rank {r % 2}, slurm discovery)" in log, log[-4000:]
    assert "rank 0/1" not in log  # no task trained alone
    ckpt = out / "checkpoints" / (out / "checkpoints/latest").read_text().strip()
    assert ckpt.name == "step00000003" and (ckpt / "COMPLETE").exists()
    # one ZeRO run of world size 4 wrote it: one optimizer shard per rank
    assert sorted(p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]

"""Rank discovery inside a Slurm job step: ``srun -n N python launch/train.py ...`` or ``deepspeed --launcher slurm``.

srun starts every task itself and tells each one where it sits (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
``SLURM_LOCALID``), but sets none of torch's ``RANK``/``WORLD_SIZE``. Without this branch each task took itself
for a single process: N one-rank runs that wrote one output directory at once. Under ``slurm/pretrain.sh`` the
tasks run torchrun, which sets ``RANK`` itself, so this branch is never reached there.

Only a job *step* counts (``SLURM_STEP_ID`` and ``SLURM_STEP_NUM_TASKS`` are set by srun, not in the batch
script), and only one of more than one task: ``python launch/train.py`` in a batch script, or ``srun -n 1``, is a
single process.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import MutableMapping

from comera_dist.engine.errors import InputError
from comera_dist.engine.ports import LOOPBACK, LOWEST

PORT_SPAN = 12000
"""The step's rendezvous port is in [LOWEST, LOWEST + 12000) = [20000, 32000): below the kernel's ephemeral range
(32768 on Linux), so no outgoing connection can hold it, and the same on every task without any exchange
(``slurm/pretrain.sh`` draws its torchrun port from the same range)."""


def in_slurm_step(env: MutableMapping[str, str]) -> bool:
    """Whether this process is one task of a Slurm job step of more than one task."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and tasks.isdigit() and int(tasks) > 1


def step_port(job_id: str, step_id: str) -> int:
    """The rendezvous port of a job step: the same on every task, different for the steps of one job."""
    job = int(job_id) if job_id.isdigit() else 0
    step = int(step_id) if step_id.isdigit() else 0
    return LOWEST + (job + 1009 * step) % PORT_SPAN


def head_address(nodelist: str) -> str:
    """The ``NodeAddr`` of the step's first node (what the other nodes reach), by Slurm's own ``scontrol``."""
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()
        node = subprocess.run(["scontrol", "show", "node", hosts[0]], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise InputError(f"slurm: cannot find the address of the first node of SLURM_STEP_NODELIST={nodelist!r} "
                         f"with scontrol ({e}); export MASTER_ADDR=<address of rank 0's host>") from None
    found = re.search(r"\bNodeAddr=(\S+)", node)
    return found.group(1) if found else hosts[0]


def fill_from_slurm(env: MutableMapping[str, str]) -> None:
    """Set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from the step's variables.

    A ``MASTER_ADDR`` or ``MASTER_PORT`` already in the environment is kept.
    """
    rank, world, local = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"], env.get("SLURM_LOCALID", "0")
    if not (rank.isdigit() and local.isdigit() and int(rank) < int(world)):
        raise InputError(f"slurm: SLURM_PROCID={rank!r}, SLURM_LOCALID={local!r} and SLURM_STEP_NUM_TASKS={world!r} "
                         "(environment) must be integers with 0 <= SLURM_PROCID < SLURM_STEP_NUM_TASKS")
    env.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local)
    if "MASTER_ADDR" not in env:
        one_node = env.get("SLURM_STEP_NUM_NODES", "1") == "1"
        if not one_node and env.get("SLURM_DISTRIBUTION", "").startswith("arbitrary"):
            # task 0 sits on the first host of SLURM_HOSTFILE, which SLURM_STEP_NODELIST (sorted) does not say
            raise InputError("slurm: an arbitrary task distribution (srun -m arbitrary, SLURM_HOSTFILE) may put "
                             "rank 0 on any node; export MASTER_ADDR=<address of rank 0's host>")
        env["MASTER_ADDR"] = LOOPBACK if one_node else head_address(env.get("SLURM_STEP_NODELIST", ""))
    env.setdefault("MASTER_PORT", str(step_port(env.get("SLURM_JOB_ID", ""), env["SLURM_STEP_ID"])))

"""Rank discovery from the environment (the distributed part of the run configuration), pure logic."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest

from comera_dist.engine.distributed import (
    DEFAULT_PORT,
    LOOPBACK,
    device_index,
    discover_ranks,
    init_distributed,
    select_device,
)
from comera_dist.engine.errors import InputError
from comera_dist.engine.ports import ephemeral_low
from comera_dist.engine.slurm_ranks import step_port


def test_launcher_env_is_kept():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    assert discover_ranks(env) == "env"
    assert env["LOCAL_RANK"] == "0" and env["MASTER_ADDR"] == "10.0.0.5"


@pytest.mark.parametrize(("rank", "world"), [("0", "abc"), ("x", "2"), ("2", "2"), ("-1", "2")])
def test_a_bad_launcher_rank_or_world_size_names_both(rank, world):
    with pytest.raises(InputError, match=f"the launcher's RANK={rank!r} and WORLD_SIZE={world!r} \\(environment\\) "
                                         "must be integers with 0 <= RANK < WORLD_SIZE"):
        discover_ranks({"RANK": rank, "WORLD_SIZE": world})


def test_openmpi_on_one_host_is_forced_to_loopback():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "192.168.1.7"}
    assert discover_ranks(env) == "openmpi"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert env["MASTER_ADDR"] == LOOPBACK and env["MASTER_PORT"] == "29500"


def test_openmpi_across_hosts_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(InputError, match="MASTER_ADDR is not set"):  # comera pretrain: one line, exit 2
        discover_ranks(env)
    env["MASTER_ADDR"] = "10.0.0.1"
    assert discover_ranks(env) == "openmpi" and env["MASTER_ADDR"] == "10.0.0.1"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "0")  # the world's rank, not the host's


def test_single_process_gets_a_free_loopback_port():
    """Not the default port: a second single-process run on the host (an evaluation beside a debug run) would
    fail to bind it."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # already taken by someone else: it stays taken either way
            held.bind((LOOPBACK, DEFAULT_PORT))
            held.listen()
        env: dict[str, str] = {}
        assert discover_ranks(env) == "single"
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", LOOPBACK)
        with socket.socket() as probe:
            probe.bind((LOOPBACK, int(env["MASTER_PORT"])))  # free while the default one is held
        assert int(env["MASTER_PORT"]) < ephemeral_low()  # not a port the kernel hands to outgoing connections


def test_single_process_keeps_a_given_master_addr_and_port():
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    assert discover_ranks(env) == "single"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "1234")


def test_a_collective_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        init_distributed(0)


def _srun_task(rank: int, world: int, local: int, nodes: int = 1, **extra: str) -> dict[str, str]:
    """The variables srun gives task ``rank`` of a step (those of the real ``srun -N2 -n4`` on slurm/ci/up.sh)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
            "SLURM_STEP_NUM_TASKS": str(world), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_NODELIST": "n[1-2]" if nodes > 1 else "n1", "SLURM_NTASKS": str(world), **extra}


def test_a_slurm_step_task_takes_its_rank_from_slurm():
    env = _srun_task(3, 4, 1)
    assert discover_ranks(env) == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("3", "4", "1", LOOPBACK)
    port = int(env["MASTER_PORT"])
    assert port == step_port("4242", "0") and 20000 <= port < ephemeral_low()
    assert step_port("4242", "1") != port  # two steps of one job do not meet on one port


def test_a_slurm_step_across_nodes_keeps_a_given_master_addr_and_port():
    env = _srun_task(2, 4, 0, nodes=2, MASTER_ADDR="10.0.0.9", MASTER_PORT="1234")
    assert discover_ranks(env) == "slurm"
    assert (env["RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("2", "10.0.0.9", "1234")


def test_an_arbitrary_distribution_across_nodes_needs_master_addr():
    """srun -m arbitrary places task 0 on SLURM_HOSTFILE's first host, not the step's first node (sorted)."""
    with pytest.raises(InputError, match="arbitrary task distribution .* export MASTER_ADDR"):
        discover_ranks(_srun_task(1, 4, 1, nodes=2, SLURM_DISTRIBUTION="arbitrary"))
    env = _srun_task(1, 4, 1, nodes=2, SLURM_DISTRIBUTION="arbitrary", MASTER_ADDR="10.0.0.3")
    assert discover_ranks(env) == "slurm" and env["MASTER_ADDR"] == "10.0.0.3"


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},  # the batch script: no step variables
    _srun_task(0, 1, 0),                                                # srun -n 1
])
def test_a_batch_script_or_a_one_task_step_is_a_single_process(env):
    assert discover_ranks(env) == "single" and env["WORLD_SIZE"] == "1"


def test_torchrun_under_srun_keeps_torchruns_ranks():
    """slurm/pretrain.sh: one srun task per node runs torchrun, whose processes carry both sets of variables."""
    env = _srun_task(1, 2, 0, nodes=2, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1")
    assert discover_ranks(env) == "env" and (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")


def test_a_bad_slurm_rank_names_the_variables():
    with pytest.raises(InputError, match="SLURM_PROCID='4', SLURM_LOCALID='0' and SLURM_STEP_NUM_TASKS='4'"):
        discover_ranks(_srun_task(4, 4, 0))


def test_device_index_is_the_local_rank_or_a_bound_slurm_tasks_only_device():
    assert device_index(1, 8, "env") == 1
    assert device_index(3, 1, "slurm") == 0  # srun --gpus-per-task=1: each task sees its own device only
    for source, count in (("env", 1), ("slurm", 2), ("openmpi", 1)):
        with pytest.raises(RuntimeError, match=f"local rank 3 has no cuda device: this node shows {count}"):
            device_index(3, count, source)


class _Accelerator:
    """The three calls ``select_device`` makes of DeepSpeed's accelerator, for a node of ``count`` GPUs."""

    def __init__(self, count: int, name: str = "cuda") -> None:
        self.count, self.name, self.selected = count, name, None

    def device_name(self) -> str:
        return self.name

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.selected = index


def test_a_bound_slurm_task_tells_deepspeed_its_device_through_local_rank(monkeypatch):
    """DeepSpeed takes LOCAL_RANK as the rank's device (init_process_group's device_id, the engine's set_device):
    left at SLURM_LOCALID 3 on a task that sees one GPU, it asked for cuda:3, which does not exist."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    gpu = _Accelerator(1)
    select_device(gpu, 3, "slurm")
    assert gpu.selected == 0 and os.environ["LOCAL_RANK"] == "0"
    monkeypatch.setenv("LOCAL_RANK", "3")
    node = _Accelerator(8)
    select_device(node, 3, "env")  # a node's 8 GPUs, all visible: the local rank's own
    assert node.selected == 3 and os.environ["LOCAL_RANK"] == "3"
    cpu = _Accelerator(0, "cpu")
    select_device(cpu, 3, "slurm")  # gloo: no device, LOCAL_RANK as it was
    assert cpu.selected is None and os.environ["LOCAL_RANK"] == "3"

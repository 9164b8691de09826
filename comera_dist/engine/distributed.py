"""Process-group start-up: rank discovery (launcher env, MPI, single process) and collective timeouts.

Every entry point calls ``init_distributed`` once before any DeepSpeed object is built. It
works under the ``deepspeed`` launcher and ``torchrun`` (``RANK``/``WORLD_SIZE`` already set),
under ``mpirun`` (OpenMPI's ``OMPI_COMM_WORLD_*`` variables, else DeepSpeed's mpi4py
discovery), in a Slurm job step (``srun``, ``deepspeed --launcher slurm``: ``engine.slurm_ranks``),
and as a plain single process.
"""

from __future__ import annotations

import gc
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import deepspeed
import deepspeed.comm as dist
import torch.distributed
from deepspeed.accelerator import get_accelerator

from comera_dist.engine.errors import InputError
from comera_dist.engine.ports import LOOPBACK, free_port
from comera_dist.engine.slurm_ranks import fill_from_slurm, in_slurm_step

DEFAULT_PORT = 29500


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    source: str
    """How the ranks were discovered: ``env``, ``openmpi``, ``slurm``, ``mpi4py`` or ``single``."""


def disable_shm_op() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory all-reduce op (about 105 s on a fresh machine).

    The op only serves inference all-reduce; training traffic goes through gloo/NCCL either way.
    """
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


ALL_GATHER_DEPRECATED = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"


def quiet_all_gather_deprecation() -> None:
    """Ignore torch's FutureWarning that ``all_gather_into_tensor`` is deprecated (torch 2.13, for
    ``all_gather_single``), for the whole process.

    DeepSpeed 0.19.8's torch backend (``deepspeed.comm.torch``) makes that call for ZeRO's step and for every
    ``deepspeed.comm.all_gather_into_tensor`` (``engine.hooks`` too), so each rank of a multi-rank run printed it
    with a line of torch's own ``c10d_logger`` as the culprit: nothing a user of this package can change.
    ``all_gather_single`` is not in torch 2.11 (the GPU image), so DeepSpeed cannot simply switch. Other warnings
    are left alone."""
    warnings.filterwarnings("ignore", message=ALL_GATHER_DEPRECATED, category=FutureWarning)


BARRIER_DEVICE_NOTICE = r"barrier\(\): using the device under current context"


def quiet_barrier_device_notice() -> None:
    """Ignore torch's UserWarning that ``barrier()`` uses "the device under current context", for the whole
    process.

    torch warns when an NCCL group has no bound device. DeepSpeed 0.19.8 binds none in a one-rank job (its
    ``init_process_group`` skips ``device_id`` at world size 1, DeepSpeed issue 8248), so every single-GPU run
    printed it at its barriers (DeepSpeed's and ours; the fourth H200 lease's logs). ``init_distributed`` selects
    this rank's device before the group starts, so the device under current context is the right one. Other
    warnings are left alone."""
    warnings.filterwarnings("ignore", message=BARRIER_DEVICE_NOTICE, category=UserWarning)


def discover_ranks(env: dict[str, str] | None = None) -> str:
    """Fill ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in ``env``.

    Returns the discovery source. ``env`` defaults to ``os.environ`` (modified in place).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = env["RANK"], env["WORLD_SIZE"]
        if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
            raise InputError(f"the launcher's RANK={rank!r} and WORLD_SIZE={world!r} (environment) must be integers "
                             "with 0 <= RANK < WORLD_SIZE")
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", LOOPBACK)
        env.setdefault("MASTER_PORT", str(DEFAULT_PORT))
        return "env"
    if "OMPI_COMM_WORLD_RANK" in env:
        if env.get("OMPI_COMM_WORLD_LOCAL_SIZE") != env["OMPI_COMM_WORLD_SIZE"] and "MASTER_ADDR" not in env:
            raise InputError("openmpi: ranks span several hosts but MASTER_ADDR is not set; "
                             "export MASTER_ADDR=<address of rank 0's host>")
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        one_host = env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == env["WORLD_SIZE"]
        source = "openmpi"
    elif in_slurm_step(env):
        fill_from_slurm(env)
        return "slurm"
    elif "PMI_RANK" in env or "PMIX_RANK" in env:
        # Another MPI: DeepSpeed's mpi4py discovery maps it (MASTER_ADDR from `hostname -I`).
        user_addr = env.get("MASTER_ADDR")
        dist.mpi_discovery(distributed_port=int(env.get("MASTER_PORT", DEFAULT_PORT)), verbose=False)
        from mpi4py import MPI

        one_host = len(set(MPI.COMM_WORLD.allgather(MPI.Get_processor_name()))) == 1
        if user_addr is not None and not one_host:
            env["MASTER_ADDR"] = user_addr
        source = "mpi4py"
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", LOOPBACK)
        env.setdefault("MASTER_PORT", str(free_port()))
        return "single"
    if one_host:
        # MPI discovery would take the first address of `hostname -I`, which is not loopback (and
        # may not be reachable); ranks that share one host always meet on 127.0.0.1.
        env["MASTER_ADDR"] = LOOPBACK
    elif "MASTER_ADDR" not in env:
        raise RuntimeError(f"{source}: ranks span several hosts but MASTER_ADDR is not set; "
                           "export MASTER_ADDR=<address of rank 0's host>")
    env.setdefault("MASTER_PORT", str(DEFAULT_PORT))
    return source


def device_index(local_rank: int, count: int, source: str, kind: str = "cuda") -> int:
    """The device this rank selects among the ``count`` it sees: its local rank, or 0 for a Slurm task that sees one.

    srun's per-task binding (``--gpus-per-task=1``, ``--gpu-bind=single:1``) leaves each task exactly one visible
    device, its own, whatever its ``SLURM_LOCALID``. Two tasks that were given the same device are NCCL's to
    refuse ("Duplicate GPU detected"). Any other local rank past the devices is too many processes per node.
    """
    if local_rank < count:
        return local_rank
    if source == "slurm" and count == 1:
        return 0
    raise RuntimeError(f"local rank {local_rank} has no {kind} device: this node shows {count}; start at most that "
                       "many processes per node (or DS_ACCELERATOR=cpu for a CPU run)")


def init_distributed(timeout_s: float = 60.0) -> DistInfo:
    """Discover the ranks and start the process group once, on DeepSpeed's accelerator.

    The accelerator (``DS_ACCELERATOR``, else DeepSpeed's detection) decides everything device:
    the backend is its communication backend (NCCL for ``cuda``, gloo for ``cpu``), and on a
    device accelerator this rank's device is selected *before* the group starts, so NCCL binds
    each rank to its own GPU. ``DS_ACCELERATOR=cpu`` on a GPU node therefore gives a CPU run
    under gloo, never a CPU module under an NCCL group.

    ``timeout_s`` bounds every collective, so a dead peer makes the survivors fail instead
    of hanging forever. Safe to call twice (the second call only reports).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    disable_shm_op()
    quiet_all_gather_deprecation()
    quiet_barrier_device_notice()
    source = discover_ranks()
    accelerator = get_accelerator()
    global _node_local_rank
    if not dist.is_initialized():
        _node_local_rank = int(os.environ["LOCAL_RANK"])
        select_device(accelerator, _node_local_rank, source)
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), auto_mpi_discovery=False,
                                   verbose=False, timeout=timedelta(seconds=timeout_s))
    local_rank = int(os.environ["LOCAL_RANK"]) if _node_local_rank is None else _node_local_rank
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, source=source)


_node_local_rank: int | None = None
"""This process's index among its node's processes, as discovered when the group started (``DistInfo.local_rank``:
one local rank 0 per node builds the data). ``LOCAL_RANK`` may differ from it after ``select_device``."""


def select_device(accelerator: Any, local_rank: int, source: str) -> None:
    """Select this rank's device (``device_index``) on a device accelerator, and say it in ``LOCAL_RANK``.

    DeepSpeed reads ``LOCAL_RANK`` itself as the rank's device: ``init_process_group``'s ``device_id`` and the
    engine's own ``set_device``. A Slurm task bound to one GPU has a ``SLURM_LOCALID`` past its one device, so
    ``LOCAL_RANK`` becomes that device's index (0) there; elsewhere it is unchanged.
    """
    if accelerator.device_name() == "cpu":
        return
    index = device_index(local_rank, accelerator.device_count(), source, accelerator.device_name())
    accelerator.set_device(index)
    os.environ["LOCAL_RANK"] = str(index)


def leave_distributed() -> None:
    """Destroy the process group, once every rank has returned from its work together.

    Left to interpreter exit, the backend's threads are torn down in no set order: NCCL warns that
    ``destroy_process_group()`` was not called, and gloo's threads have aborted a finished process
    (-6, "terminate called without an active exception"), which a launcher reports as a failed job.
    Call it only on the way out of a clean return: after a failed collective, NCCL's destroy can block
    on the dead peer.
    """
    global _node_local_rank
    _node_local_rank = None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # What still holds a group (a destroyed engine's reference cycles) is freed now, while the interpreter
    # is whole; left to its teardown, gloo's threads meet a half-finalized interpreter (PyTorch's own
    # analysis of that abort: pytorch/pytorch pull 179291).
    gc.collect()

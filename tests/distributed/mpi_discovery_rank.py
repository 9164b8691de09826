"""One rank of test_mpi_discovery.py, started by ``mpirun`` without the OMPI_COMM_WORLD_* variables.

It starts the process group with ``init_distributed`` (so the mpi4py branch of ``discover_ranks``
must find rank, world size and rendezvous), checks the answer against MPI's own, runs real
gloo collectives, and writes ``<out>/rank-<MPI rank>.json``.
usage: mpirun ... env -u OMPI_COMM_WORLD_RANK ... python mpi_discovery_rank.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from comera_dist.engine.distributed import init_distributed


def main(out: Path) -> None:
    hidden = sorted(k for k in os.environ if k.startswith("OMPI_COMM_WORLD_"))
    assert not hidden, f"the test must hide these from the rank: {hidden}"
    seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "PMI_RANK",
                                           "PMIX_RANK")}
    info = init_distributed(timeout_s=60)

    import deepspeed.comm as dist

    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)  # sum over ranks of (rank + 1)
    ranks = [None] * info.world_size
    dist.all_gather_object(ranks, info.rank)
    dist.barrier()
    result = {"mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size(), "seen": seen,
              "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
              "source": info.source, "backend": torch.distributed.get_backend(), "all_reduce": total.item(),
              "all_gather": ranks, "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}
    (out / f"rank-{result['mpi_rank']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

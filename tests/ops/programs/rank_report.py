"""One task of an ``srun`` step (tests/ops/test_srun_ranks.py): start the process group with ``init_distributed``
from Slurm's variables alone, run real gloo collectives, and write ``<out>/rank-<rank>.json``.

usage: srun -n N python rank_report.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from comera_dist.engine.distributed import init_distributed, leave_distributed


def main(out: Path) -> None:
    seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    info = init_distributed(timeout_s=60)

    import deepspeed.comm as dist

    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)  # sum over ranks of (rank + 1)
    ranks = [None] * info.world_size
    dist.all_gather_object(ranks, (info.rank, os.environ["SLURMD_NODENAME"]))
    result = {"seen": seen, "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
              "source": info.source, "procid": os.environ["SLURM_PROCID"], "all_reduce": total.item(),
              "all_gather": ranks, "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}
    (out / f"rank-{info.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    leave_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

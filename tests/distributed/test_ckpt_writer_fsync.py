"""Each rank fsyncs the checkpoint files it wrote, before the ranks hash (and fsync) their shares.

The manifest's hashing spreads the files over the ranks, so on a file system shared across nodes the rank that
fsyncs a shard may be on another node than the one that wrote it, and a client's fsync need not flush another
client's cached pages. Two real ranks at ZeRO 1 (each writes its own optimizer shard); every ``fsync`` is
recorded with the file it flushed and whether the hashing had begun (``checkpoint.written_by``'s own cases:
``tests/unit/test_ckpt_safety_publish.py``).
"""

from __future__ import annotations

import pytest
from dist_helpers import run_ranks
from engine_cases import batch, factory, tiny_config

pytestmark = pytest.mark.distributed


def _save(rank: int, world_size: int, outdir: str) -> list[tuple[str, bool]]:
    import os

    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine import manifest
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    cfg = tiny_config(outdir, zero_stage=1, steps=2)
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    s.train_step([batch(1, rank)])
    synced, hashing, real_fsync, real_describe = [], [], os.fsync, manifest.describe

    def fsync(fd: int) -> None:
        synced.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), bool(hashing)))
        real_fsync(fd)

    def describe(*args, **kwargs):
        hashing.append(True)
        return real_describe(*args, **kwargs)

    ckpt.os.fsync, manifest.describe = fsync, describe
    try:
        s.save(1, side_files={"metrics_history.json": "{}"})  # rank 0's, as the trainer's history
    finally:
        ckpt.os.fsync, manifest.describe = real_fsync, real_describe
    s.close()
    return synced


def test_each_rank_flushes_its_own_shard_before_the_hashing(tmp_path):
    synced = run_ranks(_save, tmp_path / "w", str(tmp_path / "run"), world_size=2)
    for rank, calls in enumerate(synced):
        early = {name for name, hashing in calls if not hashing}
        own = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        assert own in early, (rank, calls)
        assert not any(f"zero_pp_rank_{1 - rank}_" in name for name in early), (rank, calls)  # never another's
    assert {"mp_rank_00_model_states.pt", "comera_meta.json", "config.yaml", "metrics_history.json"} <= {
        name for name, hashing in synced[0] if not hashing}

"""A save killed mid-way never leaves ``latest`` pointing at an incomplete checkpoint."""

from __future__ import annotations

import os
import signal

from dist_helpers import run_ranks
from engine_cases import batch, factory, tiny_config


def _die_while_saving(rank: int, world_size: int, outdir: str) -> None:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(10)  # the survivor's next collective fails fast once its peer is gone
    cfg = tiny_config(outdir, zero_stage=1, steps=2)
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    s.train_step([batch(1, rank)])
    s.save(1)
    s.train_step([batch(2, rank)])
    # every rank has written its shards of step 2; rank 0 dies before publishing them
    s.save(2, before_publish=lambda tmp_dir: os.kill(os.getpid(), signal.SIGKILL))


def test_killed_save_keeps_latest_on_complete_checkpoint(tmp_path):
    from comera_dist.engine import checkpoint as ckpt

    run_ranks(_die_while_saving, tmp_path / "work", str(tmp_path / "run"),
              expect_exit={0: -signal.SIGKILL, 1: None}, timeout=120)
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step00000001"
    partial = root / ".tmp-step00000002"
    assert any(partial.iterdir()) and not (partial / ckpt.MARKER).exists()  # shards written, never published
    assert not (root / "step00000002").exists()
    assert ckpt.resolve("auto", root) == root / "step00000001"
    # even a `latest` pointing at the partial directory is not trusted
    (root / "latest").write_text(".tmp-step00000002")
    assert ckpt.resolve("auto", root) == root / "step00000001"

"""The ``weights_only`` gate on real 2-rank checkpoints of ZeRO 0 and 2 in fp32 and ZeRO 1-3 in bf16.

``checkpoint.verify_weights_only`` loads every shard with ``weights_only=True``, allowing only
``DEEPSPEED_SAFE_GLOBALS``, before DeepSpeed unpickles it on a same-shape resume. Each optimizer
(ZeRO 0's plain one, ZeRO 1-2, ZeRO 3) pickles its own objects, so the allow-list is checked
against what each (stage, precision) really writes. fp32 at ZeRO 1 and 3 is resumed through the
gate by test_checkpoint_integrity.py and test_checkpoint_trainer.py. fp16 is not offered
(``DeepSpeedSection.precision``; DeepSpeed's CPU accelerator refuses it), nor bf16 at ZeRO 0
(refused by ``DeepSpeedSection``: its FP16_Optimizer state maps to no parameter).
"""

from __future__ import annotations

import traceback

import pytest
import torch
from dist_helpers import run_ranks
from engine_cases import batch, factory, tiny_config

CASES = [(0, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]


def _save_and_gate(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    out = {}
    for stage, precision in CASES:
        cfg = tiny_config(f"{outdir}/z{stage}-{precision}", zero_stage=stage, steps=2, precision=precision)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        s.train_step([batch(1, rank)])  # optimizer state (moments, the loss scaler) exists from here on
        got = {"save": None, "gate": None, "pickled": [], "shards": 0}
        try:  # a failing save is reported by the test of its case; the next cases still run
            path = s.save(1)
        except Exception:  # noqa: BLE001
            got["save"] = traceback.format_exc(limit=-3)
        else:
            shards = sorted(path.glob("*.pt"))
            got["shards"] = len(shards)
            got["pickled"] = sorted({g for shard in shards
                                     for g in torch.serialization.get_unsafe_globals_in_checkpoint(shard)})
            try:
                ckpt.verify_weights_only(path)
            except ckpt.CheckpointError as e:
                got["gate"] = str(e)
        out[(stage, precision)] = got
        s.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    return run_ranks(_save_and_gate, tmp / "w", str(tmp / "runs"))


@pytest.mark.parametrize("stage,precision", CASES)
def test_weights_only_gate_passes_every_shard(results, stage, precision):
    from comera_dist.engine.checkpoint import DEEPSPEED_SAFE_GLOBALS

    allowed = {f"{c.__module__}.{c.__qualname__}" for c in DEEPSPEED_SAFE_GLOBALS}
    for rank, out in enumerate(results):
        got = out[(stage, precision)]
        assert got["save"] is None, f"rank {rank}: the save failed:\n{got['save']}"
        assert got["shards"] >= 2, f"rank {rank}: expected model and optimizer shards, got {got['shards']}"
        assert got["gate"] is None, f"rank {rank}: {got['gate']}"
        assert set(got["pickled"]) <= allowed, f"rank {rank}: {got['pickled']} vs the allow-list {sorted(allowed)}"

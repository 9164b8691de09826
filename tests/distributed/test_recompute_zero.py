"""``model.activation_checkpointing`` under DeepSpeed on 2 real ranks: recomputed blocks train exactly like
stored activations at ZeRO 1 (the packed engine, whose owners hold detached views between forwards) and
at ZeRO 3 (the recomputed block's parameters gathered again in backward), with dropout on; so do blocks that
remake their TT factors too (``model.recompute_factors``; at ZeRO 3 each layer contracts its own anyway), with
two threads per rank."""

from __future__ import annotations

from dist_helpers import run_ranks
from engine_cases import ZERO_GRADIENT, assert_same_training, batch, factory, full_params, tiny_config

STAGES = (1, 3)


def _train(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.packing import packed_of
    from comera_dist.engine.session import TrainSession
    from comera_dist.models import blocks

    init_distributed(60)
    import torch

    # 2 threads: the CPU's one-thread contractions (tensor.smallops) then run inside the checkpoints as their own
    # autograd function, which must find ZeRO-3's parameters gathered again in backward (red if it drops its gradients)
    torch.set_num_threads(2)
    calls = []
    real = blocks.checkpoint
    blocks.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)  # counts the checkpointed blocks
    out = {}
    for stage in STAGES:
        for recompute in (False, True, "factors"):
            calls.clear()
            cfg = tiny_config(f"{outdir}/z{stage}{recompute}", zero_stage=stage, steps=3, dropout=0.1,
                              recompute=recompute, layers=2)  # 2 blocks: each its own factors, or the model's
            s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
            losses = [s.train_step([batch(step, rank)]).task_loss for step in (1, 2, 3)]
            out[(stage, recompute)] = {"losses": losses, "params": full_params(s),
                                       "packed": packed_of(s.module) is not None,
                                       "checkpointed": len(calls)}
            s.close()
    return out


def test_recomputed_blocks_train_like_stored_activations_at_zero_1_and_3(tmp_path):
    results = run_ranks(_train, tmp_path / "work", str(tmp_path / "runs"))
    for r in results:
        assert r[(1, True)]["packed"] and r[(1, "factors")]["packed"] and not r[(3, True)]["packed"]
        for stage in STAGES:
            assert r[(stage, False)]["checkpointed"] == 0  # 2 blocks, each checkpointed once a step when recomputed
            for recompute in (True, "factors"):
                assert r[(stage, recompute)]["checkpointed"] == 6
                # the factors remade per block are summed in another order: rounding, which the zero-gradient
                # key biases take as their whole update (at ZeRO 1: 1.5e-4 apart after 3 steps)
                assert_same_training(r[(stage, recompute)], r[(stage, False)], stage,
                                     noise=ZERO_GRADIENT if (stage, recompute) == (1, "factors") else ())
    assert results[0][(1, True)]["losses"] == results[1][(1, True)]["losses"]

"""A dense FFN (``layers.dense.Linear``, GELU fused into its out-projection) under real ZeRO-3 on 2 ranks.

At ZeRO 1 the out-projection runs the fused ``gelu_matmul``; at ZeRO 3 its weight is partitioned
(``ds_id``), so it takes the unfused path (a saved view of the gathered weight would keep it alive
until backward). Both must train the same model: equal losses and weights after three steps.
"""

from __future__ import annotations

import torch
from dist_helpers import run_ranks
from engine_cases import batch, factory, full_params, tiny_config

STEPS = 3


def _train(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession
    from comera_dist.layers import dense

    init_distributed(60)
    fused_calls = []
    real = dense.gelu_matmul
    dense.gelu_matmul = lambda *a: fused_calls.append(1) or real(*a)  # counts the fused path
    out = {}
    for stage in (1, 3):
        fused_calls.clear()
        cfg = tiny_config(f"{outdir}/z{stage}", zero_stage=stage, steps=STEPS, ffn=False)
        session = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        ffn_out = [m for n, m in session.module.named_modules() if n.endswith("ffn.out")]
        init = full_params(session)
        losses = [session.train_step([batch(step, rank)]).task_loss for step in range(1, STEPS + 1)]
        out[stage] = {"init": init, "final": full_params(session), "losses": losses, "fused": len(fused_calls),
                      "dense_out": bool(ffn_out) and all(type(m) is dense.Linear for m in ffn_out),
                      "partitioned": all(hasattr(m.weight, "ds_id") for m in ffn_out)}
        session.close()
    dense.gelu_matmul = real
    return out


def test_dense_ffn_trains_the_same_at_zero_1_and_3(tmp_path):
    results = run_ranks(_train, tmp_path / "work", str(tmp_path / "runs"))
    for r in results:
        z1, z3 = r[1], r[3]
        assert z1["dense_out"] and z3["dense_out"]
        assert not z1["partitioned"] and z3["partitioned"]
        assert z1["fused"] >= STEPS and z3["fused"] == 0  # fused at ZeRO 1, unfused at ZeRO 3
        for name, value in z1["init"].items():
            assert torch.equal(z3["init"][name], value), name
        torch.testing.assert_close(z3["losses"], z1["losses"], rtol=1e-5, atol=1e-6)
        for name, value in z1["final"].items():
            if name.endswith("attn.key.bias"):
                continue  # an exactly-zero gradient: Adam amplifies rounding noise (test_engine_equivalence)
            torch.testing.assert_close(z3["final"][name], value, rtol=1e-4, atol=1e-5, msg=name)
            assert not torch.equal(value, z1["init"][name]), f"{name} did not train"
    assert results[0][1]["losses"] == results[1][1]["losses"]

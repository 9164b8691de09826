"""Non-finite steps are skipped on every rank; LR warmup per role; bf16 trains (2 real ranks)."""

from __future__ import annotations

import math

import torch

from dist_helpers import run_ranks
from engine_cases import batch, factory, full_params, tiny_config


def _poison(module, rank: int, armed: dict) -> None:
    """Rank 0's loss becomes NaN while ``armed["on"]``: only the all-reduce tells rank 1."""
    def hook(_mod, _args, out):
        if armed["on"] and rank == 0:
            out["loss"] = out["loss"] * float("nan")
        return out
    module.register_forward_hook(hook)


def _features(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.prune import optimizer_step_count
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    out: dict = {}
    for stage, accum in ((0, 1), (2, 2)):
        cfg = tiny_config(f"{outdir}/nan{stage}", zero_stage=stage, accumulation=accum)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        armed = {"on": False}
        _poison(s.module, rank, armed)
        s.train_step([batch(1, rank, m) for m in range(accum)])
        before, steps_before = full_params(s), optimizer_step_count(s.engine)
        armed["on"] = True
        skipped = s.train_step([batch(2, rank, m) for m in range(accum)])
        armed["on"] = False
        unchanged = all(torch.equal(v, before[n]) for n, v in full_params(s).items())
        steps_after_skip = optimizer_step_count(s.engine)
        good = s.train_step([batch(3, rank, m) for m in range(accum)])
        out[f"nan{stage}"] = {"skipped": skipped, "unchanged": unchanged, "good": good,
                              "counts": (steps_before, steps_after_skip, optimizer_step_count(s.engine)),
                              "total": s.nonfinite_total}
        s.engine.destroy()
    cfg = tiny_config(f"{outdir}/bf16", zero_stage=2, precision="bf16", steps=6,
                      scheduler={"kind": "warmup_decay", "warmup_steps": 3})
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    steps = [s.train_step([batch(k, rank)]) for k in range(1, 5)]
    out["bf16"] = {"losses": [o.task_loss for o in steps],
                   "group_lrs": {g["name"]: g["lr"] for g in s.engine.optimizer.param_groups},
                   "lrs": [o.lr for o in steps],
                   "dtype": str(next(s.module.parameters()).dtype)}
    s.engine.destroy()
    return out


def test_nonfinite_skip_schedule_bf16(tmp_path):
    results = run_ranks(_features, tmp_path / "work", str(tmp_path / "runs"))
    for rank in (0, 1):
        r = results[rank]
        for key in ("nan0", "nan2"):
            case = r[key]
            assert case["skipped"].skipped_nonfinite and case["unchanged"], key  # both ranks skip, no update
            assert case["total"] == 1 and not case["good"].skipped_nonfinite
            assert math.isfinite(case["good"].task_loss)
            before, after_skip, after_good = case["counts"]
            assert before == after_skip == 1 and after_good == 2  # the optimizer never ran on the NaN step
        bf16 = r["bf16"]
        assert bf16["dtype"] == "torch.bfloat16" and all(math.isfinite(v) for v in bf16["losses"])
        # linear warmup over 3 steps (DeepSpeed counts from 0), each role at its own peak lr
        assert bf16["lrs"][0] < bf16["lrs"][1] < bf16["lrs"][2]
        assert bf16["group_lrs"]["gates"] / bf16["group_lrs"]["cores"] == 5.0
    assert results[0]["bf16"]["losses"] == results[1]["bf16"]["losses"]

"""ZeRO 0 skips a step whose gradients are non-finite under a finite loss, on 2 real ranks.

At ZeRO 0 DeepSpeed hands the gradients to a plain optimizer, which applies whatever it gets, so the
session checks them itself before the update (``TrainSession.checks_gradients``). Before it did, such
a step was applied as a good one: the weights turned NaN and every later step was skipped as a
"non-finite loss", until the run stopped with the cause hidden. Only rank 0's gradients are poisoned;
both ranks must skip, leave the weights, the optimizer, the LR and the rank controller as they were,
and the next step must train normally (with accumulation: its micro-batches keep their place in
DeepSpeed's accumulation, one optimizer step per train_step).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from dist_helpers import run_ranks
from engine_cases import batch, factory, full_params, tiny_config


def _poison_grads(module: torch.nn.Module, rank: int, armed: dict) -> None:
    """While ``armed["on"]``, rank 0's ``armed["which"]``-th backward-bearing forward (1-based) gets a NaN
    loss gradient, its loss value finite. The fault injector's ``grad`` kind cannot be used with
    accumulation: ZeRO 0's forward-only probe runs under ``no_grad``, where a loss takes no hook."""
    def hook(_mod, _args, out):
        if armed["on"] and out["loss"].requires_grad:
            armed["seen"] = armed.get("seen", 0) + 1
            if rank == 0 and armed["seen"] == armed["which"]:
                out["loss"].register_hook(lambda g: g * float("nan"))
        return out
    module.register_forward_hook(hook)


def _case(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.prune import optimizer_step_count
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    out = {}
    for accum in (1, 2):
        cfg = tiny_config(f"{outdir}/a{accum}", zero_stage=0, accumulation=accum, late_stage_step=2,
                          scheduler={"kind": "warmup_decay", "warmup_steps": 3})
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        armed = {"on": False, "which": accum}  # the last micro-batch's gradients: the one at the boundary
        _poison_grads(s.module, rank, armed)
        s.train_step([batch(1, rank, m) for m in range(accum)])
        before, controller = full_params(s), s.controller.state_dict()
        steps, lrs = optimizer_step_count(s.engine), [g["lr"] for g in s.engine.optimizer.param_groups]
        armed["on"] = True
        skipped = s.train_step([batch(2, rank, m) for m in range(accum)])
        armed["on"] = False
        after = full_params(s)
        out[accum] = {
            "skipped": skipped.skipped_nonfinite, "total": s.nonfinite_total, "poisoned": armed["seen"],
            "unchanged": all(torch.equal(v, before[n]) for n, v in after.items()),
            "finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
            "controller": (controller, s.controller.state_dict()),
            "lrs": (lrs, [g["lr"] for g in s.engine.optimizer.param_groups]),
            "steps": (steps, optimizer_step_count(s.engine)),
            "good": s.train_step([batch(3, rank, m) for m in range(accum)]),
            "after_good": optimizer_step_count(s.engine),
            "micro_steps": s.engine.micro_steps}
        s.close()
    return out


def test_zero0_skips_nonfinite_gradients_under_a_finite_loss(tmp_path: Path) -> None:
    results = run_ranks(_case, tmp_path / "work", str(tmp_path / "runs"))
    for rank, r in enumerate(results):
        for accum, case in r.items():
            where = f"rank {rank}, {accum} micro-batch(es)"
            assert case["poisoned"] == accum, where  # the hook really poisoned the step's last backward
            assert case["skipped"] and case["total"] == 1, (where, case)
            assert case["unchanged"] and case["finite"], where  # no update: the weights stay finite
            assert case["steps"] == (1, 1) and case["lrs"][0] == case["lrs"][1], (where, case)  # optimizer, LR
            assert case["controller"][1] == case["controller"][0], where  # the controller as it was
            good = case["good"]
            assert not good.skipped_nonfinite and math.isfinite(good.task_loss), (where, good)
            # the next step is one whole accumulation: one optimizer step; every step moved DeepSpeed by accum micro-steps
            assert case["after_good"] == 2 and case["micro_steps"] == 3 * accum, (where, case)
    assert results[0][2]["good"].task_loss == results[1][2]["good"].task_loss

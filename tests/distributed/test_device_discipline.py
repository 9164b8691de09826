"""Device discipline on 2 real ranks: every batch reaches the model through the engine's batch mover,
and every tensor our code hands to a collective was built on the accelerator's device.

On this CPU-only machine a wrong device cannot crash anything, so ``device_guard.DeviceGuard``
checks provenance (see its docstring): it fails on ``torch.tensor(values)`` without ``device=``
fed to an all-reduce, and on a batch that reaches ``forward`` without an explicit move.
The run covers each path: a step with accumulation 2 (the non-finite probe and the real pass),
evaluation, a physical prune and rebuild, the stop-flag agreement and the peak-memory metric. It
trains in DeepSpeed bf16 (as on a GPU), and at the end the fp32 master gates, judged by
``gate_alive`` with the working dtype (what R and the plan use), keep exactly the ranks the bf16
working gates keep (what the forward mask and S use). The AdamW inside DeepSpeed is torch's fused one.
No training step synchronizes the device through
DeepSpeed's accelerator (its throughput timer did, twice per step: on an H200 under ``train.compile``
that was a graph break inside the compiled forward).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from dist_helpers import run_ranks
from engine_cases import factory, kill_two_ranks, master, micro_batches, tiny_config

LAYER, BOND = "blocks.0.attn.query", 1


def _guarded_run(rank: int, world_size: int, outdir: str) -> dict:
    from deepspeed.accelerator import get_accelerator
    from device_guard import DeviceGuard

    from comera_dist.compression.walk import tensorized_modules
    from comera_dist.engine.device import accelerator_device
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.prune import torch_optimizer
    from comera_dist.engine.session import TrainSession
    from comera_dist.engine.signals import StopRequest
    from comera_dist.engine.trainer import _peak_memory_bytes
    from comera_dist.layers.base import gate_alive
    from comera_dist.models.bert_mlm import BertMLM

    init_distributed(60)
    guard = DeviceGuard(accelerator_device())
    accelerator, step_syncs, in_step = get_accelerator(), [], [False]
    real_sync = accelerator.synchronize

    def counted_sync(*args, **kwargs):
        step_syncs.append(in_step[0])
        return real_sync(*args, **kwargs)

    accelerator.synchronize = counted_sync
    cfg = tiny_config(outdir, zero_stage=1, steps=6, accumulation=2, prune_every=2, late_stage_step=2,
                      precision="bf16")
    with guard.installed(BertMLM):
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        kill_two_ranks(s, LAYER, BOND)  # two dead ranks, so the prune at step 2 really slices and rebuilds
        losses = []
        # steps 4-6 run on the engine rebuilt at step 2 without pruning: DeepSpeed's throughput timer
        # (were it on) would synchronize from an engine's third step on
        for step in (1, 2, 3, 4, 5, 6):
            in_step[0] = True
            out = s.train_step([guard.host(b) for b in micro_batches(step, rank, 2)])
            in_step[0] = False
            losses.append(out.task_loss)
            if step <= 3:
                s.maybe_prune(step)
        val = s.evaluate([guard.host(b) for b in micro_batches(9, rank, 2)])
        stop = StopRequest()
        agreed = stop.agree()
        stop.close()
        peak = _peak_memory_bytes()
        dims = s.bond_dims()[LAYER]
        disagree, dtypes = [], set()
        for name, layer in tensorized_modules(s.module):
            g = layer.gate
            dtypes.add((g.dtype, master(s, layer).dtype))
            working = gate_alive(g.detach(), layer.tau)
            alive = gate_alive(master(s, layer), layer.tau, s.penalty.working_dtype)
            if not torch.equal(working, alive):
                disagree.append(f"{name}.gate")
        sizes = (int(s._size_tensor()), s.size())  # the step's sync-free S vs the reporting S
        size_from_masters = sum(int(gate_alive(master(s, layer), layer.tau, s.penalty.working_dtype).sum())
                                for _, layer in tensorized_modules(s.module) if layer.bond_dims())
    return {"violations": guard.violations, "collectives": guard.collective_calls, "forwards": guard.forward_calls,
            "losses": losses, "val": val, "agreed": agreed, "peak": peak, "dims": dims,
            "pruned": len(s.plans), "sizes": sizes, "disagree": disagree, "dtypes": dtypes,
            "alive_working": sum(sum(r) for r in s.ranks().values()), "alive_masters": size_from_masters,
            "step_syncs": sum(step_syncs),
            "fused": [g.get("fused") for g in torch_optimizer(s.engine).param_groups]}


def test_every_batch_and_collective_tensor_is_on_the_accelerator(tmp_path: Path) -> None:
    results = run_ranks(_guarded_run, tmp_path / "work", str(tmp_path / "run"))
    for rank, r in enumerate(results):
        assert r["violations"] == [], f"rank {rank}: " + "\n".join(r["violations"][:10])
        assert r["pruned"] == 1 and r["dims"][BOND] < 4, r  # the rebuild path ran
        # one forward per micro-batch for 6 steps x 2 micro-batches (no finite-probe at ZeRO 1: DeepSpeed
        # skips a non-finite step itself), and 2 evaluation batches
        assert r["forwards"] == 6 * 2 + 2
        assert r["collectives"] > 0 and r["agreed"] is False and r["peak"] > 0
        assert all(math.isfinite(v) for v in r["losses"]) and math.isfinite(r["val"][0])
        assert r["dtypes"] == {(torch.bfloat16, torch.float32)}  # bf16 working gates, fp32 masters
        assert r["disagree"] == [] and r["alive_working"] == r["alive_masters"]
        assert r["sizes"][0] == r["sizes"][1] > 0, r["sizes"]  # train_step's device-side S is S
        assert r["step_syncs"] == 0, f"rank {rank}: {r['step_syncs']} device synchronizes in 6 training steps"
        # the rebuilt engine's AdamW too: one fused kernel per group, not foreach's launches (or, on the
        # CPU, torch's one-tensor-at-a-time default)
        assert r["fused"] and all(f is True for f in r["fused"]), r["fused"]

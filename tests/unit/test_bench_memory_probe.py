"""memory_probe: tensor memory by role against hand-counted bytes; the RSS worker in its own process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_dist.bench.memory_probe import (
    SavedActivations,
    measure_step,
    run_probe,
    step_peak_bytes,
    unique_bytes,
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_unique_bytes_counts_shared_storage_once():
    a = torch.zeros(10, 10)  # 400 bytes
    assert unique_bytes([a, a[2:], a.view(-1), torch.zeros(3)]) == 400 + 12


@pytest.mark.parametrize("batch", [4, 12])
def test_measure_step_matches_hand_count(batch: int):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 16)  # (B, 16)
    mem = measure_step(model, opt, lambda: model(x).square().mean())
    n_params = sum(p.numel() for p in model.parameters())  # 16*32+32+32*8+8
    assert mem.params_bytes == 4 * n_params
    assert mem.grads_bytes == 4 * n_params
    # AdamW: exp_avg + exp_avg_sq per parameter, plus a 0-d fp32 `step` per parameter tensor
    assert mem.optimizer_bytes == 2 * 4 * n_params + 4 * len(list(model.parameters()))
    # saved for backward: x (B,16), the ReLU output (B,32) (also Linear 2's input: one storage),
    # Linear 2's output (B,8) for square(); weights are parameters and are not counted
    assert mem.activations_bytes == 4 * batch * (16 + 32 + 8)
    assert all(p.grad is None for p in model.parameters())  # the step cleans up after itself


def test_saved_activations_ignore_parameters():
    lin = nn.Linear(8, 8, bias=False)
    saved = SavedActivations(lin)
    x = torch.randn(2, 8, requires_grad=True)
    with saved.record():
        (x @ lin.weight).sum()  # saves x and the weight
    assert saved.bytes == 2 * 8 * 4


def test_step_peak_bytes_is_the_most_alive_at_once():
    x = torch.ones(2**18)  # 1 MiB, alive before and after: counted once the step touches it

    def step():
        a = x * 2  # 1 MiB
        b = torch.ones(2**20)  # 4 MiB: the peak is x, a and b
        del b
        c = a + 1  # 1 MiB, made after b was freed
        return c.sum()

    assert step_peak_bytes(step) == 6 * 2**20


def test_step_peak_bytes_counts_a_checkpointed_block_that_saved_tensors_miss():
    """A checkpointed block keeps only its input for backward, so saved-tensor accounting sees 1 MiB; the
    step still makes (in forward, and again in backward) a 4 MiB activation, which the peak counts."""
    from torch.utils.checkpoint import checkpoint

    lin = nn.Linear(1, 1)  # SavedActivations leaves a model's parameters out; this one holds none of ours
    x = torch.ones(2**18, requires_grad=True)  # 1 MiB

    def block(v):
        return (v.repeat(4) * 3.0).exp()  # (4 * 2**18,): 4 MiB, saved for exp's backward unless checkpointed

    saved = SavedActivations(lin)
    with saved.record():
        out = checkpoint(block, x, use_reentrant=False).sum()
    out.backward()
    assert saved.bytes == 2**20  # only the block's input

    def step():
        checkpoint(block, x, use_reentrant=False).sum().backward()

    assert step_peak_bytes(step) >= 2**20 + 2 * 4 * 2**20  # x and two 4 MiB tensors alive at once


@pytest.mark.slow
def test_probe_worker_runs_in_its_own_process():
    r = run_probe(workload="six-encoder", contender="comera", batch_size=2, steps=1, smoke=True)
    assert r["contender"] == "comera" and r["batch_size"] == 2
    assert r["step_s"] > 0 and r["rss_peak_above_baseline_bytes"] > 0
    assert r["tensor_memory"]["total_bytes"] == sum(r["tensor_memory"][k] for k in
                                                    ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                     "activations_bytes"))


def test_probe_worker_recomputes_when_asked_and_peaks_lower():
    """--recompute keeps less at batch 4; --recompute-factors (each block remaking its TT factors too) less at
    batch 1, where the factors outweigh the activations."""
    r = {flag: run_probe(workload="six-encoder", contender="comera", batch_size=4, steps=1, smoke=True,
                         recompute=flag) for flag in (False, True)}
    assert [r[False]["recompute"], r[True]["recompute"]] == [False, True]
    assert r[True]["step_peak_bytes"] < r[False]["step_peak_bytes"], r
    # the same model: parameters and optimizer state do not change, only what the step keeps alive
    assert r[True]["tensor_memory"]["params_bytes"] == r[False]["tensor_memory"]["params_bytes"]
    b1 = {flag: run_probe(workload="six-encoder", contender="comera", batch_size=1, steps=1, smoke=True,
                          recompute=True, recompute_factors=flag) for flag in (False, True)}
    assert [b1[False]["recompute_factors"], b1[True]["recompute_factors"], b1[True]["recompute"]] == [False, True, True]
    assert b1[True]["step_peak_bytes"] < b1[False]["step_peak_bytes"], b1


def test_probe_worker_rejects_bad_contender():
    with pytest.raises(ValueError, match="contender must be one of .*'sgd'"):
        run_probe(workload="six-encoder", contender="sgd", batch_size=1, steps=1, smoke=True)
    with pytest.raises(ValueError, match="batch_size and steps must be >= 1, got 0"):
        run_probe(workload="six-encoder", contender="dense", batch_size=0, steps=1, smoke=True)

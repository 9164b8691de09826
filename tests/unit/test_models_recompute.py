"""``model.activation_checkpointing``: each block recomputed in backward gives the plain forward's loss and
gradients (dropout on), keeps less for backward, also packed (``engine.packing``) and compiled; so does
``model.recompute_factors`` (each recomputed block remaking its TT factors), which peaks lower still."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from comera_dist.bench.memory_probe import measure_step, step_peak_bytes
from comera_dist.compression.config import TensorizeConfig
from comera_dist.engine.packing import pack_vectors
from comera_dist.layers.group import shared_factors
from comera_dist.models import ModelConfig, build_model

CFG = ModelConfig(arch="bert_mlm", vocab_size=60, hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32,
                  max_positions=12, dropout=0.2, num_labels=3)
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)


def _pair(arch: str, spec: TensorizeConfig | None, dropout: float = CFG.dropout,
          factors: bool = False) -> tuple[nn.Module, nn.Module]:
    """The same model twice (same initial weights), plain and recomputing (``factors``: its TT factors too)."""
    torch.manual_seed(0)
    plain = build_model(dataclasses.replace(CFG, arch=arch, dropout=dropout), spec)
    recomputing = copy.deepcopy(plain)
    recomputing.config = dataclasses.replace(plain.config, activation_checkpointing=True, recompute_factors=factors)
    return plain, recomputing


def _batch(arch: str, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (2, 10), generator=g)  # (B, T)
    labels = torch.tensor([0, 2]) if arch == "six_encoder_cls" else ids
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model: nn.Module, batch: dict[str, torch.Tensor], seed: int = 7):
    torch.manual_seed(seed)  # the same dropout masks in both models' forwards
    loss = model(**batch)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(plain: nn.Module, recomputing: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """The same loss and gradients: bit for bit in the forward; the gradients to within fp32 rounding, and
    tighter when the factors are the model's (remade per block, their products are summed in another order)."""
    loss_p, grads_p = _loss_and_grads(plain, batch)
    loss_r, grads_r = _loss_and_grads(recomputing, batch)
    torch.testing.assert_close(loss_r, loss_p, rtol=0, atol=0)
    assert grads_r.keys() == grads_p.keys() and grads_p
    tol = {"rtol": 1e-5, "atol": 1e-6} if recomputing.config.recompute_factors else {"rtol": 1e-6, "atol": 1e-7}
    for name, g in grads_p.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads_r[name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
@pytest.mark.parametrize("factors", [False, True], ids=["blocks", "factors"])
def test_recomputed_blocks_give_the_plain_loss_and_gradients(arch, spec, factors):
    plain, recomputing = _pair(arch, spec, factors=factors)
    _assert_same(plain, recomputing, _batch(arch))


def test_recomputation_keeps_less_for_backward_and_only_while_training():
    plain, recomputing = _pair("bert_mlm", SPEC)
    batch = _batch("bert_mlm")
    kept = {}
    for name, model in (("plain", plain), ("recomputing", recomputing)):
        opt = torch.optim.AdamW(model.parameters())
        kept[name] = measure_step(model, opt, lambda m=model: m(**batch)["loss"]).activations_bytes
    assert kept["recomputing"] < 0.5 * kept["plain"], kept
    recomputing.eval()  # evaluation never checkpoints: the same graph as the plain model's
    plain.eval()
    saved = {}
    for name, model in (("plain", plain), ("recomputing", recomputing)):
        with torch.autograd.graph.saved_tensors_hooks(lambda t, n=name: saved.setdefault(n, []).append(t) or t,
                                                      lambda t: t):
            model(**batch)["loss"].backward()
    assert len(saved["recomputing"]) == len(saved["plain"])


@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
@pytest.mark.parametrize("factors", [False, True], ids=["blocks", "factors"])
def test_a_packed_model_recomputes_its_blocks_with_views_in_autograd(spec, factors):
    """After a packed forward the owners hold detached views (``engine.packing``); the recomputation must
    read the views in autograd again (the model's ``recompute_context``): a dense layer's matrix multiply
    saves its input only when its weight needs a gradient, so with the detached views the recomputed
    block saves less than its forward did and torch raises a ``CheckpointError``."""
    plain, recomputing = _pair("bert_mlm", spec, factors=factors)
    for model in (plain, recomputing):
        assert pack_vectors(model) is not None
    _assert_same(plain, recomputing, _batch("bert_mlm"))


@pytest.mark.parametrize("factors", [False, True], ids=["blocks", "factors"])
def test_recomputing_model_compiles_fullgraph_with_the_plain_gradients(factors):
    plain, recomputing = _pair("six_encoder_cls", SPEC, dropout=0.0, factors=factors)  # traced RNG draws differ
    batch = _batch("six_encoder_cls")
    torch._dynamo.reset()
    compiled = torch.compile(lambda b: recomputing(**b)["loss"], fullgraph=True, backend="aot_eager")
    loss_c = compiled(batch)
    loss_c.backward()
    loss_p, grads_p = _loss_and_grads(plain, batch)
    torch.testing.assert_close(loss_c.detach(), loss_p)
    for name, p in recomputing.named_parameters():
        torch.testing.assert_close(p.grad, grads_p[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("threads", [1, 2])
def test_recomputed_factors_lower_the_step_peak_by_the_blocks_factors(threads):
    """With ``recompute_factors`` the blocks' ``L``/``R`` are not held from the forward to the end of backward:
    the step's peak of live tensors (``memory_probe.step_peak_bytes``, which sees what backward remakes) drops by
    at least the factors of all blocks but one (the one being remade). With 2 threads too: there the contractions
    run on one thread (``tensor.smallops``), whose private graph the checkpoint could not free."""
    cfg = dataclasses.replace(CFG, arch="six_encoder_cls", num_layers=4, hidden_size=32, intermediate_size=64)
    spec = TensorizeConfig(num_cores=4, max_rank=8, embedding_num_cores=2, embedding_max_rank=4)
    ids = torch.randint(0, CFG.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))  # few tokens
    batch = {"input_ids": ids, "labels": torch.tensor([1])}
    peaks = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for factors in (False, True):
            torch.manual_seed(0)
            model = build_model(dataclasses.replace(cfg, activation_checkpointing=True, recompute_factors=factors),
                                spec)
            with torch.no_grad():  # the blocks' factors, as the model-wide contraction makes and keeps them
                block_bytes = [sum(t.nbytes for lr in shared_factors(b).values() for t in lr) for b in model.blocks]
            model(**batch)["loss"].backward()  # warm-up: the gradients exist before the measured step
            peaks[factors] = step_peak_bytes(lambda m=model: m(**batch)["loss"].backward())
    finally:
        torch.set_num_threads(previous)
    assert peaks[False] - peaks[True] >= sum(block_bytes) - max(block_bytes), (peaks, block_bytes)


def test_recompute_factors_needs_activation_checkpointing():
    with pytest.raises(ValueError, match=r"^model.recompute_factors needs model.activation_checkpointing: true"):
        dataclasses.replace(CFG, recompute_factors=True)

"""``model.activation_checkpointing``: each block recomputed in backward gives the plain forward's loss and
gradients (dropout on), keeps less for backward, also packed (``engine.packing``) and compiled."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from comera_dist.bench.memory_probe import measure_step
from comera_dist.compression.config import TensorizeConfig
from comera_dist.engine.packing import pack_vectors
from comera_dist.models import ModelConfig, build_model

CFG = ModelConfig(arch="bert_mlm", vocab_size=60, hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32,
                  max_positions=12, dropout=0.2, num_labels=3)
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)


def _pair(arch: str, spec: TensorizeConfig | None, dropout: float = CFG.dropout) -> tuple[nn.Module, nn.Module]:
    """The same model twice (same initial weights), plain and recomputing."""
    torch.manual_seed(0)
    plain = build_model(dataclasses.replace(CFG, arch=arch, dropout=dropout), spec)
    recomputing = copy.deepcopy(plain)
    recomputing.config = dataclasses.replace(plain.config, activation_checkpointing=True)
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
    loss_p, grads_p = _loss_and_grads(plain, batch)
    loss_r, grads_r = _loss_and_grads(recomputing, batch)
    torch.testing.assert_close(loss_r, loss_p, rtol=0, atol=0)
    assert grads_r.keys() == grads_p.keys() and grads_p
    for name, g in grads_p.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads_r[name], g, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
def test_recomputed_blocks_give_the_plain_loss_and_gradients(arch, spec):
    plain, recomputing = _pair(arch, spec)
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
def test_a_packed_model_recomputes_its_blocks_with_views_in_autograd(spec):
    """After a packed forward the owners hold detached views (``engine.packing``); the recomputation must
    read the views in autograd again (the model's ``recompute_context``): a dense layer's matrix multiply
    saves its input only when its weight needs a gradient, so with the detached views the recomputed
    block saves less than its forward did and torch raises a ``CheckpointError``."""
    plain, recomputing = _pair("bert_mlm", spec)
    for model in (plain, recomputing):
        assert pack_vectors(model) is not None
    _assert_same(plain, recomputing, _batch("bert_mlm"))


def test_recomputing_model_compiles_fullgraph_with_the_plain_gradients():
    plain, recomputing = _pair("six_encoder_cls", SPEC, dropout=0.0)  # traced RNG draws differ from eager's
    batch = _batch("six_encoder_cls")
    torch._dynamo.reset()
    compiled = torch.compile(lambda b: recomputing(**b)["loss"], fullgraph=True, backend="aot_eager")
    loss_c = compiled(batch)
    loss_c.backward()
    loss_p, grads_p = _loss_and_grads(plain, batch)
    torch.testing.assert_close(loss_c.detach(), loss_p)
    for name, p in recomputing.named_parameters():
        torch.testing.assert_close(p.grad, grads_p[name], msg=lambda m, n=name: f"{n}: {m}")

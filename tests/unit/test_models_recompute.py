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
from comera_dist.kernels import dispatch
from comera_dist.layers import TTLinear
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
    """The task loss and rank penalty R (0 for a dense model) of one forward, and the gradients of loss + R."""
    torch.manual_seed(seed)  # the same dropout masks in both models' forwards
    out = model(**batch)
    penalty = out["rank_penalty"] if out["rank_penalty"] is not None else torch.zeros(())
    (out["loss"] + penalty).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([out["loss"].detach(), penalty.detach()]), grads


def _assert_same(plain: nn.Module, recomputing: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """The same loss and R, and their gradients: bit for bit in the forward when the factors are the model's, to
    fp32 rounding when each block remakes its own (a batched GEMM over the block's layers against one over the
    model's: BLAS may block them differently, 1.9e-7 of the loss measured on an Intel Xeon, bit for bit on an AMD
    EPYC); the gradients to within fp32 rounding, and tighter when the factors are the model's."""
    loss_p, grads_p = _loss_and_grads(plain, batch)
    loss_r, grads_r = _loss_and_grads(recomputing, batch)
    exact = not recomputing.config.recompute_factors
    torch.testing.assert_close(loss_r, loss_p, rtol=0 if exact else 1e-6, atol=0)
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


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
def test_with_two_threads_the_remade_contractions_give_the_same_gradients(arch):
    """With several threads the CPU contracts the cores on one thread (``tensor.smallops``): the plain model
    through a private graph, the recomputed blocks' own factors through ``_Remade`` (only the inputs kept, the
    contraction remade in backward). Same loss, R and gradients as the plain model's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs with OMP_NUM_THREADS=1, where smallops calls fn directly
    try:
        plain, recomputing = _pair(arch, SPEC, factors=True)
        _assert_same(plain, recomputing, _batch(arch))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("factors", [False, True], ids=["blocks", "factors"])
def test_recomputation_keeps_less_for_backward_and_only_while_training(factors):
    plain, recomputing = _pair("bert_mlm", SPEC, factors=factors)
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

    def loss_and_penalty(b: dict[str, torch.Tensor]) -> torch.Tensor:
        out = recomputing(**b)
        return torch.stack([out["loss"], out["rank_penalty"]])

    compiled = torch.compile(loss_and_penalty, fullgraph=True, backend="aot_eager")
    loss_c = compiled(batch)  # (task loss, R)
    loss_c.sum().backward()
    loss_p, grads_p = _loss_and_grads(plain, batch)
    torch.testing.assert_close(loss_c.detach(), loss_p)
    for name, p in recomputing.named_parameters():
        torch.testing.assert_close(p.grad, grads_p[name], msg=lambda m, n=name: f"{n}: {m}")


def test_a_packed_recomputing_model_compiles_fullgraph():
    """Packed (``engine.packing`` sets the model's ``recompute_context``) and compiled: Dynamo takes only
    selective-checkpoint contexts, so the traced checkpoint runs without it, and the loss is the plain one."""
    plain, recomputing = _pair("six_encoder_cls", SPEC, dropout=0.0)
    for model in (plain, recomputing):
        assert pack_vectors(model) is not None
    batch = _batch("six_encoder_cls")
    torch._dynamo.reset()
    compiled = torch.compile(lambda b: recomputing(**b)["loss"], fullgraph=True, backend="aot_eager")
    loss = compiled(batch)
    loss.backward()
    torch.testing.assert_close(loss.detach(), plain(**batch)["loss"].detach())


def _peak(model: nn.Module, batch: dict[str, torch.Tensor], threads: int) -> int:
    """The step's peak of live tensors (``memory_probe.step_peak_bytes``: it sees what backward remakes), after
    a warm-up step (the gradients exist before the measured one), with ``threads`` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model(**batch)["loss"].backward()
        return step_peak_bytes(lambda: model(**batch)["loss"].backward())
    finally:
        torch.set_num_threads(previous)


def _small_batch_model(factors: bool, batch: int = 1, tokens: int = 4) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A recomputing six-encoder whose factors outweigh its few tokens' activations."""
    cfg = dataclasses.replace(CFG, arch="six_encoder_cls", num_layers=4, hidden_size=32, intermediate_size=64,
                              activation_checkpointing=True, recompute_factors=factors)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(num_cores=4, max_rank=8, embedding_num_cores=2, embedding_max_rank=4))
    ids = torch.randint(0, CFG.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": torch.ones(batch, dtype=torch.long)}


@pytest.mark.parametrize("threads", [1, 2])
def test_recomputed_factors_lower_the_step_peak_by_the_blocks_factors(threads):
    """With ``recompute_factors`` the blocks' ``L``/``R`` are not held from the forward to the end of backward:
    the step's peak drops by at least the factors of all blocks but one (the one being remade). With 2 threads
    too: there the contractions run on one thread (``tensor.smallops``), whose private graph the checkpoint could
    not free."""
    peaks = {}
    for factors in (False, True):
        model, batch = _small_batch_model(factors)
        with torch.no_grad():  # the blocks' factors, as the model-wide contraction makes and keeps them
            block_bytes = [sum(t.nbytes for lr in shared_factors(b).values() for t in lr) for b in model.blocks]
        peaks[factors] = _peak(model, batch, threads)
    assert peaks[False] - peaks[True] >= sum(block_bytes) - max(block_bytes), (peaks, block_bytes)


@pytest.mark.parametrize("factors", [False, True], ids=["zero3-like", "factors"])
def test_the_cpus_one_thread_contractions_keep_nothing_past_the_checkpoint(factors):
    """With several threads the CPU contracts the cores on one thread through a private graph
    (``tensor.smallops``); inside a recomputed block that graph must not hold what the checkpoint drops, so the
    step peaks no higher than with one thread (where the contractions are plain ops), but for the few hundred
    bytes the private graphs outside the blocks hold (the embedding's). ``zero3-like``: the parameters carry
    ZeRO-3's mark, so every layer contracts its own cores inside its block (48 tokens: enough for the ``lr``
    order, which contracts them). Without the outer graph the 2-thread step peaked 0.5 MiB higher in both."""
    peaks = {}
    for threads in (1, 2):
        model, batch = _small_batch_model(factors, batch=4, tokens=12)
        if not factors:
            for p in model.parameters():
                p.ds_id = 0  # layers.group.partitioned: no shared factors, each layer its own
            assert {m.chosen_order(48, 0) for m in model.modules() if isinstance(m, TTLinear)} == {"lr"}
        peaks[threads] = _peak(model, batch, threads)
    assert peaks[2] <= peaks[1] + 4096, peaks


def test_recompute_factors_needs_activation_checkpointing():
    with pytest.raises(ValueError, match=r"^model.recompute_factors needs model.activation_checkpointing: true"):
        dataclasses.replace(CFG, recompute_factors=True)


@pytest.mark.parametrize("factors", [False, True], ids=["model-factors", "recompute-factors"])
def test_each_recomputed_block_runs_on_the_factors_it_contracted(factors, monkeypatch):
    """Each block hands its layers grouped factors, in its forward and its recomputation: the model's (contracted
    once before the blocks), or with ``recompute_factors`` the ones it contracted itself (``shared_factors(block)``).
    No TT layer of a block contracts its own cores (same gradients, more ops), and every FFN is the fused one,
    which needs both layers' factors."""
    _, model = _pair("bert_mlm", SPEC, factors=factors)
    own: list[str] = []
    for i, block in enumerate(model.blocks):
        for name, layer in block.named_modules():
            if isinstance(layer, TTLinear):
                layer.register_forward_pre_hook(
                    lambda mod, args, kwargs, n=f"blocks.{i}.{name}": own.append(n) if kwargs.get("factors") is None
                    else None, with_kwargs=True)
    fused = []
    real = dispatch.tt_ffn
    monkeypatch.setattr(dispatch, "tt_ffn", lambda *a, **k: fused.append(1) or real(*a, **k))
    _loss_and_grads(model, _batch("bert_mlm"))
    assert own == []
    assert len(fused) == 2 * CFG.num_layers  # each block's forward, and its recomputation in backward

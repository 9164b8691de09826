"""``models.cpu_dropout``: the CPU's dropout with a bool mask, and attention's math path with it.

Attention against a float64 reference built from the formula with the same keep mask (output and the
gradients of q, k and v; no mask, key padding, causal), and against SDPA itself with every element kept. What
autograd keeps is measured with saved-tensor hooks (``bench.memory_probe.SavedActivations``): exact byte
counts, then a whole model at batch 1 against PyTorch's own CPU dropout and SDPA math path.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from comera_dist.bench.memory_probe import SavedActivations
from comera_dist.compression.config import TensorizeConfig
from comera_dist.models import ModelConfig, build_model, cpu_dropout

B, H, T, D = 2, 3, 8, 4  # batch, heads, tokens, head size


def _saved_bytes(fn) -> int:
    saved = SavedActivations(nn.Linear(1, 1))  # no parameter of ours is involved
    with saved.record():
        fn()
    return saved.bytes


def test_dropout_keeps_a_share_of_1_minus_p_scaled_and_saves_only_a_bool_mask():
    torch.manual_seed(0)
    x = torch.randn(1000, 1000, requires_grad=True)
    saved = SavedActivations(nn.Linear(1, 1))
    with saved.record():
        y = cpu_dropout.dropout(x, 0.1)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.005  # binomial sd 0.0003
    torch.testing.assert_close(y[kept], x[kept] * (1 / 0.9), rtol=0, atol=0)
    assert saved.bytes == x.numel()  # one byte per element: the bool mask, nothing else
    g = torch.randn_like(x)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(kept, g * (1 / 0.9), 0.0), rtol=0, atol=0)


def test_dropout_is_off_in_eval_at_0_and_reproducible_from_the_seed():
    x = torch.randn(64, 32)
    assert torch.equal(cpu_dropout.dropout(x, 0.1, training=False), x)
    assert torch.equal(cpu_dropout.dropout(x, 0.0), x)
    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(cpu_dropout.dropout(x, 0.3))
    assert torch.equal(*draws) and not torch.equal(draws[0], x)
    module = cpu_dropout.Dropout(0.3)
    assert isinstance(module, nn.Dropout)  # code that looks for nn.Dropout (graph tests) still finds it
    torch.manual_seed(3)
    assert torch.equal(module(x), draws[0])
    assert torch.equal(module.eval()(x), x)


def _reference(q, k, v, keep, mask, p):
    """The formula in float64: softmax(q k^T / sqrt(d), masked) kept by ``keep``, scaled, times v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.where(keep, torch.softmax(scores, dim=-1) / (1 - p), 0.0) @ v


def _mask(kind: str) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """(mask SDPA gets, is_causal, the mask the reference applies)."""
    if kind == "none":
        return None, False, None
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if kind == "causal":
        return None, True, causal
    keys = torch.ones(B, T, dtype=torch.bool)
    keys[1, 5:] = False  # padding keys in row 1
    mask = keys[:, None, None, :] | torch.eye(T, dtype=torch.bool)  # each query sees itself, as blocks does
    return mask, False, mask


@pytest.mark.parametrize("kind", ["none", "padding", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_matches_the_formula_forward_and_backward(kind, dtype):
    gen = torch.Generator().manual_seed(1)
    qkv = [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(3)]
    keep = torch.rand(B, H, T, T, generator=gen) >= 0.25
    mask, is_causal, ref_mask = _mask(kind)
    ours = [t.clone().to(dtype).requires_grad_() for t in qkv]
    ref = [t.clone().requires_grad_() for t in qkv]
    y = cpu_dropout.attention(*ours, mask, 0.25, is_causal, keep=keep)
    want = _reference(*ref, keep, ref_mask, 0.25)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    y.backward(g.to(dtype))
    want.backward(g)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(y.double(), want.detach(), **tol)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol)


@pytest.mark.parametrize("kind", ["none", "padding", "causal"])
def test_attention_with_every_element_kept_is_sdpa_without_dropout_scaled(kind):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    mask, is_causal, _ = _mask(kind)
    keep = torch.ones(B, H, T, T, dtype=torch.bool)
    with torch.enable_grad():
        y = cpu_dropout.attention(q.requires_grad_(), k, v, mask, 0.2, is_causal, keep=keep)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    torch.testing.assert_close(y * 0.8, want, rtol=1e-5, atol=1e-6)


def test_attention_draws_its_mask_and_runs_sdpa_where_its_path_does_not_apply():
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    torch.manual_seed(5)
    y = cpu_dropout.attention(q, k, v, None, 0.5, False)
    torch.manual_seed(5)
    keep = cpu_dropout.keep_mask((B, H, T, T), 0.5, q.device)
    torch.testing.assert_close(y, _reference(q, k, v, keep, None, 0.5), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # a forward-only pass in training mode (the finite-probe) draws the same masks
        torch.manual_seed(5)
        torch.testing.assert_close(cpu_dropout.attention(q, k, v, None, 0.5, False), y.detach(), rtol=0, atol=0)
    with torch.no_grad():  # no backward: SDPA (the CPU's flash kernel without dropout's mask to keep)
        assert torch.equal(cpu_dropout.attention(q, k, v, None, 0.0, False),
                           F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("batch", [1, 2])
def test_attention_keeps_the_softmax_a_bool_mask_and_q_k_v_once(batch):
    """q, k, v as views of one (3, B, T, C) output, as Q, K and V with shared TT factors come. At batch 1
    the (B*h, T, d) operands are views: the shared storage is kept once. At batch 2 they are copies. Against
    SDPA's math path: no scaled copies of q and k, no float dropout mask, no dropped probabilities."""
    out = torch.randn(3, batch, T, H * D, requires_grad=True)
    q, k, v = (t.view(batch, T, H, D).transpose(1, 2) for t in out.unbind(0))
    part, probs = batch * T * H * D * 4, batch * H * T * T * 4
    ours = _saved_bytes(lambda: cpu_dropout.attention(q, k, v, None, 0.1, False))
    sdpa = _saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
    assert ours == 3 * part + probs + probs // 4  # q, k, v + softmax output + bool mask
    # SDPA's math path: q and k scaled copies, v (a view of all three parts at batch 1), softmax output,
    # float mask, dropped probabilities
    assert sdpa == (2 * part) + (3 * part if batch == 1 else part) + 3 * probs


def test_bf16_autocast_runs_forward_and_backward_close_to_fp32():
    gen = torch.Generator().manual_seed(4)
    qkv = [torch.randn(B, H, T, D, generator=gen) for _ in range(3)]
    keep = torch.rand(B, H, T, T, generator=gen) >= 0.1
    grads = []
    for autocast in (False, True):
        leaves = [t.clone().requires_grad_() for t in qkv]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = cpu_dropout.attention(*(t.bfloat16() if autocast else t for t in leaves), None, 0.1, False, keep=keep)
        y.float().sum().backward()
        grads.append([t.grad for t in leaves])
    for fp32, bf16 in zip(*grads, strict=True):
        assert bf16.dtype == torch.float32
        torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.05)


def test_a_model_at_batch_1_keeps_less_than_with_pytorchs_cpu_dropout(monkeypatch):
    """bert_mlm with TT layers, batch 1: per block, attention keeps 2 parts (q and k's scaled copies; v
    shares Q/K/V's storage) and 7 bytes per probability (float mask and dropped probabilities, less the
    bool) less, and each hidden-state dropout (2 per block, 1 after the embeddings) 3 bytes per element."""
    cfg = ModelConfig(arch="bert_mlm", vocab_size=60, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64, max_positions=16, dropout=0.1)
    spec = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)
    torch.manual_seed(0)
    model = build_model(cfg, spec).train()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    kept = {}
    for own in (True, False):
        if not own:
            monkeypatch.setattr(cpu_dropout, "_own_path", lambda *a: False)
        saved = SavedActivations(model)
        with saved.record():
            model(ids, labels=ids)["loss"].backward()
        kept[own] = saved.bytes
    tokens, c, h = 16, cfg.hidden_size, cfg.num_heads
    per_block = 2 * tokens * c * 4 + 7 * h * tokens * tokens + 2 * 3 * tokens * c
    assert kept[False] - kept[True] == cfg.num_layers * per_block + 3 * tokens * c, kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_sdpa_runs_a_fused_kernel_with_dropout(dtype):
    """The premise of leaving accelerators to SDPA: with dropout on, it picks a fused kernel, not the math
    path, and this module's own path stays out."""
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    assert torch._fused_sdp_choice(q, k, v, None, 0.1, False) != SDPBackend.MATH.value
    assert not cpu_dropout._own_path(q, 0.1, True)
    assert cpu_dropout.attention(q, k, v, None, 0.1, False).shape == (B, H, T, D)

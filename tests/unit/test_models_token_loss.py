"""``models.token_loss.token_cross_entropy`` against ``F.cross_entropy`` in fp64, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comera_dist.models import ModelConfig, build_model, token_loss
from comera_dist.models.token_loss import token_cross_entropy


def _case(n: int, v: int, dtype: torch.dtype, ignored: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen) * 4).to(dtype).requires_grad_(True)  # (N, V)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = -100
    return logits, labels


def _reference(logits, labels):
    """fp64 cross-entropy of the same (rounded) logits: loss and d loss / d logits."""
    ref = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(ref, labels, ignore_index=-100)
    loss.backward()
    return loss.detach(), ref.grad


@pytest.mark.parametrize("block_rows", [None, 1, 7, 64])
def test_fp32_matches_cross_entropy_forward_and_backward(block_rows):
    logits, labels = _case(50, 33, torch.float32, ignored=0.3)
    loss = token_cross_entropy(logits, labels, block_rows=block_rows)
    loss.backward(torch.tensor(2.5))
    want_loss, want_grad = _reference(logits, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), 2.5 * want_grad, rtol=1e-5, atol=1e-7)
    assert (logits.grad[labels == -100] == 0).all()  # ignored rows get no gradient


def test_bf16_logits_lose_nothing_beyond_the_gradient_rounding():
    """The arithmetic is fp32, as with ``F.cross_entropy(logits.float())``: the loss is that value, and the
    bf16 gradient is the fp64 gradient rounded to bf16 (within one bf16 ulp of it)."""
    logits, labels = _case(40, 300, torch.bfloat16, ignored=0.2, seed=1)
    loss = token_cross_entropy(logits, labels, block_rows=9)
    loss.backward()
    want_loss, want_grad = _reference(logits, labels)
    fp32 = F.cross_entropy(logits.detach().float(), labels, ignore_index=-100)
    torch.testing.assert_close(loss, fp32, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == torch.bfloat16
    err = (logits.grad.double() - want_grad).abs()
    assert (err <= want_grad.abs() * 2 ** -8 + 1e-12).all(), err.max()


def test_every_label_ignored_gives_nan_like_cross_entropy():
    logits, labels = _case(4, 5, torch.float32, ignored=1.0)
    assert torch.isnan(token_cross_entropy(logits, labels))
    assert torch.isnan(F.cross_entropy(logits, labels, ignore_index=-100))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\(N, V\).*\(2, 3, 4\)"):
        token_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(5,\)"):
        token_cross_entropy(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))


def test_compiles_without_graph_breaks():
    logits, labels = _case(12, 10, torch.float32, ignored=0.25, seed=2)
    fn = torch.compile(lambda x, y: token_cross_entropy(x, y, block_rows=5), fullgraph=True, backend="aot_eager")
    loss = fn(logits, labels)
    loss.backward()
    want_loss, want_grad = _reference(logits, labels)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), want_grad, rtol=1e-5, atol=1e-7)


def test_keeps_no_fp32_copy_of_the_logits_for_backward():
    """What autograd saves: the logits themselves and per-row vectors, never an (N, V) fp32 tensor."""
    logits, labels = _case(64, 128, torch.bfloat16, ignored=0.0, seed=3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_cross_entropy(logits, labels)
    full = [t for t in saved if t.shape == logits.shape]
    assert full and all(t.dtype == torch.bfloat16 for t in full), [(t.shape, t.dtype) for t in saved]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        saved.clear()
        F.cross_entropy(logits.float(), labels)  # the contrast: the old path saves an fp32 (N, V)
    assert any(t.shape == logits.shape and t.dtype == torch.float32 for t in saved)


def test_a_custom_ignore_index_is_what_is_left_out_forward_and_backward():
    """``ignore_index`` other than -100 (here a real class id, 3): those rows neither count in the mean nor get a
    gradient, exactly as ``F.cross_entropy(..., ignore_index=3)``."""
    logits, labels = _case(30, 6, torch.float32, ignored=0.0, seed=4)
    labels[::3] = 3
    loss = token_cross_entropy(logits, labels, ignore_index=3, block_rows=4)
    loss.backward()
    ref = logits.detach().double().requires_grad_(True)
    want = F.cross_entropy(ref, labels, ignore_index=3)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)
    assert (logits.grad[labels == 3] == 0).all()


@pytest.mark.parametrize("block_rows, want", [(7, 7), (None, 4096)])
def test_rows_are_upcast_a_block_at_a_time(block_rows, want, monkeypatch):
    """The memory bound: forward and backward upcast at most ``block_rows`` rows at once (default
    ``BLOCK_ELEMENTS // V``: 4,096 rows of a 4,096-wide vocabulary)."""
    logits, labels = _case(4096 + 50, 4096, torch.bfloat16, ignored=0.1, seed=5) if block_rows is None \
        else _case(50, 33, torch.float32, ignored=0.1)
    seen = []
    for name in ("log_softmax", "softmax"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda x, *a, real=real, **k: seen.append(x.shape[0]) or real(x, *a, **k))
    token_loss.token_cross_entropy(logits, labels, block_rows=block_rows).backward()
    assert max(seen) == want and sum(seen) == 2 * logits.shape[0], seen


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
def test_a_bf16_models_loss_is_fp32(arch):
    """Every arch computes its loss in fp32 from bf16 logits (the six-encoder through ``F.cross_entropy`` of
    the upcast logits, the others through ``token_cross_entropy``)."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                      max_positions=8, dropout=0.0, num_labels=3)
    model = build_model(cfg, None).to(torch.bfloat16)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=torch.tensor([0, 2]) if arch == "six_encoder_cls" else ids)
    assert out["logits"].dtype == torch.bfloat16 and out["loss"].dtype == torch.float32
    want = F.cross_entropy(out["logits"].detach().float().reshape(-1, out["logits"].shape[-1]),
                           torch.tensor([0, 2]) if arch == "six_encoder_cls"
                           else F.pad(ids[:, 1:], (0, 1), value=-100).reshape(-1) if arch == "gpt" else ids.reshape(-1))
    torch.testing.assert_close(out["loss"], want, rtol=1e-6, atol=1e-6)

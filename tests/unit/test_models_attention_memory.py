"""What attention keeps for backward: with shared TT factors Q, K and V are views of one ``(3, B, T, C)`` output,
and at batch 1 SDPA's math path (the CPU's, dropout on) keeps ``v`` as given, so ``blocks`` hands it a ``v`` of
its own. Measured with saved-tensor hooks (``bench.memory_probe.SavedActivations``): at batch 1 the model keeps
2 of the 3 parts less per block, with the same loss and gradients; at batch 2 the math path copies ``v`` itself,
and nothing changes. On a GPU the fused attention kernels keep q, k and v alike, and nothing is copied (the CUDA
case needs a GPU: ``launch/gpu_check.sh``'s kernel-tests run this file)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from comera_dist.bench.memory_probe import SavedActivations
from comera_dist.compression.config import TensorizeConfig
from comera_dist.models import ModelConfig, blocks, build_model

CFG = ModelConfig(arch="bert_mlm", vocab_size=60, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                  max_positions=16, dropout=0.1)
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)
T = 16


def _qkv(batch: int = 1, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    out = torch.randn(3, batch, T, 32, device=device, requires_grad=True) * 1.0  # one storage, as the shared side makes it
    return tuple(t.view(batch, T, 2, 16).transpose(1, 2) for t in out.unbind(0))  # (B, h, T, C/h) views


def test_v_gets_its_own_storage_only_where_the_math_path_would_keep_a_view_of_the_shared_output():
    q, k, v = _qkv()
    own = blocks._own_storage_for_math_path(q, k, v, None, 0.1, False)  # CPU with dropout: the math path
    assert own.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    assert own.untyped_storage().nbytes() == v.numel() * 4 and torch.equal(own, v) and own.requires_grad
    assert blocks._own_storage_for_math_path(q, k, v, None, 0.0, False) is v  # CPU flash keeps q, k, v alike
    with torch.no_grad():
        assert blocks._own_storage_for_math_path(q, k, v, None, 0.1, False) is v  # nothing kept: no copy
    alone = v.detach().clone().requires_grad_()
    assert blocks._own_storage_for_math_path(q, k, alone, None, 0.1, False) is alone  # already its own
    q, k, v = _qkv(batch=2)
    assert blocks._own_storage_for_math_path(q, k, v, None, 0.1, False) is v  # the math path copies it


@pytest.mark.parametrize("spec,batch", [(SPEC, 1), (SPEC, 2), (None, 1)], ids=["tt-b1", "tt-b2", "dense-b1"])
def test_attention_at_batch_1_keeps_two_parts_less_per_block_with_the_same_gradients(monkeypatch, spec, batch):
    torch.manual_seed(0)
    model = build_model(CFG, spec).train()
    ids = torch.randint(0, CFG.vocab_size, (batch, T), generator=torch.Generator().manual_seed(1))
    runs = []
    for own in (True, False):
        if not own:
            monkeypatch.setattr(blocks, "_own_storage_for_math_path", lambda q, k, v, *a: v)
        model.zero_grad()
        saved = SavedActivations(model)
        torch.manual_seed(7)  # the same dropout masks
        with saved.record():
            loss = model(ids, labels=ids)["loss"]
        loss.backward()
        runs.append((saved.bytes, loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (kept_own, loss_own, grads_own), (kept_view, loss_view, grads_view) = runs
    torch.testing.assert_close(loss_own, loss_view, rtol=0, atol=0)
    for a, b in zip(grads_own, grads_view, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    part = T * CFG.hidden_size * 4  # one of Q, K, V in fp32 at batch 1
    # TT at batch 1: Q, K, V share one output (one storage), of which v alone stays; at batch 2 the math
    # path keeps its own copy of v; dense: three outputs, no copy
    assert kept_view - kept_own == (2 * part * CFG.num_layers if spec and batch == 1 else 0), (kept_view, kept_own)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_math_path_keeps_v_as_given_at_batch_1_only(batch):
    """The premise, torch's own: if this CPU build's math path started copying v at batch 1 too, the copy
    would be waste; if it kept a view at batch 2, the copy would be wanted there."""
    q, k, v = _qkv(batch)
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert (v.untyped_storage().data_ptr() in saved) == (batch == 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_fused_attention_keeps_q_k_v_alike_and_v_is_not_copied(dtype):
    q, k, v = (t.to(dtype) for t in _qkv(device="cuda"))
    assert torch._fused_sdp_choice(q, k, v, None, 0.1, False) != SDPBackend.MATH.value
    assert blocks._own_storage_for_math_path(q, k, v, None, 0.1, False) is v

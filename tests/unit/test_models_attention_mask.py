"""No attention mask (what the collators now give): SDPA gets none, and the result equals an all-ones mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comera_dist.models import build_model
from comera_dist.models.config import ModelConfig


def _tiny(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=30, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                       max_positions=8, num_labels=3, dropout=0.0)


@pytest.mark.parametrize("arch", ["six_encoder_cls", "gpt"])
def test_no_mask_reaches_sdpa_as_none_and_equals_all_ones(arch, monkeypatch):
    torch.manual_seed(0)
    model = build_model(_tiny(arch), None).eval()
    ids = torch.randint(0, 30, (2, 8))
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    free = model(ids)["logits"]
    assert seen and all(m is None for m in seen)  # flash / memory-efficient kernels stay eligible
    ones = model(ids, attention_mask=torch.ones_like(ids))["logits"]
    assert seen[-1] is not None  # a given mask is honoured
    torch.testing.assert_close(free, ones, rtol=1e-5, atol=1e-6)


def test_a_real_padding_mask_still_hides_padded_keys():
    torch.manual_seed(0)
    model = build_model(_tiny("six_encoder_cls"), None).eval()
    ids = torch.randint(1, 30, (1, 8))
    other = ids.clone()
    other[0, 6:] = 0  # different tokens where the mask says padding
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    a, b = model(ids, attention_mask=mask)["logits"], model(other, attention_mask=mask)["logits"]
    torch.testing.assert_close(a, b)
    assert not torch.allclose(model(ids)["logits"], model(other)["logits"])

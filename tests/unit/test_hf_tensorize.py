"""HF -> TT conversion on tiny random transformers models built from configs (no download).

Models run in float64 so that a full-rank TT-SVD reproduces the logits to ~1e-12; the
configs use initializer_range 0.2 so every layer moves the logits (with HF's 0.02 the
blocks barely matter and an equality test would prove little).
"""

import copy
import dataclasses

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.pytorch_utils import Conv1D

from comera_dist.compression.config import TensorizeConfig
from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.models.factory import FULL_RANK
from comera_dist.models.hf import FusedQKV, densify, mapped_layers, tensorize

FULL = TensorizeConfig(num_cores=4, max_rank=FULL_RANK, embedding_num_cores=2, embedding_max_rank=FULL_RANK)
V = 60


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "bert":
        m = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=16, initializer_range=0.2))
    elif name == "bert_cls":
        m = BertForSequenceClassification(BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=3,
                                                     max_position_embeddings=16, initializer_range=0.2))
    elif name == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                       bos_token_id=0, eos_token_id=0, initializer_range=0.2))
    else:  # grouped-query attention: K/V are 16 -> 8
        m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16,
                                         initializer_range=0.2, tie_word_embeddings=(name == "llama_tied")))
    return m.double().eval()


IDS = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
NAMES = ["bert", "bert_cls", "gpt2", "llama", "llama_tied"]


@pytest.mark.parametrize("name", NAMES)
def test_full_rank_svd_gives_equal_logits(name):
    dense = make(name)
    ref = dense(IDS).logits
    tt = tensorize(copy.deepcopy(dense), FULL, init="svd").eval()
    for layer, _kind, _shape in mapped_layers(tt):
        assert isinstance(tt.get_submodule(layer), (TTLinear, FusedQKV)), layer
    assert isinstance(tt.get_input_embeddings(), TTEmbedding)
    assert sum(isinstance(m, TTLinear) for m in tt.modules()) == (14 if name.startswith("llama") else 12) + \
        (1 if name == "bert_cls" else 0)  # GPT-2's c_attn counts as three
    out = tt(IDS).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    # Not vacuous: random TT cores change the logits by far more than the tolerance.
    scratch = tensorize(copy.deepcopy(dense), FULL, init="random").eval()
    assert (scratch(IDS).logits - ref).abs().max() > 1e-2


# Tied models stay tied when tensorized: tests/unit/test_hf_tied.py.


def test_gpt2_conv1d_and_fused_qkv_round_trip_through_densify():
    dense = make("gpt2")
    tt = tensorize(copy.deepcopy(dense), FULL)
    qkv = tt.transformer.h[0].attn.c_attn
    assert isinstance(qkv, FusedQKV) and all(p.in_features == p.out_features == 16 for p in (qkv.q, qkv.k, qkv.v))
    back = densify(tt)
    assert isinstance(back.transformer.h[1].attn.c_attn, Conv1D) and isinstance(back.transformer.h[1].mlp.c_fc, Conv1D)
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=1e-12, msg=key)
    assert isinstance(tt.transformer.h[0].attn.c_attn, FusedQKV)  # densify copies, the TT model is untouched


def test_only_enabled_kinds_and_mode_overrides():
    spec = dataclasses.replace(FULL, embedding=False, attention=False, modes={"ffn_in": [[2, 8], [8, 4]]})
    tt = tensorize(make("llama"), spec)
    layer = tt.model.layers[0]
    assert isinstance(layer.mlp.up_proj, TTLinear) and layer.mlp.up_proj.in_modes == [2, 8]
    assert layer.mlp.up_proj.out_modes == [8, 4] and isinstance(layer.mlp.down_proj, TTLinear)
    assert isinstance(layer.self_attn.q_proj, nn.Linear) and isinstance(tt.model.embed_tokens, nn.Embedding)
    # An attention override for 16x16 applies to Q/O; the GQA K/V (16x8) get automatic modes.
    tt = tensorize(make("llama"), dataclasses.replace(FULL, modes={"attention": [[2, 8], [8, 2]]}))
    attn = tt.model.layers[1].self_attn
    assert attn.q_proj.out_modes == [8, 2] and attn.o_proj.in_modes == [2, 8] and attn.k_proj.out_features == 8


def test_truncated_svd_is_smaller_and_closer_than_random():
    dense = make("bert")
    ref = dense(IDS).logits
    small = dataclasses.replace(FULL, max_rank=3, embedding_max_rank=8)
    tt = tensorize(copy.deepcopy(dense), small).eval()
    layers = [m for m in tt.modules() if isinstance(m, (TTLinear, TTEmbedding))]
    assert all(max(m.full_ranks()) <= 8 for m in layers) and max(layers[-1].full_ranks()) <= 3
    assert sum(m.param_count() for m in layers) < 0.5 * sum(m.dense_param_count() for m in layers)
    scratch = tensorize(copy.deepcopy(dense), small, init="random").eval()
    assert (tt(IDS).logits - ref).norm() < (scratch(IDS).logits - ref).norm()


def test_bad_models_and_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="tensorize supports .*got Linear"):
        tensorize(nn.Linear(2, 2), FULL)
    with pytest.raises(ValueError, match="init must be 'svd' or 'random', got 'zeros'"):
        tensorize(make("bert"), FULL, init="zeros")
    broken = make("bert")
    broken.bert.encoder.layer[1].intermediate.dense = nn.Linear(16, 24)
    with pytest.raises(ValueError, match=r"bert.encoder.layer.1.intermediate.dense: expected nn.Linear\(16, 32\)"):
        tensorize(broken, FULL)
    with pytest.raises(ValueError, match=r"tensorize.modes\['ffn_out'\].*factorizes 16x16"):
        tensorize(make("gpt2"), dataclasses.replace(FULL, modes={"ffn_out": [[4, 4], [4, 4]]}))
    # Nothing was replaced by the calls that failed.
    assert not any(isinstance(m, (TTLinear, TTEmbedding)) for m in broken.modules())
    gpt2 = make("gpt2")
    with pytest.raises(ValueError, match=r"tensorize.modes\['embedding'\].*cannot hold a 60x16 table"):
        tensorize(gpt2, dataclasses.replace(FULL, modes={"embedding": [[7, 8], [4, 4]]}))
    assert not any(isinstance(m, (TTLinear, TTEmbedding, FusedQKV)) for m in gpt2.modules())


@pytest.mark.parametrize("name", NAMES)
def test_tensorized_hf_models_hold_no_parameter_list(name):
    """The HF route builds the same layer classes as the native models, so the guard of
    ``test_compile_fullgraph.test_no_model_holds_a_parameter_list`` (torch 2.11's Dynamo cannot
    unpack an ``nn.ParameterList``) must hold for it too, fused QKV and tied heads included."""
    tt = tensorize(make(name), TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=3))
    assert any(isinstance(m, TTLinear) for m in tt.modules()) and any(isinstance(m, TTEmbedding) for m in tt.modules())
    assert not [n for n, m in tt.named_modules() if isinstance(m, nn.ParameterList)]

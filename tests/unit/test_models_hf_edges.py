"""HF conversion edges the round-trip tests do not reach: GPT-2 ``n_inner``, Llama's explicit ``head_dim``, a
mode override on GPT-2's fused Q/K/V, biases under ``init="random"``, and a compact file missing a tensor.
Tiny float64 random models built from configs (no download)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from comera_dist.compression.config import TensorizeConfig
from comera_dist.layers import TTLinear
from comera_dist.models import ModelConfig, build_model
from comera_dist.models.export import export_dense, to_hf
from comera_dist.models.factory import FULL_RANK
from comera_dist.models.hf import FusedQKV, mapped_layers, tensorize
from comera_dist.models.tt_io import load_tt, save_tt

V = 60
IDS = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
FULL = TensorizeConfig(num_cores=4, max_rank=FULL_RANK, embedding_num_cores=2, embedding_max_rank=FULL_RANK)
SMALL = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=5)


def _logits(model):
    with torch.no_grad():
        out = model(IDS)
    return out["logits"] if isinstance(out, dict) else out.logits


def test_gpt2_with_an_inner_width_other_than_4d_tensorizes_exactly():
    """Our GPT exports with ``n_inner = intermediate_size`` (here 32, not 4 * 16): the key map reads it."""
    torch.manual_seed(0)
    ours = build_model(ModelConfig(arch="gpt", vocab_size=V, hidden_size=16, num_layers=2, num_heads=2,
                                   intermediate_size=32, max_positions=16, dropout=0.0, init_std=0.2), None)
    hf = to_hf(ours.double().eval())
    assert ("transformer.h.0.mlp.c_fc", "ffn_in", (16, 32)) in mapped_layers(hf)
    tt = tensorize(copy.deepcopy(hf), FULL).eval()
    torch.testing.assert_close(_logits(tt), _logits(hf), rtol=0, atol=1e-10)


def test_llama_with_an_explicit_head_dim_tensorizes_exactly():
    """``head_dim`` 8 with 4 heads of a 16-wide model: Q is 16 -> 32, K/V 16 -> 16, O 32 -> 16."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, max_position_embeddings=16, initializer_range=0.2)).double().eval()
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (32, 16)
    tt = tensorize(copy.deepcopy(hf), FULL).eval()
    assert tt.model.layers[0].self_attn.o_proj.in_features == 32
    torch.testing.assert_close(_logits(tt), _logits(hf), rtol=0, atol=1e-10)


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
        initializer_range=0.2)).double().eval()


def test_an_attention_override_applies_to_each_of_gpt2s_fused_q_k_v():
    tt = tensorize(_gpt2(), dataclasses.replace(FULL, modes={"attention": [[2, 8], [8, 2]]}))
    qkv = tt.transformer.h[0].attn.c_attn
    assert isinstance(qkv, FusedQKV)
    assert all(p.in_modes == [2, 8] and p.out_modes == [8, 2] for p in (qkv.q, qkv.k, qkv.v))
    assert tt.transformer.h[0].attn.c_proj.in_modes == [2, 8]


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_random_init_keeps_the_dense_biases(name):
    torch.manual_seed(0)
    dense = _gpt2() if name == "gpt2" else transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, initializer_range=0.2)).double().eval()
    with torch.no_grad():
        for p in dense.parameters():
            if p.dim() == 1:
                p.normal_()  # HF initializes biases to zero: make them tell
    tt = tensorize(copy.deepcopy(dense), SMALL, init="random")
    checked = 0
    for layer, _kind, _shape in mapped_layers(tt):
        new, old = tt.get_submodule(layer), dense.get_submodule(layer)
        parts = [new.q, new.k, new.v] if isinstance(new, FusedQKV) else [new]
        assert all(isinstance(p, TTLinear) for p in parts)
        torch.testing.assert_close(torch.cat([p.bias for p in parts]), old.bias, rtol=0, atol=0)
        checked += 1
    assert checked == len(mapped_layers(dense)) > 0


def test_load_tt_of_a_file_missing_a_tensor_is_an_error_naming_it(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="gpt", vocab_size=V, hidden_size=16, num_layers=1, num_heads=2,
                                    intermediate_size=32, max_positions=16), SMALL)
    save_tt(model, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["norm.bias"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not match the recorded model: missing \['norm.bias'\]"):
        load_tt(tmp_path)


def test_save_tt_load_tt_round_trips_a_tensorized_llama_without_biases(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, max_position_embeddings=16, initializer_range=0.2)).double().eval()
    tt = tensorize(hf, SMALL)
    assert tt.model.layers[0].self_attn.q_proj.bias is None
    save_tt(tt, tmp_path)
    back = load_tt(tmp_path)
    assert back.model.layers[0].self_attn.q_proj.bias is None
    torch.testing.assert_close(_logits(back), _logits(tt), rtol=0, atol=0)


def _ours(arch: str, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                      max_positions=16, num_labels=3, init_std=0.2, **kw)
    return build_model(cfg, None).double().eval()


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
def test_the_exported_config_carries_dropout_and_layernorm_eps(arch):
    """A fine-tuning run of the export trains with our dropout; its LayerNorms use our eps (1e-5 here, not
    BERT's default 1e-12), so the logits agree."""
    model = _ours(arch, dropout=0.3, layer_norm_eps=1e-5)
    hf = to_hf(model)
    c = hf.config
    if arch == "gpt":
        assert (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop, c.layer_norm_epsilon) == (0.3, 0.3, 0.3, 1e-5)
    else:
        assert (c.hidden_dropout_prob, c.attention_probs_dropout_prob, c.layer_norm_eps) == (0.3, 0.3, 1e-5)
    torch.testing.assert_close(_logits(hf), _logits(model), rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ["bert_mlm", "gpt"])
def test_an_untied_model_exports_untied(arch, tmp_path):
    model = _ours(arch, tie_word_embeddings=False)
    export_dense(model, tmp_path)
    auto = transformers.AutoModelForMaskedLM if arch == "bert_mlm" else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert loaded.config.tie_word_embeddings is False
    assert loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-10)

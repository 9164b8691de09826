"""Tied heads through HF: our tied TT models export as standard tied models; tensorizing a tied HF model keeps
it tied (models/export.py, models/hf.py). Float64 tiny random models built from configs (no download)."""

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from comera_dist.compression.config import TensorizeConfig
from comera_dist.layers import TiedTTHead, TTEmbedding
from comera_dist.models import ModelConfig, build_model
from comera_dist.models.export import export_dense
from comera_dist.models.factory import FULL_RANK
from comera_dist.models.hf import densify, tensorize
from comera_dist.models.tt_io import load_tt, save_tt

V = 61  # not a product of small modes: the TTM pads its rows, the logits must not
IDS = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(5))
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=3, embedding_max_rank=5)
FULL = TensorizeConfig(num_cores=4, max_rank=FULL_RANK, embedding_num_cores=2, embedding_max_rank=FULL_RANK)


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out["logits"] if isinstance(out, dict) else out.logits


@pytest.mark.parametrize("arch", ["bert_mlm", "gpt"])
def test_our_tied_tt_model_exports_a_standard_tied_hf_model(arch, tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                      max_positions=16, init_std=0.2, type_vocab_size=0)
    model = build_model(cfg, SPEC).double().eval()
    head = model.head.decoder if arch == "bert_mlm" else model.lm_head
    word = model.embeddings.word if arch == "bert_mlm" else model.word
    assert isinstance(head, TiedTTHead) and head.embedding is word and isinstance(word, TTEmbedding)
    if head.bias is not None:
        with torch.no_grad():
            head.bias.normal_()
    ref = _logits(model)
    assert ref.shape == (2, 9, V)
    export_dense(model, tmp_path / "hf")
    auto = AutoModelForMaskedLM if arch == "bert_mlm" else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path / "hf", torch_dtype=torch.float64).eval()
    assert type(loaded).__name__ == ("BertForMaskedLM" if arch == "bert_mlm" else "GPT2LMHeadModel")
    assert loaded.config.tie_word_embeddings is True
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=1e-10)
    # The compact TT format rebuilds the tie too.
    save_tt(model, tmp_path / "tt")
    back = load_tt(tmp_path / "tt").double().eval()
    torch.testing.assert_close(_logits(back), ref, rtol=0, atol=1e-12)


def _hf(name):
    torch.manual_seed(0)
    if name == "bert":
        m = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=16, initializer_range=0.2))
        with torch.no_grad():
            m.cls.predictions.bias.normal_()
    elif name == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                       bos_token_id=0, eos_token_id=0, initializer_range=0.2))
    else:
        m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16,
                                         initializer_range=0.2, tie_word_embeddings=True))
    return m.double().eval()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama_tied"])
def test_tensorizing_a_tied_hf_model_keeps_it_tied(name, tmp_path):
    dense = _hf(name)
    assert dense.get_output_embeddings().weight is dense.get_input_embeddings().weight
    ref = _logits(dense)
    tt = tensorize(copy.deepcopy(dense), FULL)  # full rank: exact
    emb, head = tt.get_input_embeddings(), tt.get_output_embeddings()
    assert isinstance(emb, TTEmbedding) and isinstance(head, TiedTTHead) and head.embedding is emb
    assert tt.config.tie_word_embeddings is True
    if name == "bert":
        assert head.bias is tt.cls.predictions.bias  # HF's decoder-bias tie is kept
    torch.testing.assert_close(_logits(tt), ref, rtol=0, atol=1e-10)
    tt.tie_weights()  # HF re-tying leaves the TT table and the tied head alone
    assert tt.get_input_embeddings() is emb and tt.get_output_embeddings() is head
    assert not any(p.shape in ((V, 16), (16, V)) for p in tt.parameters())  # no dense table or head left
    # Training moves the head with the embedding: one gradient, into the shared cores.
    _logits_grad = (tt(IDS).logits ** 2).mean()
    _logits_grad.backward()
    assert emb.core.grad is not None and all(g.abs().sum() > 0 for g in emb.split_cores(emb.core.grad))
    # densify -> a standard weight-tied dense model with the same logits; export reloads tied.
    back = densify(tt)
    assert back.get_output_embeddings().weight is back.get_input_embeddings().weight
    torch.testing.assert_close(_logits(back), ref, rtol=0, atol=1e-10)
    export_dense(tt, tmp_path)
    auto = AutoModelForMaskedLM if name == "bert" else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert loaded.config.tie_word_embeddings is True
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=1e-10)


def test_save_tt_load_tt_keeps_a_tensorized_hf_model_tied(tmp_path):
    tt = tensorize(_hf("bert"), SPEC)
    ref = _logits(tt)
    save_tt(tt, tmp_path)
    back = load_tt(tmp_path).double()
    head = back.get_output_embeddings()
    assert isinstance(head, TiedTTHead) and head.embedding is back.get_input_embeddings()
    assert head.bias is back.cls.predictions.bias
    torch.testing.assert_close(_logits(back), ref, rtol=0, atol=1e-12)

"""The paper's six-encoder sizes (comera-method.md section 6), counted through the real model.

The TT model is small enough to build for real (about 1.5 M parameters); the dense
baseline (67 M) is built on the meta device, where only shapes exist.
"""

import pytest
import torch

from comera_dist.compression.config import TensorizeConfig
from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.models import build_model, count_params, tensorized_modules
from comera_dist.models.presets import (
    PAPER_EMBEDDING_MAX_RANK,
    PAPER_MAX_RANK,
    PAPER_MODES,
    six_encoder_paper,
)

SPEC = TensorizeConfig(max_rank=PAPER_MAX_RANK, embedding_max_rank=PAPER_EMBEDDING_MAX_RANK, modes=PAPER_MODES)


@pytest.fixture(scope="module")
def tt_model():
    torch.manual_seed(0)
    return build_model(six_encoder_paper(), SPEC)


def test_per_layer_tt_sizes_match_the_paper_table(tt_model):
    layers = tensorized_modules(tt_model)
    emb = layers["embeddings.word"]
    assert isinstance(emb, TTEmbedding)
    assert emb.full_ranks() == [1, 32, 32, 32, 1]
    assert emb.param_count() == 167_808 and emb.dense_param_count() == 23_440_896
    for i in range(6):
        for name in ("query", "key", "value", "out"):
            layer = layers[f"blocks.{i}.attn.{name}"]
            assert layer.in_modes == [12, 8, 8] and layer.out_modes == [8, 8, 12]
            assert layer.full_ranks() == [1, 12, 30, 30, 30, 12, 1]
            assert layer.param_count() == 20_448 and layer.dense_param_count() == 589_824
        ffn_in, ffn_out = layers[f"blocks.{i}.ffn.inp"], layers[f"blocks.{i}.ffn.out"]
        assert ffn_in.full_ranks() == [1, 12, 30, 30, 30, 16, 1]
        assert ffn_out.full_ranks() == [1, 16, 30, 30, 30, 12, 1]
        assert ffn_in.param_count() == ffn_out.param_count() == 28_960
        assert ffn_in.dense_param_count() == ffn_out.dense_param_count() == 2_359_296


def test_encoder_and_whole_model_totals(tt_model):
    layers = tensorized_modules(tt_model)
    encoder = [m for n, m in layers.items() if n.startswith("blocks.")]
    assert len(encoder) == 36 and all(isinstance(m, TTLinear) for m in encoder)
    encoder_tt = sum(m.param_count() for m in encoder)
    encoder_dense = sum(m.dense_param_count() for m in encoder)
    assert encoder_tt == 838_272 and encoder_dense == 42_467_328
    assert round(encoder_dense / encoder_tt, 1) == 50.7

    # Whole model, TT: cores 167,808 (embedding) + 838,272 (encoder) + 20,448 (the d x d pooler, an
    # "attention"-kind layer) = 1,026,528; dense leftovers: positions 512*768 = 393,216, token types
    # 2*768 = 1,536, 13 LayerNorms 13*1,536 = 19,968, biases 6*(4*768 + 3072 + 768) + 768 (pooler)
    # = 42,240, classifier 768*3 + 3 = 2,307 -> 459,267. Sum 1,485,795 ("about 1.49 M"); the rank
    # gates add 6*(4*114 + 2*118) + 114 + 96 = 4,362 trainable scalars -> 1,490,157.
    cores = sum(m.param_count() for m in layers.values())
    gates = sum(g.numel() for m in layers.values() for g in m.gates)
    assert cores == 1_026_528 and gates == 4_362
    assert count_params(tt_model) == 1_490_157
    assert count_params(tt_model) - gates == 1_485_795

    # Dense: the same model with every layer dense = BERT-base cut to 6 blocks with 3 labels:
    # 1,485,795 - 1,026,528 + 23,440,896 + 42,467,328 + 589,824 = 66,957,315 ("about 66.96 M").
    with torch.device("meta"):
        dense = build_model(six_encoder_paper(), None)
    assert count_params(dense) == 66_957_315
    assert count_params(dense) - (count_params(tt_model) - gates) == (23_440_896 - 167_808) + (
        42_467_328 - 838_272) + (589_824 - 20_448)


def test_paper_totals_need_bert_position_table():
    # The paper trains on 128-token sequences; its whole-model figures only come out with BERT's
    # 512-row position table. A 128-row table (configs/six-encoder.yaml) removes 384*768 = 294,912
    # dense parameters from both counts: 1,195,245 TT (with gates) vs 66,662,403 dense.
    with torch.device("meta"):
        dense = build_model(six_encoder_paper(max_positions=128), None)
        tt = build_model(six_encoder_paper(max_positions=128), SPEC)
    assert count_params(dense) == 66_957_315 - 294_912 == 66_662_403
    assert count_params(tt) == 1_490_157 - 294_912 == 1_195_245


def test_the_paper_preset_is_bert_base_shaped():
    """BERT-base's layout at six blocks (BERT's LayerNorm eps and dropout, two segments)."""
    cfg = six_encoder_paper()
    assert (cfg.arch, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers) == \
        ("six_encoder_cls", 768, 12, 3072, 30522, 6)
    assert (cfg.layer_norm_eps, cfg.dropout, cfg.type_vocab_size, cfg.max_positions, cfg.num_labels) == \
        (1e-12, 0.1, 2, 512, 3)

"""The six-encoder paper model's exact sizes (comera-method.md section 6) from the layers' own accounting."""

import pytest
import torch

from comera_dist.layers import TTEmbedding, TTLinear


def _attn():
    return TTLinear(768, 768, num_cores=6, max_rank=30)


def _ffn_in():
    return TTLinear(768, 3072, num_cores=6, max_rank=30)


def _ffn_out():
    return TTLinear(3072, 768, num_cores=6, max_rank=30)


def test_word_embedding_ttm():
    emb = TTEmbedding(30522, 768, row_modes=[16, 20, 10, 10], col_modes=[4, 4, 8, 6], max_rank=32)
    assert emb.full_ranks() == [1, 32, 32, 32, 1]
    assert emb.param_count() == 167_808  # counts m_k * n_k (the reference forgets n_k: 31,552)
    assert emb.dense_param_count() == 23_440_896


@pytest.mark.parametrize("make, in_modes, out_modes, ranks, params, dense", [
    (_attn, [12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1], 20_448, 589_824),
    (_ffn_in, [12, 8, 8], [12, 16, 16], [1, 12, 30, 30, 30, 16, 1], 28_960, 2_359_296),
    (_ffn_out, [16, 16, 12], [8, 8, 12], [1, 16, 30, 30, 30, 12, 1], 28_960, 2_359_296),
])
def test_tt_layers_with_automatic_modes(make, in_modes, out_modes, ranks, params, dense):
    layer = make()
    assert (layer.in_modes, layer.out_modes, layer.full_ranks()) == (in_modes, out_modes, ranks)
    assert layer.param_count() == params == sum(c.numel() for c in layer.cores)
    assert layer.dense_param_count() == dense


def test_encoder_total_six_blocks():
    block = [_attn() for _ in range(4)] + [_ffn_in(), _ffn_out()]
    per_block = sum(layer.param_count() for layer in block)
    dense_block = sum(layer.dense_param_count() for layer in block)
    assert 6 * per_block == 838_272
    assert 6 * dense_block == 42_467_328
    assert round(dense_block / per_block, 1) == 50.7


def test_sizes_shrink_with_dead_ranks():
    layer = _attn()
    with torch.no_grad():
        layer.gates[2][:10] = 0.0  # bond 2 (between cores 2 and 3) keeps 20 of 30
    assert layer.ranks()[2] == 20
    assert layer.param_count(active=True) == 20_448 - 10 * 8 * 30 - 30 * 8 * 10
    assert layer.param_count(active=False) == 20_448

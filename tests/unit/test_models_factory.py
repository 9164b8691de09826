"""``models.factory`` and ``models.build``: what each layer is built from (init scale, tied head's bias,
embedding cores) and how ``tensorize.modes`` overrides are checked per kind. Tiny CPU models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from comera_dist.compression.config import TensorizeConfig
from comera_dist.models import ModelConfig, build_model
from comera_dist.models.build import tt_shapes_by_kind

TINY = ModelConfig(arch="gpt", vocab_size=60, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                   max_positions=12, dropout=0.0)
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)


def test_dense_layers_and_tables_are_drawn_at_the_configured_std():
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(TINY, vocab_size=500, hidden_size=64, intermediate_size=256,
                                            init_std=0.2), None)
    for name in ("word.weight", "position.weight", "blocks.0.ffn.inp.weight", "blocks.1.attn.query.weight"):
        std = dict(model.named_parameters())[name].std().item()
        assert 0.18 < std < 0.22, (name, std)


@pytest.mark.parametrize("arch, head", [("bert_mlm", "head.decoder"), ("gpt", "lm_head")])
def test_a_tied_dense_head_shares_the_table_and_starts_with_a_zero_bias(arch, head):
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(TINY, arch=arch), None)
    decoder = model.get_submodule(head)
    word = model.embeddings.word if arch == "bert_mlm" else model.word
    assert decoder.weight is word.weight
    assert (decoder.bias is None) == (arch == "gpt")
    if decoder.bias is not None:
        assert torch.equal(decoder.bias, torch.zeros_like(decoder.bias))


def test_the_embedding_uses_its_own_core_count_and_rank_bound():
    spec = dataclasses.replace(SPEC, num_cores=4, embedding_num_cores=2, max_rank=2, embedding_max_rank=5)
    word = build_model(TINY, spec).word
    assert len(word.row_modes) == len(word.col_modes) == 2
    assert max(word.full_ranks()) == 5


def test_tt_shapes_by_kind_names_the_ffn_layers_by_their_kind():
    model = build_model(TINY, SPEC)
    assert tt_shapes_by_kind(model) == {"attention": {(16, 16)}, "ffn_in": {(16, 32)}, "ffn_out": {(32, 16)}}


def test_a_bad_ffn_out_override_is_named():
    with pytest.raises(ValueError, match=r"tensorize.modes\['ffn_out'\].*16x16.*\(32, 16\)"):
        build_model(TINY, dataclasses.replace(SPEC, modes={"ffn_out": [[4, 4], [4, 4]]}))


def test_an_embedding_override_with_the_wrong_width_is_named():
    with pytest.raises(ValueError, match=r"tensorize.modes\['embedding'\].*cannot hold a 60x16 table"):
        build_model(TINY, dataclasses.replace(SPEC, modes={"embedding": [[8, 8], [4, 8]]}))


def test_an_override_for_a_kind_left_dense_is_not_checked():
    """``modes`` for a kind that ``tensorize`` leaves dense has no layer to fit: it builds (dense there)."""
    spec = dataclasses.replace(SPEC, attention=False, modes={"attention": [[4, 4], [4, 4]]})
    model = build_model(TINY, spec)
    assert type(model.blocks[0].attn.query).__name__ == "Linear"
    assert "attention" not in tt_shapes_by_kind(model)

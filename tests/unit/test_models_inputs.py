"""What our models make of their inputs beyond ``input_ids``: left padding, token types, MLM positions, bad ids,
and where dropout sits (embeddings, GPT's input, the six-encoder's classifier). Tiny CPU models, no download."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from comera_dist.compression.config import TensorizeConfig
from comera_dist.models import ModelConfig, build_model, cpu_dropout
from comera_dist.models.export import to_hf

TINY = ModelConfig(arch="bert_mlm", vocab_size=60, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                   max_positions=12, dropout=0.0, num_labels=3, init_std=0.2)
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)


def _model(arch: str, spec=None, **kw):
    torch.manual_seed(0)
    return build_model(dataclasses.replace(TINY, arch=arch, **kw), spec).eval()


def _ids(B: int = 2, T: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
def test_left_padding_in_a_causal_model_gives_finite_logits_that_ignore_the_pads(spec):
    """With left padding the first queries of a GPT see only padding keys: each query still sees itself, so
    no row is all -inf, no NaN reaches the next block (a padded key's value is weighted 0, and 0 * NaN is NaN),
    and the real tokens' logits do not depend on what the padding holds."""
    model = _model("gpt", spec)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    other = ids.clone()
    other[:, :3] = (other[:, :3] + 7) % TINY.vocab_size
    a, b = model(ids, attention_mask=mask)["logits"], model(other, attention_mask=mask)["logits"]
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    torch.testing.assert_close(a[:, 3:], b[:, 3:])
    # Training on the CPU, attention dropout takes ``cpu_dropout.attention``'s own softmax, which (unlike SDPA's
    # math path) turns a row of only -inf into NaN: the self-key is what keeps it finite there.
    drop = _model("gpt", spec, dropout=0.1).train()
    labels = ids.masked_fill(mask == 0, -100)
    out = drop(ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out["logits"]).all() and torch.isfinite(out["loss"])


def test_an_all_padding_row_does_not_turn_the_loss_nan():
    """A batch row that is padding only (no real key at all) carries no label; the loss of the others stays
    finite."""
    model = _model("bert_mlm", SPEC, dropout=0.1).train()  # the CPU's own attention-dropout path too
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1] = 0
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 5
    out = model(ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out["logits"]).all() and torch.isfinite(out["loss"])


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls"])
def test_token_type_ids_are_read_as_huggingface_bert_reads_them(arch):
    model = _model(arch).double()
    ids = _ids()
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # a second segment
    ours = model(ids, token_type_ids=types)["logits"]
    with torch.no_grad():
        hf = to_hf(model)(ids, token_type_ids=types).logits
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-10)
    assert not torch.allclose(ours, model(ids)["logits"])  # the second segment changes them
    torch.testing.assert_close(model(ids, token_type_ids=torch.zeros_like(ids))["logits"], model(ids)["logits"])


def test_mlm_positions_of_another_batch_size_are_an_error():
    model = _model("bert_mlm")
    ids = _ids(B=3)
    with pytest.raises(ValueError, match=r"mlm_positions must be \(batch, P\) = \(3, P\), got shape \(2, 4\)"):
        model(ids, labels=ids, mlm_positions=torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
def test_a_negative_id_is_a_clear_error_naming_the_vocabulary(spec):
    model = _model("gpt", spec)
    ids = _ids()
    ids[0, 4] = -1
    with pytest.raises(ValueError, match=r"input_ids holds ids in \[-1, .*of model.vocab_size"):
        model(ids)


def test_bert_embeddings_drop_after_their_layernorm():
    """BERT's order: ``dropout(LayerNorm(word + position + type))``: a dropped element is exactly 0."""
    model = _model("bert_mlm", dropout=0.5)
    emb = model.embeddings.train()
    ids = _ids()
    x = emb.word(ids) + emb.position(torch.arange(ids.shape[1])) + emb.token_type(torch.zeros_like(ids))
    torch.manual_seed(1)
    want = cpu_dropout.dropout(emb.norm(x), 0.5)
    torch.manual_seed(1)
    torch.testing.assert_close(emb(ids), want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gpt", "six_encoder_cls"])
def test_the_model_level_dropout_is_applied_in_training(arch):
    """GPT's dropout on ``word + position`` and the six-encoder's before its classifier: with only that module
    in training mode the logits change from call to call, and equal the eval logits when it is off."""
    model = _model(arch, dropout=0.5)
    ids = _ids()
    ref = model(ids)["logits"]
    model.drop.train()
    torch.manual_seed(2)
    a = model(ids)["logits"]
    assert not torch.allclose(a, ref) and not torch.allclose(a, model(ids)["logits"])
    model.drop.eval()
    torch.testing.assert_close(model(ids)["logits"], ref)

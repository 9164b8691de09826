"""Our three models, dense and tensorized per kind: outputs, losses, masks, gradients, bad input."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_dist.compression.config import ComeraConfig, TensorizeConfig
from comera_dist.layers import TiedTTHead, TTEmbedding, TTLinear
from comera_dist.models import ModelConfig, build_model, tensorized_modules
from comera_dist.models.factory import FULL_RANK, tt_from_embedding, tt_from_linear

TINY = ModelConfig(arch="bert_mlm", vocab_size=60, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                   max_positions=12, dropout=0.0, num_labels=3)
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=4)
ARCHS = ["bert_mlm", "six_encoder_cls", "gpt"]


def tiny(arch, **kw):
    return dataclasses.replace(TINY, arch=arch, **kw)


def batch(seed=0, B=2, T=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (B, T), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
def test_forward_shapes_loss_and_gradients(arch, spec):
    torch.manual_seed(0)
    model = build_model(tiny(arch), spec)
    ids = batch()
    labels = torch.tensor([0, 2]) if arch == "six_encoder_cls" else ids
    out = model(ids, labels=labels)
    want = (2, 3) if arch == "six_encoder_cls" else (2, 10, TINY.vocab_size)
    assert out["logits"].shape == want and out["loss"].ndim == 0 and torch.isfinite(out["loss"])
    assert model(ids)["loss"] is None
    out["loss"].backward()
    tt = tensorized_modules(model)
    assert (len(tt) > 0) == (spec is not None)
    for name, mod in tt.items():  # every core and gate of every TT layer gets a gradient
        assert mod.core.grad is not None, name
        assert all(g.abs().sum() > 0 for g in mod.split_cores(mod.core.grad)), name  # every core's part
        assert mod.gate.grad is not None, name


@pytest.mark.parametrize("flags", [{"embedding": True, "attention": False, "ffn": False},
                                   {"embedding": False, "attention": True, "ffn": False},
                                   {"embedding": False, "attention": False, "ffn": True}])
def test_each_kind_is_tensorized_separately(flags):
    spec = dataclasses.replace(SPEC, **flags)
    model = build_model(tiny("gpt"), spec)
    names = set(tensorized_modules(model))
    assert ("word" in names) == flags["embedding"]
    assert ({f"blocks.{i}.attn.{p}" for i in range(2) for p in ("query", "key", "value", "out")} <= names) \
        == flags["attention"]
    assert ({f"blocks.{i}.ffn.{p}" for i in range(2) for p in ("inp", "out")} <= names) == flags["ffn"]
    # Tied either way: a dense head shares a dense table; a TTM table gets a TiedTTHead on its cores.
    if flags["embedding"]:
        assert isinstance(model.lm_head, TiedTTHead) and model.lm_head.embedding is model.word
    else:
        assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.word.weight
    untied = build_model(tiny("gpt", tie_word_embeddings=False), spec)
    assert isinstance(untied.lm_head, nn.Linear) and untied.lm_head.weight is not getattr(untied.word, "weight", None)


def test_modes_override_per_kind_and_disabled_section():
    modes = {"attention": [[4, 4], [2, 8]], "ffn_in": [[2, 8], [4, 8]], "ffn_out": [[8, 4], [4, 4]],
             "embedding": [[8, 8], [4, 4]]}
    model = build_model(tiny("bert_mlm"), dataclasses.replace(SPEC, modes=modes))
    layers = tensorized_modules(model)
    assert layers["blocks.1.attn.key"].out_modes == [2, 8]
    assert layers["blocks.0.ffn.inp"].in_modes == [2, 8] and layers["blocks.0.ffn.out"].in_modes == [8, 4]
    assert layers["embeddings.word"].row_modes == [8, 8]  # 64 >= 60 rows: padding rows are never read
    # The whole comera section is accepted too; enabled=False means the dense baseline.
    assert tensorized_modules(build_model(tiny("gpt"), ComeraConfig(enabled=False))) == {}
    assert tensorized_modules(build_model(tiny("gpt"), ComeraConfig(tensorize=SPEC)))


def test_bad_modes_override_names_kind_and_shape():
    with pytest.raises(ValueError, match=r"tensorize.modes\['ffn_in'\].*16x64.*\(16, 32\)"):
        build_model(tiny("gpt"), dataclasses.replace(SPEC, modes={"ffn_in": [[4, 4], [8, 8]]}))
    with pytest.raises(ValueError, match=r"tensorize.modes\['embedding'\].*60x16"):
        build_model(tiny("gpt"), dataclasses.replace(SPEC, modes={"embedding": [[7, 8], [4, 4]]}))
    with pytest.raises(TypeError, match="lack"):
        build_model(tiny("gpt"), object())


def test_mlm_loss_ignores_unmasked_positions():
    torch.manual_seed(0)
    model = build_model(tiny("bert_mlm"), SPEC).eval()
    ids = batch()
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7] = 5, 9
    out = model(ids, labels=labels)
    logits = out["logits"]
    want = F.cross_entropy(torch.stack([logits[0, 3], logits[1, 7]]), torch.tensor([5, 9]))
    torch.testing.assert_close(out["loss"], want)


def test_causal_loss_shifts_inside_and_future_is_invisible():
    torch.manual_seed(0)
    model = build_model(tiny("gpt"), SPEC).eval()
    ids = batch()
    out = model(ids, labels=ids)
    want = F.cross_entropy(out["logits"][:, :-1].reshape(-1, TINY.vocab_size), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out["loss"], want)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(changed)["logits"][:, :6], out["logits"][:, :6])
    assert not torch.allclose(model(changed)["logits"][:, 6:], out["logits"][:, 6:])


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_keys_do_not_change_real_tokens(arch):
    torch.manual_seed(0)
    model = build_model(tiny(arch), SPEC).eval()
    ids = batch()
    mask = torch.ones_like(ids)
    mask[:, 7:] = 0  # right padding
    other = ids.clone()
    other[:, 7:] = (other[:, 7:] + 3) % TINY.vocab_size  # different pad content
    a, b = model(ids, attention_mask=mask)["logits"], model(other, attention_mask=mask)["logits"]
    if arch == "six_encoder_cls":
        torch.testing.assert_close(a, b)
    else:
        torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(model(ids)["logits"], model(other)["logits"])  # without the mask they differ


def test_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = build_model(tiny("bert_mlm", dropout=0.5), SPEC)
    ids = batch()
    assert not torch.allclose(model(ids)["logits"], model(ids)["logits"])
    model.eval()
    torch.testing.assert_close(model(ids)["logits"], model(ids)["logits"])


@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_tt_model_equals_its_dense_twin(arch):
    # Our TT model is the dense model with layers swapped: TT-SVD at full rank gives the same logits.
    torch.manual_seed(0)
    dense = build_model(tiny(arch), None).double().eval()
    tt = build_model(tiny(arch), SPEC).double().eval()
    tt.load_state_dict({k: v for k, v in dense.state_dict().items() if k in tt.state_dict()
                        and tt.state_dict()[k].shape == v.shape}, strict=False)
    for name, mod in tensorized_modules(tt).items():
        src = dense.get_submodule(name)
        new = tt_from_embedding(src, SPEC, max_rank=FULL_RANK) if isinstance(mod, TTEmbedding) \
            else tt_from_linear(src, SPEC, "attention", max_rank=FULL_RANK)
        tt.set_submodule(name, new)
    if arch != "six_encoder_cls":  # the tied head must follow the swapped-in table (a TiedTTHead on its cores)
        word = "embeddings.word" if arch == "bert_mlm" else "word"
        head_name = "head.decoder" if arch == "bert_mlm" else "lm_head"
        old = tt.get_submodule(head_name)
        head = TiedTTHead(tt.get_submodule(word), bias=old.bias is not None)
        if old.bias is not None:
            head.bias = old.bias
        tt.set_submodule(head_name, head)
    ids = batch()
    torch.testing.assert_close(tt(ids)["logits"], dense(ids)["logits"], rtol=1e-9, atol=1e-9)


def test_svd_init_builds_truncated_tt_of_a_dense_init():
    torch.manual_seed(0)
    model = build_model(tiny("gpt"), dataclasses.replace(SPEC, init="svd"))
    layer = tensorized_modules(model)["blocks.0.ffn.inp"]
    assert isinstance(layer, TTLinear) and max(layer.full_ranks()) <= SPEC.max_rank
    # Truncated SVD of N(0, 0.02^2) entries keeps roughly that scale.
    assert 0.002 < layer.dense_weight().std() < 0.02


def test_bad_inputs_are_clear_errors():
    model = build_model(tiny("bert_mlm"), SPEC)
    with pytest.raises(ValueError, match="sequence length 13 > model.max_positions 12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 60\)"):
        model(torch.full((1, 4), 60))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match=r"labels must be \(batch,\)"):
        build_model(tiny("six_encoder_cls"), None)(torch.zeros(2, 4, dtype=torch.long),
                                                   labels=torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("spec", [None, SPEC], ids=["dense", "tt"])
def test_mlm_head_at_the_collator_positions_equals_the_full_head(spec):
    """``mlm_positions``: the head and the loss at those rows only give the full model's loss, logits
    and gradients (labels are -100 everywhere else, as the MLM collator leaves them)."""
    torch.manual_seed(0)
    model = build_model(tiny("bert_mlm"), spec).double()
    ids = batch(B=3)
    positions = torch.tensor([[1, 4, 7], [0, 2, 9], [3, 5, 6]])  # (B, P)
    labels = torch.full_like(ids, -100).scatter(1, positions, ids.gather(1, positions))
    labels[2, 6] = -100  # a padded position (an unselected one in a row with few eligible tokens)
    full = model(ids, labels=labels)
    full["loss"].backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    part = model(ids, labels=labels, mlm_positions=positions)
    part["loss"].backward()
    assert part["logits"].shape == (3, 3, TINY.vocab_size)
    torch.testing.assert_close(part["loss"], full["loss"])
    torch.testing.assert_close(part["logits"], full["logits"].gather(1, positions[..., None].expand(-1, -1, 60)))
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(ValueError, match="mlm_positions must be"):
        model(ids, labels=labels, mlm_positions=positions[0])

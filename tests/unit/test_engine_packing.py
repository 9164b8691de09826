"""``engine.packing``: a model's 1-D dense parameters trained as one flat parameter, keys and numbers unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from bench_cases import no_dropout
from torch import nn

from comera_dist.bench import six_encoder
from comera_dist.compression.groups import param_roles
from comera_dist.engine.packing import pack_state, pack_vectors, packed_of, unpack_saved, unpack_state


def _model() -> nn.Module:
    return no_dropout(six_encoder.make_contender("comera", smoke=True)).model


def _perturbed() -> nn.Module:
    """A model whose every parameter differs from ``_model()``'s (what a trained state looks like)."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    return model


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    return model(**six_encoder.random_batch(model, 2, smoke=True, seed=seed))["loss"]


def test_packed_model_computes_and_trains_like_the_plain_one():
    plain = _model()
    packed_model = copy.deepcopy(plain)
    packed = pack_vectors(packed_model)
    roles = param_roles(plain)
    vectors = [n for n, p in plain.named_parameters() if p.dim() == 1 and id(p) not in roles]
    assert [p.names[0] for p in packed.pieces] == vectors and len(vectors) > 10  # biases and LayerNorms
    assert len(list(packed_model.parameters())) == len(list(plain.parameters())) - len(vectors) + 1
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (plain, packed_model)]
    for seed in range(3):
        losses = [_loss(model, seed) for model in (plain, packed_model)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        # one gradient: the pieces' gradients end to end
        want = torch.cat([dict(plain.named_parameters())[n].grad.reshape(-1) for n in vectors])
        torch.testing.assert_close(packed.flat.grad, want)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    state, want = packed_model.state_dict(), plain.state_dict()
    assert set(state) == set(want)  # the per-module keys, no packed one
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, msg=k)


def test_state_dicts_load_across_packed_and_plain():
    plain, other = _model(), _perturbed()
    packed_model = copy.deepcopy(plain)
    pack_vectors(packed_model)
    packed_model.load_state_dict(other.state_dict())  # plain keys into a packed model
    for k, v in other.state_dict().items():
        torch.testing.assert_close(packed_model.state_dict()[k], v, msg=k)
    assert float(_loss(packed_model, 0)) == pytest.approx(float(_loss(other, 0)), rel=1e-6)
    plain.load_state_dict(packed_model.state_dict())  # and back
    torch.testing.assert_close(_loss(plain, 1), _loss(other, 1))
    with pytest.raises(RuntimeError, match="Missing key"):
        partial = dict(other.state_dict())
        partial.pop(next(k for k in partial if k.endswith("norm.bias")))
        packed_model.load_state_dict(partial)


def test_a_shared_vector_is_packed_once_and_keeps_every_key():
    norm = nn.LayerNorm(4)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4), norm)  # one LayerNorm used twice
    plain = copy.deepcopy(model)
    packed = pack_vectors(model)
    assert [p.names for p in packed.pieces] == [("0.bias",), ("1.weight", "3.weight"), ("1.bias", "3.bias"),
                                                 ("2.bias",)]
    assert model.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), plain(x))
    assert model[1].weight is model[3].weight  # both owners see the same view


def test_a_deep_copy_installs_its_own_views():
    model = _model()
    copied = copy.deepcopy(model)
    pack_vectors(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        packed_of(twin).flat.add_(1.0)  # only the copy changes
    torch.testing.assert_close(_loss(model, 0), _loss(copied, 0))
    assert float(_loss(twin, 0)) != float(_loss(model, 0))


def test_consolidated_state_round_trip():
    model = _model()
    pack_vectors(model)
    params = dict(model.named_parameters())
    params = {n: p.detach().clone() for n, p in params.items()}
    moments = {n: {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)} for n, p in params.items()}
    flat, flat_m = params["packed_vectors"].clone(), moments["packed_vectors"]["exp_avg"].clone()
    unpack_state(model, params, moments)
    assert "packed_vectors" not in params and params.keys() == moments.keys()
    assert params.keys() == set(model.state_dict()) - {k for k, _ in model.named_buffers()}
    pack_state(model, params, moments)
    torch.testing.assert_close(params["packed_vectors"], flat)
    torch.testing.assert_close(moments["packed_vectors"]["exp_avg"], flat_m)
    params.pop("packed_vectors")
    unpack_state(model, params, moments)  # nothing packed in it: left alone
    with pytest.raises(ValueError, match="lacks"):
        pack_state(model, params, moments)


def test_refuses_partitioned_and_repacked_models():
    model = _model()
    next(model.parameters()).ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    with pytest.raises(ValueError, match="ZeRO-3"):
        pack_vectors(model)
    model = _model()
    pack_vectors(model)
    with pytest.raises(ValueError, match="already packed"):
        pack_vectors(model)


def test_a_packed_runs_saved_flat_vector_loads_into_the_plain_model():
    """What ``comera evaluate``/``export`` read from a packed run's ZeRO shards (``zero_to_fp32`` yields the
    flat entry): ``unpack_saved`` gives it the plain model's keys."""
    trained, fresh = _perturbed(), _model()
    packed_model = copy.deepcopy(trained)
    pack_vectors(packed_model)
    saved = {n: p.detach().clone() for n, p in packed_model.named_parameters()}  # what the shards hold
    saved |= {n: b.clone() for n, b in packed_model.named_buffers()}
    assert "packed_vectors" in saved
    unpack_saved(fresh, saved)
    assert fresh.load_state_dict(saved, strict=True)
    torch.testing.assert_close(_loss(fresh, 0), _loss(trained, 0))
    unpack_saved(fresh, saved)  # nothing packed left: a no-op
    saved["packed_vectors"] = torch.zeros(7)
    with pytest.raises(ValueError, match="holds 7 values"):
        unpack_saved(fresh, saved)

"""``engine.packing`` edge cases: frozen, single, shared and other-dtype parameters, a flat parameter DeepSpeed
re-views within its storage, and ``holder``'s spans."""

import copy

import torch
from torch import nn

from comera_dist.engine.packing import holder, pack_vectors, packed_of


def test_a_frozen_parameter_is_not_packed_and_stays_frozen():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].bias.requires_grad_(False)
    pack_vectors(model)
    assert "bias" in model[1]._parameters and not model[1].bias.requires_grad
    assert all("1.bias" not in p.names for pack in packed_of(model).packs for p in pack.pieces)


def test_a_role_with_a_single_parameter_is_left_unpacked():
    assert pack_vectors(nn.Sequential(nn.Linear(4, 4, bias=False))) is None


def test_a_shared_vectors_state_dict_round_trips_through_the_packed_model():
    norm = nn.LayerNorm(4)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4), norm)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    pack_vectors(model)
    model.load_state_dict(other.state_dict())  # strict: both names of the shared LayerNorm are consumed
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), other(x))


def test_refresh_follows_a_flat_parameter_moved_within_the_same_storage():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    packing = pack_vectors(model)
    flat = packing.flat(packing.packs[0])
    n = flat.numel()
    buffer = torch.arange(2 * n + 1, dtype=flat.dtype)  # one storage, as DeepSpeed's flat buffers are
    with torch.no_grad():
        flat.data = buffer[:n]
    packing.refresh()
    with torch.no_grad():
        flat.data = buffer[n + 1:]  # same storage, another offset
    packing.refresh()
    for module, attr in ((model[0], "weight"), (model[1], "bias")):
        _, span = holder(model, module, attr)
        assert torch.equal(getattr(module, attr).reshape(-1), flat.detach()[span]), attr


def test_holder_gives_each_pieces_own_span():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    packing = pack_vectors(model)
    spans = [holder(model, m, a)[1] for m, a in ((model[0], "weight"), (model[0], "bias"),
                                                 (model[1], "weight"), (model[1], "bias"))]
    assert [(s.start, s.stop) for s in spans] == [(0, 16), (16, 20), (20, 24), (24, 28)]
    assert holder(model, model[1], "bias")[0] is packing.flat(packing.packs[0])


def test_parameters_of_another_dtype_are_not_cast_into_the_pack():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4).double())
    pack_vectors(model)
    assert model[0].weight.dtype == torch.float32
    assert "weight" in model[1]._parameters and model[1].weight.dtype == torch.float64

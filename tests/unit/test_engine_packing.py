"""``engine.packing``: a model's 1-D parameters trained as one flat parameter per role, keys and numbers
unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from bench_cases import no_dropout
from torch import nn

from comera_dist.bench import six_encoder
from comera_dist.compression.accounting import compression_report
from comera_dist.compression.config import LrConfig
from comera_dist.compression.groups import param_groups, param_roles
from comera_dist.compression.penalty import rank_penalty
from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.compression.walk import tensorized_modules
from comera_dist.engine.packing import (
    NAMES,
    attached,
    holder,
    pack_state,
    pack_vectors,
    packed_of,
    packed_roles,
    packing_layout,
    unpack_saved,
    unpack_state,
)


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


def _objective(model: nn.Module, seed: int) -> torch.Tensor:
    """The task loss plus the rank penalty computed outside the forward, as the session computes it."""
    loss = _loss(model, seed)
    with attached(model, ("gates",)):
        return loss + 0.5 * rank_penalty(model)


def _by_role(model: nn.Module) -> dict[str, list[str]]:
    """The plain model's 1-D and 2-D parameter names per role, in module order (what each pack must hold)."""
    roles = param_roles(model)
    out: dict[str, list[str]] = {"cores": [], "gates": [], "dense": []}
    for n, p in model.named_parameters():
        if p.dim() in (1, 2):
            out[roles.get(id(p), "dense")].append(n)
    return out


def test_packed_model_computes_and_trains_like_the_plain_one():
    plain = _model()
    packed_model = copy.deepcopy(plain)
    packing = pack_vectors(packed_model)
    want = _by_role(plain)
    assert {p.role: [piece.names[0] for piece in p.pieces] for p in packing.packs} == want
    assert len(want["cores"]) == len(list(tensorized_modules(plain))) and len(want["dense"]) > 10
    assert packed_roles(packed_model) == ["cores", "dense", "gates"]
    assert packing_layout(packed_model) == 2 and packing_layout(plain) == 0  # what a checkpoint's meta records
    assert any(p.dim() == 2 for n, p in plain.named_parameters() if n in want["dense"])  # tables, matrices
    packed = sum(len(v) for v in want.values())
    assert len(list(packed_model.parameters())) == len(list(plain.parameters())) - packed + 3 == 3
    # every role trains as one tensor in its own AdamW group, with the plain model's settings
    groups = {g["name"]: g for g in param_groups(packed_model, LrConfig())}
    for role in ("cores", "gates"):
        assert len(groups[role]["params"]) == 1 and groups[role]["params"][0] is getattr(packed_model, NAMES[role])
    assert any(p is packed_model.packed_vectors for p in groups["dense"]["params"])
    assert groups["gates"]["weight_decay"] == 0.0
    opts = [torch.optim.AdamW(param_groups(m, LrConfig(cores=1e-2, gates=1e-2, dense=1e-2)), weight_decay=0.01)
            for m in (plain, packed_model)]
    named = dict(plain.named_parameters())
    for seed in range(3):
        losses = [_objective(model, seed) for model in (plain, packed_model)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        for pack in packing.packs:  # one gradient per role: the pieces' gradients end to end
            got = packing.flat(pack).grad
            torch.testing.assert_close(got, torch.cat([named[n].grad.reshape(-1) for n in want[pack.role]]),
                                       msg=pack.name)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    state, want_state = packed_model.state_dict(), plain.state_dict()
    assert set(state) == set(want_state)  # the per-module keys, no packed one
    for k, v in want_state.items():
        torch.testing.assert_close(state[k], v, msg=k)
    assert compression_report(packed_model) == compression_report(plain)  # leftover counts the dense pack only


def test_compiles_as_one_graph_on_the_flat_parameters():
    """``train.compile`` compiles the module's call (``nn.Module.compile``): the packed model's is one
    graph, ``fullgraph`` too, whose tensor inputs are parameters and buffers, never a view of a piece
    (hooks made three graphs and gave the forward every view as an input of its own); gradients equal
    eager's."""
    model = _model()
    pack_vectors(model)
    twin = copy.deepcopy(model)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    model.compile(backend=record, fullgraph=True)
    for seed in range(2):  # the second call reuses the graph: the detached views left behind do not recompile
        losses = [_loss(m, seed) for m in (model, twin)]
        torch.testing.assert_close(losses[0], losses[1])
        for loss in losses:
            loss.backward()
    assert len(graphs) == 1
    inputs = graphs[0]
    flats = [n for n in inputs if any(name in n for name in NAMES.values())]
    assert len(flats) == 3
    owned = ("parameters", "buffers", "input_ids", "labels")
    assert all(any(k in n for k in owned) for n in inputs), [n for n in inputs if not any(k in n for k in owned)]
    for name in NAMES.values():
        torch.testing.assert_close(getattr(model, name).grad, getattr(twin, name).grad, msg=name)


def test_resting_views_are_reused_and_follow_the_flat_parameter():
    """Between forwards each owner holds a detached view of its piece, the same tensor after every forward
    (so a compiled forward has nothing to rebuild), in-place updates of the flat parameter show through,
    and a forward after the flat parameter moved (here ``double()``) hands out views of the new one."""
    model = _model()
    pack_vectors(model)
    layer = next(layer for _, layer in tensorized_modules(model))
    resting = layer.gate
    _loss(model, 0).backward()
    assert layer.gate is resting and not resting.requires_grad
    flat, span = holder(model, layer, "gate")
    with torch.no_grad():
        flat.add_(1.0)
    assert torch.equal(layer.gate, flat.detach()[span])
    model.double()
    _loss(model, 1)
    flat, span = holder(model, layer, "gate")
    assert layer.gate.dtype == torch.float64 and torch.equal(layer.gate, flat.detach()[span])


def test_a_compiled_forward_leaves_nothing_to_rebuild():
    """A compiled forward sets the owners' attributes back to the resting views, which existed before the
    call: no host op after the graph. Made inside the call, each would be rebuilt there (a ``detach`` and a
    ``split`` per piece, every forward). ``refresh`` picks up a move a traced forward cannot see."""
    from comera_dist.bench.compile_stats import host_ops

    model = _model()
    packing = pack_vectors(model)
    model.compile(backend="aot_eager", fullgraph=True)
    for seed in range(2):
        _loss(model, seed).backward()
    layer = next(layer for _, layer in tensorized_modules(model))
    resting = layer.gate
    pieces = sum(len(pack.pieces) for pack in packing.packs)
    assert host_ops(lambda: _loss(model, 2)) < 10 < pieces
    assert layer.gate is resting
    flat, span = holder(model, layer, "gate")
    flat.data = flat.data.clone()  # a new storage, same dtype, device and size
    with torch.no_grad():
        flat.mul_(2.0)
    _loss(model, 3)
    assert layer.gate is resting  # the traced forward cannot tell
    packing.refresh()
    assert torch.equal(layer.gate, flat.detach()[span])


def test_the_penalty_needs_the_gates_attached():
    """Outside the forward the owners hold detached views: R computed there reaches no gate."""
    model = _model()
    pack_vectors(model)
    _loss(model, 0)
    assert not rank_penalty(model).requires_grad  # detached views between forwards
    with attached(model, ("gates",)):
        rank_penalty(model).backward()
    assert model.packed_gates.grad is not None and model.packed_gates.grad.abs().sum() > 0
    first_layer = next(layer for _, layer in tensorized_modules(model))
    assert not first_layer.gate.requires_grad  # detached again


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
    packing = pack_vectors(model)
    assert [p.role for p in packing.packs] == ["dense"]
    assert [p.names for p in packing.packs[0].pieces] == [("0.weight",), ("0.bias",), ("1.weight", "3.weight"),
                                                          ("1.bias", "3.bias"), ("2.weight",), ("2.bias",)]
    assert [p.shape for p in packing.packs[0].pieces] == [(4, 4), (4,), (4,), (4,), (4, 4), (4,)]
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
        for pack in packed_of(twin).packs:
            packed_of(twin).flat(pack).add_(1.0)  # only the copy changes
    torch.testing.assert_close(_loss(model, 0), _loss(copied, 0))
    assert float(_loss(twin, 0)) != float(_loss(model, 0))


def test_consolidated_state_round_trip():
    model = _model()
    pack_vectors(model)
    params = dict(model.named_parameters())
    params = {n: p.detach().clone() for n, p in params.items()}
    moments = {n: {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)} for n, p in params.items()}
    flats = {n: (params[n].clone(), moments[n]["exp_avg"].clone()) for n in NAMES.values()}
    unpack_state(model, params, moments)
    assert not set(NAMES.values()) & set(params) and params.keys() == moments.keys()
    assert params.keys() == set(model.state_dict()) - {k for k, _ in model.named_buffers()}
    pack_state(model, params, moments)
    for name, (flat, flat_m) in flats.items():
        torch.testing.assert_close(params[name], flat)
        torch.testing.assert_close(moments[name]["exp_avg"], flat_m)
    params.pop(NAMES["gates"])
    unpack_state(model, params, moments)  # nothing packed in it: left alone
    with pytest.raises(ValueError, match="lacks"):
        pack_state(model, params, moments)


def test_a_packed_layer_refuses_to_prune_in_place():
    model = _model()
    pack_vectors(model)
    _, layer = next(tensorized_modules(model))
    with pytest.raises(ValueError, match="packed"):
        layer.prune_({0: torch.tensor([0])})


def test_refuses_partitioned_and_repacked_models():
    model = _model()
    next(model.parameters()).ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    with pytest.raises(ValueError, match="ZeRO-3"):
        pack_vectors(model)
    model = _model()
    pack_vectors(model)
    with pytest.raises(ValueError, match="already packed"):
        pack_vectors(model)


@pytest.mark.parametrize("layout", [2, 1])
def test_a_packed_runs_saved_flat_vector_loads_into_the_plain_model(layout):
    """What ``comera evaluate``/``export`` read from a packed run's ZeRO shards (``zero_to_fp32`` yields the
    flat entry): ``unpack_saved`` gives it the plain model's keys, for this packing layout and for the
    first one's checkpoints (1-D parameters only: the 2-D ones saved under their own keys)."""
    trained, fresh = _perturbed(), _model()
    packed_model = copy.deepcopy(trained)
    assert pack_vectors(packed_model, layout).layout == layout == packing_layout(packed_model)
    saved = {n: p.detach().clone() for n, p in packed_model.named_parameters()}  # what the shards hold
    saved |= {n: b.clone() for n, b in packed_model.named_buffers()}
    assert set(NAMES.values()) <= set(saved)
    unpack_saved(fresh, saved)
    assert fresh.load_state_dict(saved, strict=True)
    torch.testing.assert_close(_loss(fresh, 0), _loss(trained, 0))
    unpack_saved(fresh, saved)  # nothing packed left: a no-op
    saved[NAMES["cores"]] = torch.zeros(7)
    with pytest.raises(ValueError, match="'packed_cores' holds 7 values"):
        unpack_saved(fresh, saved)


def test_a_pruned_state_into_a_packed_model_names_the_ranks():
    """The load pre-hook leaves a pack whose pieces have other shapes to the layer's own check."""
    pruned = _perturbed()
    with torch.no_grad():
        for _, layer in tensorized_modules(pruned):
            layer.gate[::2] = 0.0  # half of every bond below tau
    apply_plan(pruned, make_plan(pruned, min_rank=1))
    packed_model = _model()
    pack_vectors(packed_model)
    with pytest.raises(ValueError, match="needs a model built with its ranks"):
        packed_model.load_state_dict(pruned.state_dict())


@pytest.mark.parametrize("meta,want", [
    ({"packing": ["gates", "cores", "dense"], "packing_layout": 2}, (["cores", "dense", "gates"], 2)),
    ({"packing": ["cores", "dense", "gates"]}, (["cores", "dense", "gates"], 1)),  # before packing_layout
    ({"packed_vectors": True}, (["dense"], 1)),  # the first packing
    ({"packing": [], "packing_layout": 0}, ([], 0)),
    ({}, ([], 0)),  # older: nothing packed
])
def test_a_checkpoints_packing_is_read_with_its_layout(meta, want):
    """A resume compares the checkpoint's packing with the engine's (roles and ``LAYOUT``): DeepSpeed's
    shards only load into an engine packed the same way, so a layout-1 checkpoint (1-D parameters only)
    takes the consolidated route into today's layout-2 engine."""
    from comera_dist.engine.resume import _saved_packing

    assert _saved_packing(meta) == want

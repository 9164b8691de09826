"""Shared L/R factors (``layers.group``): same-shape TT layers contracted together equal each layer's own.

These tests pin the factors at their own ranks (``COMERA_RANK_ALIGN=1``); ``test_layers_rank_align.py`` covers
the default, each group's middle rank padded to a multiple of 8."""

from __future__ import annotations

import contextlib

import pytest
import torch

from comera_dist.compression.config import TensorizeConfig
from comera_dist.compression.penalty import rank_penalty
from comera_dist.compression.walk import tensorized_modules
from comera_dist.kernels import dispatch
from comera_dist.layers import TTLinear
from comera_dist.layers import group as group_mod
from comera_dist.layers.group import project, shared_factors
from comera_dist.models import build_model
from comera_dist.models.config import ModelConfig
from comera_dist.tensor import contract


@pytest.fixture(autouse=True)
def _own_ranks(monkeypatch):
    monkeypatch.setenv("COMERA_RANK_ALIGN", "1")


def _layers(seed: int) -> torch.nn.ModuleList:
    g = torch.Generator().manual_seed(seed)
    same = [TTLinear(12, 20, in_modes=[3, 4], out_modes=[4, 5], max_rank=3, generator=g) for _ in range(3)]
    other = TTLinear(20, 12, in_modes=[4, 5], out_modes=[3, 4], max_rank=3, generator=g)
    layers = torch.nn.ModuleList([*same, other])
    with torch.no_grad():  # distinct gates, some below tau, so the masks matter
        for i, layer in enumerate(layers):
            for gate in layer.gates:
                gate.copy_(torch.rand(gate.shape, generator=g) + 0.5)
                gate[i % gate.shape[0]] = 0.005  # below tau (1e-2) but not zero
    return layers


def test_batched_factors_match_each_layers_own_forward_and_backward():
    layers = _layers(0)
    x = torch.randn(7, 12)
    got = shared_factors(layers)
    assert set(got) == {id(m) for m in layers}
    out = sum(project(m, x if m.in_features == 12 else torch.cat([x, x[:, :8]], 1), got).square().sum()
              for m in layers)
    out.backward()
    grads = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    ref = sum(m(x if m.in_features == 12 else torch.cat([x, x[:, :8]], 1)).square().sum() for m in layers)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for a, p in zip(grads, layers.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_contract_halves_batched_equals_left_and_right():
    layers = _layers(1)[:3]
    d = layers[0].d
    n = layers[0].num_cores
    cores = [torch.stack([m.cores[k] for m in layers]) for k in range(n)]
    masks = [torch.stack([m.masked_gates()[k] for m in layers]) for k in range(n - 1)]
    L, R = contract.contract_halves_batched(cores, masks, d)
    for i, m in enumerate(layers):
        Li, Ri = m._halves(m.core, m.gate)
        torch.testing.assert_close(L[i], Li)
        torch.testing.assert_close(R[i], Ri)


def test_forced_orders_are_grouped_apart():
    layers = _layers(2)
    layers[1].order = "sequential"
    got = shared_factors(layers)
    assert id(layers[1]) not in got and id(layers[2]) in got
    x = torch.randn(5, 12)
    torch.testing.assert_close(project(layers[1], x, got), layers[1](x))
    torch.testing.assert_close(project(layers[2], x, got), layers[2](x))


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_pruned_layers_stay_batched_zero_padded_and_match_their_own_path(monkeypatch, path):
    """After a prune the layers of a group differ in ranks: still one batched chain, and the same outputs
    and gradients as every layer on its own. On the CPU each layer's factors are cut to its own middle
    rank; on the GPU path (``static_shapes``, its CPU proxy) they keep the group's, the padding exact
    zeros."""
    layers = _layers(5).double()
    assert layers[0].d == 2 and layers[0].bond_dims() == [3, 3, 3]
    layers[0].prune_({0: torch.tensor([0, 2]), 1: torch.tensor([1])})  # bond 1 is the middle one (d = 2)
    layers[2].prune_({2: torch.tensor([2])})
    widths = []
    real = group_mod._batched
    monkeypatch.setattr(group_mod, "_batched", lambda p, G, d, shapes, cut: widths.append(
        tuple(tuple(c[-1] for c in s[:-1]) for s in shapes)) or real(p, G, d, shapes, cut))
    x = torch.randn(7, 12, dtype=torch.float64)
    inputs = [x if m.in_features == 12 else torch.cat([x, x[:, :8]], 1) for m in layers]
    with dispatch.static_shapes() if path == "gpu" else contextlib.nullcontext():
        got = shared_factors(layers)
    assert widths == [((2, 1, 3), (3, 3, 3), (3, 3, 1))]  # the three 12x20 layers, batched as one group
    L, R = got[id(layers[0])]
    if path == "cpu":
        assert L.shape == (12, 1) and R.shape == (1, 20)
    else:  # the group's middle rank 3; layer 0's own is 1: its L's padded columns are zeros, as R's rows
        assert L.shape == (12, 3) and R.shape == (3, 20)
        assert not L[:, 1:].any() and not R[1:].any() and L[:, 0].any()
    out = sum(project(m, v, got).square().sum() for m, v in zip(layers, inputs))
    out.backward()
    grads = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    ref = sum(m(v).square().sum() for m, v in zip(layers, inputs))
    ref.backward()
    torch.testing.assert_close(out, ref)
    for (name, p), a in zip(layers.named_parameters(), grads, strict=True):
        torch.testing.assert_close(a, p.grad, msg=name)


def _spy_on_projections(monkeypatch, used: list[bool], *modules: str) -> None:
    """Record, for every TT projection the models make through ``layers.group``, whether it got its layer's
    shared factors (``used``), and make it as before."""
    real_project, real_shared, real_ffn = group_mod.project, group_mod.project_shared_input, group_mod.project_ffn
    for module in modules:
        monkeypatch.setattr(f"{module}.project", lambda layer, x, factors, **kw: used.append(
            factors is not None and id(layer) in factors) or real_project(layer, x, factors, **kw))
    monkeypatch.setattr("comera_dist.models.blocks.project_shared_input", lambda layers, x, factors: used.extend(
        factors is not None and id(layer) in factors for layer in layers) or real_shared(layers, x, factors))
    monkeypatch.setattr("comera_dist.models.blocks.project_ffn", lambda inp, out, x, factors: used.extend(
        factors is not None and id(layer) in factors for layer in (inp, out)) or real_ffn(inp, out, x, factors))


def test_six_encoder_with_and_without_shared_factors(monkeypatch):
    """The six-encoder contracts same-shape layers together: every TT projection gets its layer's shared
    factors, and the loss and gradients are those of every layer on its own."""
    cfg = ModelConfig(arch="six_encoder_cls", vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, max_positions=8, num_labels=3, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3)).double()
    with torch.no_grad():  # gates of different values, some below tau, so each layer's mask matters
        for _, layer in tensorized_modules(model):
            layer.gate.uniform_(0.5, 1.5)
            layer.gate[::3] = 0.005
    ids, labels = torch.randint(0, 50, (2, 8)), torch.tensor([0, 2])
    used = []  # per projection: made with its layer's shared factors
    _spy_on_projections(monkeypatch, used, "comera_dist.models.blocks", "comera_dist.models.six_encoder")
    results = []
    for share in (True, False):
        if not share:
            monkeypatch.setattr("comera_dist.models.six_encoder.shared_factors_and_penalty",
                                lambda m, skip=(): ({}, None))
        model.zero_grad()
        loss = model(ids, labels=labels)["loss"]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    n = len(group_mod.shared_factors(model))
    assert n == 6 * cfg.num_layers + 1  # Q, K, V, O, FFN in, FFN out per block, and the pooler
    assert len(used) == 2 * n and used[:n] == [True] * n and used[n:] == [False] * n, used
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", ["bert_mlm", "gpt"])
def test_pretraining_models_share_factors_and_match_the_per_layer_path(monkeypatch, arch):
    """BERT-MLM and GPT contract same-shape layers together (the trainer's models): same loss and
    gradients as every layer on its own, and the grouped path really ran; the R their forward returns
    from the shared masks is ``rank_penalty``'s, value and gradients."""
    cfg = ModelConfig(arch=arch, vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, max_positions=8, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3)).double()
    ids = torch.randint(0, 50, (2, 8))
    used = []  # layers applied with their shared factors
    _spy_on_projections(monkeypatch, used, "comera_dist.models.blocks")
    real = group_mod.shared_factors
    results = []
    with torch.no_grad():  # gates of different values, some below tau, so R's surviving set matters
        for _, layer in tensorized_modules(model):
            layer.gate.uniform_(0.5, 1.5)
            layer.gate[::3] = 0.005
    for share in (True, False):
        if not share:
            monkeypatch.setattr(f"comera_dist.models.{arch}.shared_factors_and_penalty",
                                lambda m, skip=(): ({}, None))
        model.zero_grad()
        out = model(ids, labels=ids)
        penalty = out["rank_penalty"] if share else rank_penalty(model)  # the session's two sources of R
        (out["loss"] + 3.0 * penalty).backward()
        results.append((out["loss"].detach(), penalty.detach(), [p.grad.clone() for p in model.parameters()]))
    n = 6 * cfg.num_layers  # Q, K, V, O, FFN in, FFN out per block
    assert len(real(model)) == n and used[:n] == [True] * n and used[n:] == [False] * n
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert 0.5 < float(results[0][1]) < 1.5 and float(results[0][1]) != 1.0
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b)


def test_skipped_submodules_get_no_factors_and_their_gates_still_count_in_the_penalty():
    """``skip`` (a recomputed block contracts its own factors, ``model.recompute_factors``): the skipped blocks'
    layers get no factors, the others the same ones as without ``skip``, and R is ``rank_penalty``'s, value and
    gate gradients, its skipped gates counted through ``gate_sums``."""
    cfg = ModelConfig(arch="six_encoder_cls", vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, max_positions=8, num_labels=3, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3)).double()
    with torch.no_grad():  # some gates below tau, so R's surviving set matters
        for _, layer in tensorized_modules(model):
            layer.gate.uniform_(0.5, 1.5)
            layer.gate[::3] = 0.005
    gates = [layer.gate for _, layer in tensorized_modules(model)]
    full, R_full = group_mod.shared_factors_and_penalty(model)
    got, R = group_mod.shared_factors_and_penalty(model, skip=[model.blocks[1]])
    in_block = {id(m) for m in model.blocks[1].modules() if isinstance(m, TTLinear)}
    assert len(in_block) == 6 and got.keys() == full.keys() - in_block
    for key, (L, Rf) in got.items():
        torch.testing.assert_close(L, full[key][0])
        torch.testing.assert_close(Rf, full[key][1])
    want = rank_penalty(model)
    torch.testing.assert_close(R, want)
    torch.testing.assert_close(R_full, want)
    for g, w in zip(torch.autograd.grad(R, gates), torch.autograd.grad(want, gates), strict=True):
        torch.testing.assert_close(g, w)


def test_shared_factors_step_aside_under_zero3():
    """ZeRO-3 marks partitioned parameters with ``ds_id`` and gathers them per submodule: no model-level factors."""
    layers = torch.nn.ModuleList(TTLinear(12, 12, in_modes=[3, 4], out_modes=[4, 3], max_rank=2) for _ in range(2))
    assert len(group_mod.shared_factors(layers)) == 2
    for p in layers.parameters():
        p.ds_id = 0
    assert group_mod.shared_factors(layers) == {}


@pytest.mark.parametrize("G", [2, 4])
def test_batched_groups_bigger_than_one(G):
    g = torch.Generator().manual_seed(G)
    layers = torch.nn.ModuleList([TTLinear(8, 8, in_modes=[2, 4], out_modes=[4, 2], max_rank=2, generator=g)
                                  for _ in range(G)])
    got = shared_factors(layers)
    for m in layers:
        L, R = m._halves(m.core, m.gate)
        torch.testing.assert_close(got[id(m)][0], L)
        torch.testing.assert_close(got[id(m)][1], R)


def test_penalty_from_the_shared_masks_equals_rank_penalty():
    from comera_dist.layers import TTEmbedding
    from comera_dist.layers.group import shared_factors_and_penalty

    layers = _layers(3)
    layers.append(TTEmbedding(30, 12, row_modes=[5, 6], col_modes=[3, 4], max_rank=3))
    with torch.no_grad():
        layers[-1].gates[0][0] = 0.005  # below tau
    _, got = shared_factors_and_penalty(layers)
    want = rank_penalty(layers)
    torch.testing.assert_close(got, want)
    got_g = torch.autograd.grad(got, list(layers.parameters()), allow_unused=True)
    want_g = torch.autograd.grad(want, list(layers.parameters()), allow_unused=True)
    for a, b in zip(got_g, want_g):
        assert (a is None) == (b is None) or (a is not None and not a.any()) or (b is not None and not b.any())
        if a is not None and b is not None:
            torch.testing.assert_close(a, b)
    assert shared_factors_and_penalty(torch.nn.Linear(2, 2))[1] is None


def test_grouped_factors_under_autocast_are_cast_once_per_group(monkeypatch):
    """Under autocast the grouped L/R come out in autocast's dtype, cast once per stack: the same loss
    and gradients, bit for bit, as leaving each layer's matmul to cast its own slice, in fewer casts."""
    from comera_dist.bench.ops import OpCounter
    from comera_dist.tensor import tt

    cfg = ModelConfig(arch="bert_mlm", vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, max_positions=8, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3))
    ids = torch.randint(0, 50, (2, 8))
    results = []
    for once in (True, False):
        if not once:  # each layer's matmul casts its own slice (autocast's own rule)
            monkeypatch.setattr(contract, "matmul_operand_dtype", lambda like: like.dtype)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            factors = shared_factors(model)
        with OpCounter() as ops:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, labels=ids)["loss"]
            loss.backward()
        assert {f.dtype for lr in factors.values() for f in lr} == {torch.bfloat16 if once else torch.float32}
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], ops.ops["aten._to_copy"]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)
    # per block, the matmuls' own casts: the shared input side of Q, K, V 1, their stacked R's 1 (one
    # shape: one batched GEMM), and 2 each for out, FFN in and FFN out, so 2 x 8 in the forward and as
    # many in the backward, become 2 per group (3 groups) each way; cast per matmul, the shared input side
    # (``fused.shared_input_lr``) casts its concatenation and stack again in the backward: 2 more per block
    assert results[1][2] - results[0][2] == 2 * (2 * 8 - 2 * 3) + 2 * 2, (results[0][2], results[1][2])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves fp64 alone, and so does the rule
        assert tt.matmul_operand_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64
        assert tt.matmul_operand_dtype(torch.zeros(1)) == torch.bfloat16


@pytest.mark.parametrize("killed,biased,path,saved", [
    ((0, 1, 2), (True, False, True), "cpu", 2 + 2 * 2),  # ragged (a prune): the input side only
    ((0, 1, 2), (True, True, True), "cpu", 2 + 2 * 2),
    ((0, 1, 2), (True, True, True), "gpu", 2 * (2 + 2 * 2)),  # ragged, padded: the output side too
    ((0, 0, 0), (True, True, True), "cpu", 2 * (2 + 2 * 2)),  # one shape: the output side too
    ((0, 0, 0), (False, False, False), "cpu", 2 * (2 + 2 * 2)),
    ((0, 0, 0), (True, False, True), "cpu", 2 + 2 * 2),  # one shape, a bias missing: the input side only
], ids=["ragged", "ragged-all-bias", "ragged-gpu-path", "equal", "equal-no-bias", "equal-some-bias"])
def test_layers_reading_one_input_share_its_gemm(killed, biased, path, saved):
    """``project_shared_input`` (attention's Q, K, V) equals each layer on its own, forward and backward,
    at different middle ranks (a ragged prune) or equal ones, with and without a bias, in fewer GEMMs:
    the input side always, the output side too when the layers have one shape and all or no biases. On
    the GPU path (``static_shapes``) a ragged group's factors keep its padded rank, so one shape."""
    from comera_dist.bench.ops import OpCounter
    from comera_dist.compression.pruning import apply_plan, make_plan
    from comera_dist.layers.group import project_shared_input

    g = torch.Generator().manual_seed(5)
    layers = torch.nn.ModuleList(TTLinear(12, 20, in_modes=[3, 4], out_modes=[4, 5], max_rank=3, generator=g,
                                          bias=biased[i]) for i in range(3)).double()
    with torch.no_grad():
        for layer, kill in zip(layers, killed, strict=True):
            layer.gate.uniform_(0.5, 1.5, generator=g)
            at = layer.bond_offsets()[layer.d - 1]
            layer.gate[at:at + kill] = 0.0  # the middle bond keeps 3 - kill ranks
            if layer.bias is not None:
                layer.bias.normal_(generator=g)
    apply_plan(layers, make_plan(layers))
    assert [layer.bond_dims()[layer.d - 1] for layer in layers] == [3 - k for k in killed]
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    results = []
    for shared in (True, False):
        with dispatch.static_shapes() if path == "gpu" else contextlib.nullcontext():
            factors = shared_factors(layers)
        with OpCounter() as ops:
            ys = project_shared_input(layers, x, factors) if shared else [project(m, x, factors) for m in layers]
            sum((y * torch.randn(y.shape, generator=torch.Generator().manual_seed(i), dtype=y.dtype)).sum()
                for i, y in enumerate(ys)).backward()
        results.append(([y.detach() for y in ys], x.grad.clone(), [p.grad.clone() for p in layers.parameters()],
                        sum(ops.ops[f"aten.{op}"] for op in ("mm", "addmm", "bmm", "baddbmm"))))
        x.grad, _ = None, layers.zero_grad()
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert a.shape == (2, 7, 20) and a.is_contiguous()
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b)
    # separate layers: 2 GEMMs per layer forward, 4 backward. A shared side: forward 3 -> 1, backward
    # 6 -> 2 (x's gradient and the L's; the h's and the R's)
    assert results[1][3] - results[0][3] == saved, (results[0][3], results[1][3])
    with pytest.raises(ValueError, match="in_features=12"):
        project_shared_input(layers, torch.randn(2, 5, dtype=torch.float64), shared_factors(layers))


def test_layers_with_the_same_modes_but_another_split_are_grouped_apart():
    """16x4 ([4, 4] / [4]) and 4x16 ([4] / [4, 4]) have the same core shapes; only the split ``d``
    tells them apart, so they must not share one batched chain."""
    g = torch.Generator().manual_seed(0)
    layers = torch.nn.ModuleList([TTLinear(16, 4, in_modes=[4, 4], out_modes=[4], max_rank=4, generator=g),
                                  TTLinear(4, 16, in_modes=[4], out_modes=[4, 4], max_rank=4, generator=g)])
    assert layers[0].core_shapes() == layers[1].core_shapes()
    got = shared_factors(layers)
    for layer in layers:
        x = torch.randn(5, layer.in_features, generator=g)
        torch.testing.assert_close(project(layer, x, got), layer(x))
        torch.testing.assert_close(project(layer, x, got), x @ layer.to_dense() + layer.bias)

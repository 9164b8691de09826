"""A group's middle rank padded to a multiple of ``COMERA_RANK_ALIGN`` (``kernels.dispatch.aligned_rank``, default 8).

The padded ``L`` columns and ``R`` rows are zeros, so every layer gives its own output and gradients, forward and
backward, in fp64; ragged ranks after a prune that round to one aligned rank keep Q, K and V's output side one
batched GEMM; a bad value of the variable is an error that names it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.kernels import dispatch
from comera_dist.layers import TTLinear
from comera_dist.layers.group import project, project_shared_input, shared_factors


@pytest.mark.parametrize("align,want", [(None, [8, 8, 16, 32, 32]), ("1", [1, 7, 9, 30, 32]),
                                        ("16", [16, 16, 16, 32, 32])])
def test_aligned_rank_rounds_up_to_the_variable(monkeypatch, align, want):
    if align is None:
        monkeypatch.delenv("COMERA_RANK_ALIGN", raising=False)
    else:
        monkeypatch.setenv("COMERA_RANK_ALIGN", align)
    assert [dispatch.aligned_rank(r) for r in (1, 7, 9, 30, 32)] == want


@pytest.mark.parametrize("bad", ["0", "-8", "eight"])
def test_a_bad_alignment_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("COMERA_RANK_ALIGN", bad)
    with pytest.raises(ValueError, match=f"COMERA_RANK_ALIGN={bad!r} must be a positive integer"):
        dispatch.aligned_rank(30)


def _pruned_layers(killed=(0, 1, 2)) -> torch.nn.ModuleList:
    """Three 12 -> 20 layers (middle ranks 3 - killed) that read one input, with biases."""
    g = torch.Generator().manual_seed(5)
    layers = torch.nn.ModuleList(TTLinear(12, 20, in_modes=[3, 4], out_modes=[4, 5], max_rank=3, generator=g)
                                 for _ in killed).double()
    with torch.no_grad():
        for layer, kill in zip(layers, killed, strict=True):
            layer.gate.uniform_(0.5, 1.5, generator=g)
            at = layer.bond_offsets()[layer.d - 1]
            layer.gate[at:at + kill] = 0.0
            layer.bias.normal_(generator=g)
    apply_plan(layers, make_plan(layers))
    return layers


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_aligned_factors_are_zero_padded_and_give_each_layers_own_output_and_gradients(monkeypatch, path):
    monkeypatch.delenv("COMERA_RANK_ALIGN", raising=False)  # the default, 8
    layers = _pruned_layers()
    assert [m.bond_dims()[m.d - 1] for m in layers] == [3, 2, 1]
    with dispatch.static_shapes() if path == "gpu" else contextlib.nullcontext():
        got = shared_factors(layers)
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    for m in layers:
        L, R = got[id(m)]
        r = m.bond_dims()[m.d - 1]
        assert L.shape == (12, 8) and R.shape == (8, 20)  # each own rank (cpu) or the group's 3 (gpu) -> 8
        assert not L[:, r:].any() and not R[r:].any() and L[:, :r].any()
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(2, 7, 20, generator=g, dtype=torch.float64) for _ in layers]
    results = []
    for shared in (True, False):
        ys = [project(m, x, got) for m in layers] if shared else [m(x) for m in layers]
        sum((y * w).sum() for y, w in zip(ys, weights, strict=True)).backward()
        results.append(([y.detach() for y in ys], x.grad.clone(), [p.grad.clone() for p in layers.parameters()]))
        x.grad, _ = None, layers.zero_grad()
    for a, b in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b)


def test_ragged_ranks_that_align_alike_keep_one_batched_output_gemm(monkeypatch):
    """Q, K and V pruned to ranks 3, 2 and 1 on the CPU: at their own ranks the output side is three GEMMs,
    aligned to 8 it is one ``baddbmm`` over the three."""
    from comera_dist.bench.ops import OpCounter

    layers = _pruned_layers()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    counts = {}
    for align in ("8", "1"):
        monkeypatch.setenv("COMERA_RANK_ALIGN", align)
        factors = shared_factors(layers)
        with OpCounter() as ops:
            ys = project_shared_input(layers, x, factors)
        counts[align] = (ops.ops["aten.baddbmm"], ops.ops["aten.addmm"])
        for m, y in zip(layers, ys, strict=True):
            torch.testing.assert_close(y, m(x))
    assert counts == {"8": (1, 0), "1": (0, 3)}, counts


@pytest.mark.parametrize("gelu_input", [False, True])
def test_a_layer_contracted_alone_is_padded_too_and_equals_its_dense_matrix(monkeypatch, gelu_input):
    """The per-layer ``lr`` order (ZeRO-3, singletons, forced orders) pads ``L``/``R`` as a group does, and gives
    the densified matrix's output and gradients (x, cores, gate, bias) in fp64."""
    monkeypatch.delenv("COMERA_RANK_ALIGN", raising=False)
    g = torch.Generator().manual_seed(11)
    layer = TTLinear(12, 20, in_modes=[3, 4], out_modes=[4, 5], max_rank=3, order="lr", generator=g).double()
    with torch.no_grad():
        layer.gate.uniform_(0.5, 1.5, generator=g)
        layer.bias.normal_(generator=g)
    L, R = layer._halves(layer.core, layer.gate)
    assert L.shape == (12, 8) and R.shape == (8, 20)  # middle rank 3 -> 8
    assert not L[:, 3:].any() and not R[3:].any() and L[:, :3].any()
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 7, 20, generator=g, dtype=torch.float64)
    results = []
    for order in ("lr", "dense"):
        layer.order = order
        (layer(x, gelu_input=gelu_input) * w).sum().backward()
        results.append((x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
        x.grad, _ = None, layer.zero_grad()
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_pad_rank_keeps_an_aligned_rank_and_refuses_mismatched_halves(monkeypatch):
    monkeypatch.delenv("COMERA_RANK_ALIGN", raising=False)
    L, R = torch.randn(12, 16), torch.randn(16, 20)
    assert dispatch.pad_rank(L, R)[0] is L  # already a multiple of 8: no copy
    monkeypatch.setenv("COMERA_RANK_ALIGN", "1")
    L3, R3 = torch.randn(12, 3), torch.randn(3, 20)
    assert dispatch.pad_rank(L3, R3)[1] is R3  # padding off
    with pytest.raises(ValueError, match=r"pad_rank: L has rank 3 but R has 4"):
        dispatch.pad_rank(L3, torch.randn(4, 20))

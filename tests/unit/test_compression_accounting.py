"""Accounting: S with surviving ranks, per-layer report, ratios, paper oracles, ZeRO-3 shapes."""

import math

import pytest
import torch
from torch import nn

from comera_dist.compression.accounting import compression_report, core_params, model_size
from comera_dist.layers.embedding import TTEmbedding
from comera_dist.layers.linear import TTLinear


def _kill(gate: nn.Parameter, idx: list[int]) -> None:
    with torch.no_grad():
        gate[idx] = 0.0


def _small() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    m.emb = TTEmbedding(10, 6, row_modes=[2, 5], col_modes=[3, 2], ranks=[1, 4, 1], generator=g)
    m.lin = TTLinear(8, 6, in_modes=[2, 4], out_modes=[3, 2], ranks=[1, 2, 3, 2, 1], generator=g)
    m.norm = nn.LayerNorm(6)
    return m


def test_hand_counted_sizes_shrink_with_dead_gates():
    m = _small()
    # TT: 1*2*2 + 2*4*3 + 3*3*2 + 2*2*1 = 50; TTM counts m_k*n_k: 1*(2*3)*4 + 4*(5*2)*1 = 64
    assert model_size(m) == 50 + 64
    _kill(m.lin.gates[1], [0])  # bond 1: 3 -> 2 ranks: 4 + 2*4*2 + 2*3*2 + 4 = 36
    _kill(m.emb.gates[0], [1, 3])  # 4 -> 2 ranks: 6*2 + 2*10 = 32
    assert model_size(m) == 36 + 32
    # the layers' own counts (tensor.accounting) agree
    assert m.lin.param_count(active=True) == 36 and m.emb.param_count(active=True) == 32


def test_report_rows_totals_and_ratios():
    m = _small()
    _kill(m.lin.gates[1], [0])
    rep = compression_report(m)
    lin, emb = rep["layers"]["lin"], rep["layers"]["emb"]
    assert (lin["kind"], lin["dense_params"], lin["physical_params"], lin["active_params"]) == ("TTLinear", 48, 50, 36)
    assert (lin["ranks"], lin["bond_dims"]) == ([2, 2, 2], [2, 3, 2])
    assert (emb["kind"], emb["dense_params"], emb["active_params"], emb["ranks"]) == ("TTEmbedding", 60, 64, [4])
    assert lin["flops_per_token"] == m.lin.flops_per_token(active=True)
    assert emb["flops_per_token"] == m.emb.flops_per_token(active=True)
    assert rep["flops_per_token_tensorized"] == lin["flops_per_token"] + emb["flops_per_token"]
    # leftovers: LayerNorm (12) + the TT bias (6); gates are reported apart
    assert (rep["leftover_params"], rep["gate_params"]) == (18, 2 + 3 + 2 + 4)
    assert rep["size"] == 100 and rep["physical_size"] == 114
    assert rep["compression_ratio_tensorized"] == pytest.approx(108 / 100)
    assert rep["compression_ratio_model"] == pytest.approx((18 + 108) / (18 + 100))
    _kill(m.emb.gates[0], [1, 3])  # (lin's FLOPs are its dense order's, 96 at any rank: the embedding's move)
    assert compression_report(m)["layers"]["emb"]["flops_per_token"] == 24 == m.emb.flops_per_token(active=False) // 2


def test_a_model_of_tt_layers_only_has_the_tensorized_ratio():
    """No leftover parameter (a bias-free TT layer alone): the whole-model ratio is dense over active, not inf."""
    m = nn.Module()
    m.lin = TTLinear(8, 6, in_modes=[2, 4], out_modes=[3, 2], ranks=[1, 2, 3, 2, 1], bias=False)
    rep = compression_report(m)
    assert (rep["leftover_params"], rep["size"]) == (0, 50)
    assert rep["compression_ratio_model"] == rep["compression_ratio_tensorized"] == pytest.approx(48 / 50)


def test_paper_six_encoder_sizes():
    """comera-method.md section 6: the exact oracle numbers."""
    emb = TTEmbedding(30522, 768, row_modes=[16, 20, 10, 10], col_modes=[4, 4, 8, 6], max_rank=32)
    blocks = nn.ModuleList()
    for _ in range(6):
        b = nn.Module()
        b.qkvo = nn.ModuleList(TTLinear(768, 768, in_modes=[12, 8, 8], out_modes=[8, 8, 12], max_rank=30)
                               for _ in range(4))
        b.ffn_in = TTLinear(768, 3072, in_modes=[12, 8, 8], out_modes=[12, 16, 16], max_rank=30)
        b.ffn_out = TTLinear(3072, 768, in_modes=[16, 16, 12], out_modes=[8, 8, 12], max_rank=30)
        blocks.append(b)
    rep = compression_report(blocks)
    rows = rep["layers"]
    assert {r["active_params"] for k, r in rows.items() if ".qkvo." in k} == {20448}
    assert {r["active_params"] for k, r in rows.items() if ".ffn_" in k} == {28960}
    assert rep["size"] == model_size(blocks) == 838_272
    assert rep["dense_params_tensorized"] == 42_467_328
    assert round(rep["compression_ratio_tensorized"], 1) == 50.7
    assert model_size(emb) == 167_808 and emb.dense_param_count() == 23_440_896


def _partition_like_zero3(p: nn.Parameter) -> None:
    """What ZeRO-3 leaves on a rank: an empty local tensor plus the full shape in ds_shape."""
    p.ds_shape = p.shape
    p.data = torch.empty(0, dtype=p.dtype)


def test_partitioned_cores_are_counted_from_their_recorded_shapes():
    """Under ZeRO-3 a rank's flat ``core`` is an empty shard: S and the report come from the layers'
    ``core_shapes()`` and the leftovers from ``ds_shape``, never from the local tensors."""
    m = _small()
    _kill(m.lin.gates[1], [0])
    expected = compression_report(m)
    for layer in (m.lin, m.emb):
        _partition_like_zero3(layer.core)
        assert layer.core.numel() == 0 and layer.core_shapes() and layer.param_count(active=False) > 0
    _partition_like_zero3(m.norm.weight)
    assert model_size(m) == expected["size"]
    got = compression_report(m)
    assert got["layers"] == expected["layers"] and got["leftover_params"] == expected["leftover_params"]


def test_partitioned_gate_is_an_error_not_a_zero_rank():
    m = _small()
    _partition_like_zero3(m.lin.gate)
    with pytest.raises(ValueError, match=r"gate vector of TTLinear holds 0 of 7 entries .*gather the gates"):
        model_size(m)


def test_core_params_rejects_bad_ranks():
    shapes = [(1, 2, 3), (3, 4, 1)]
    assert core_params(shapes) == 18 and core_params(shapes, [2]) == 12
    with pytest.raises(ValueError, match=r"rank 0 = 4 outside \[0, 3\]"):
        core_params(shapes, [4])
    with pytest.raises(ValueError, match=r"2 cores need 1 ranks, got \[1, 1\]"):
        core_params(shapes, [1, 1])
    # no TT layer (a dense run): nothing compressed, 1 (a dashboard cannot plot inf); every rank dead: inf
    assert compression_report(nn.Linear(2, 2))["compression_ratio_tensorized"] == 1.0
    dead = _small()
    with torch.no_grad():
        for layer in (dead.lin, dead.emb):
            layer.gate.zero_()
    assert math.isinf(compression_report(dead)["compression_ratio_tensorized"])


def _random_gates(m: nn.Module, seed: int) -> None:
    """Gates with some entries at or below tau, so every bond's count differs from its size."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (m.lin, m.emb):
            for gate in layer.gates:
                gate.copy_(torch.rand(gate.shape, generator=g))
                gate[0] = 0.0


def test_size_counter_equals_model_size_as_gates_move_and_after_a_prune():
    """One counter, built once, follows the gate values of later steps (it holds the parameters, not
    their values); a prune changes shapes, and a counter built for the new shapes agrees again."""
    from comera_dist.compression.accounting import SizeCounter
    from comera_dist.compression.pruning import apply_plan, make_plan

    m = _small()
    m.lin.tau.fill_(0.3)  # layers with their own thresholds
    counter = SizeCounter(m)
    assert int(counter()) == model_size(m) == 50 + 64
    for seed in range(4):
        _random_gates(m, seed)
        got = counter()
        assert got.dtype == torch.int64 and got.dim() == 0
        assert int(got) == model_size(m), seed
    apply_plan(m, make_plan(m))
    assert int(SizeCounter(m)()) == model_size(m)


def test_size_counter_counts_working_bf16_gates_and_costs_a_fixed_handful_of_ops():
    from comera_dist.bench.ops import OpCounter
    from comera_dist.compression.accounting import SizeCounter

    m = _small()
    m.more = nn.ModuleList(TTLinear(8, 6, in_modes=[2, 4], out_modes=[3, 2], ranks=[1, 2, 3, 2, 1]) for _ in range(20))
    _random_gates(m, 7)
    m.to(torch.bfloat16)
    counter = SizeCounter(m)
    with OpCounter() as ops:
        got = counter()
    assert int(got) == model_size(m)
    # 22 layers, 64 bonds: one count over every gate vector, not ops per layer or per bond
    assert sum(ops.ops.values()) <= 16 and not ops.syncs, ops.ops


def test_size_counter_refuses_a_partitioned_gate():
    from comera_dist.compression.accounting import SizeCounter

    m = _small()
    counter = SizeCounter(m)
    _partition_like_zero3(m.lin.gate)
    with pytest.raises(ValueError, match=r"gate vector of lin holds 0 of 7 entries .*gather the gates"):
        counter()

"""The contraction-order cost model and the FLOP/param accounting, checked against measurement.

FLOPs are measured with ``torch.utils.flop_counter.FlopCounterMode`` on the real code paths and
saved-activation bytes with ``torch.autograd.graph.saved_tensors_hooks``.
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.tensor import accounting, contract
from comera_dist.tensor.cost import choose_order, order_costs

PAPER = ([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1])


def _measure(fn):
    """(forward FLOPs, bytes of distinct storages autograd saved) of ``fn()``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as fc:
        out = fn()
    return fc.get_total_flops(), seen, out


@pytest.mark.parametrize("gelu_input", [False, True])
@pytest.mark.parametrize("order", ["lr", "sequential", "dense"])
def test_flops_and_per_token_saved_bytes_match_measurement(monkeypatch, order, gelu_input):
    # the cost model counts the layer's own ranks; the lr order's zero padding to a multiple of 8
    # (kernels.dispatch.pad_rank, at most 7 ranks) is off here, as the model describes
    monkeypatch.setenv("COMERA_RANK_ALIGN", "1")
    torch.manual_seed(0)
    layer = TTLinear(96, 120, num_cores=4, max_rank=6, bias=False, order=order)
    ranks = layer.full_ranks(active=False)
    res = {}
    for T in (4, 20):
        x = torch.randn(T, 96, requires_grad=True)
        flops, seen, _ = _measure(lambda x=x: layer(x, gelu_input=gelu_input))
        skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
        res[T] = (flops, sum(b for k, b in seen.items() if k not in skip))
        assert flops == order_costs(T, layer.in_modes, layer.out_modes, ranks)[order].flops
    pred = {T: order_costs(T, layer.in_modes, layer.out_modes, ranks, gelu_input=gelu_input)[order].saved_bytes
            for T in res}
    assert res[20][1] - res[4][1] == pred[20] - pred[4]  # the token-proportional part is exact


def test_per_token_flops_of_the_paper_layers():
    assert accounting.tt_flops_per_token(*PAPER, order="lr") == 2 * 30 * (768 + 768)
    assert accounting.tt_flops_per_token(*PAPER, order="dense") == 2 * 768 * 768
    # Reference table (method doc section 4): 0.381 GFLOP forward at 4096 tokens, 768x768, r=30.
    assert round(4096 * accounting.tt_flops_per_token(*PAPER) / 1e9, 3) == 0.377  # + the L/R build:
    ffn = ([12, 8, 8], [12, 16, 16], [1, 12, 30, 30, 30, 16, 1])
    for (i, o, r), table in ((PAPER, 0.381), (ffn, 0.954)):
        # The table builds R left to right, from the middle rank outward ...
        sweep = 4096 * accounting.tt_flops_per_token(i, o, r) + accounting.chain_flops(i, r[:4]) + \
            accounting.chain_flops(o, r[3:], inward=False)
        assert round(sweep / 1e9, 3) == table
        # ... this package from its rank-1 end inward: fewer FLOPs, the same per-token part.
        assert accounting.tt_lr_flops(4096, i, o, r) < sweep
    assert round(accounting.tt_lr_flops(4096, *PAPER) / 1e9, 3) == 0.380
    assert round(accounting.tt_lr_flops(4096, *ffn) / 1e9, 3) == 0.951


def test_choose_order_depends_on_tokens_and_ranks():
    assert choose_order(1, *PAPER, d=3).name == "sequential"  # building L and R costs more than 1 token
    assert choose_order(4096, *PAPER, d=3).name == "lr"
    names = [choose_order(T, *PAPER).name for T in (1, 2, 4, 8, 16, 32, 64, 128, 1024)]
    switch = names.index("lr")
    assert set(names[:switch]) == {"sequential"} and set(names[switch:]) == {"lr"}  # one crossover
    near_full = [1, 12, 96, 768, 96, 12, 1]
    assert choose_order(4096, PAPER[0], PAPER[1], near_full).name == "dense"
    huge_mid = [1, 12, 96, 400, 96, 12, 1]
    assert choose_order(8, PAPER[0], PAPER[1], huge_mid).name == "sequential"


def test_memory_budget_excludes_orders():
    T = 1_000_000  # x L alone saves T * r_d floats; the dense weight is a constant 2.4 MB
    costs = order_costs(T, *PAPER)
    assert choose_order(T, *PAPER).name == "lr"
    assert costs["dense"].saved_bytes < costs["lr"].saved_bytes
    tight = choose_order(T, *PAPER, memory_budget=costs["lr"].saved_bytes - 1)
    assert tight.name == "dense"
    nothing = choose_order(T, *PAPER, memory_budget=1)  # nothing fits: the least memory wins
    assert nothing.saved_bytes == min(c.saved_bytes for c in costs.values())


@pytest.mark.parametrize("row_modes, col_modes", [([4, 5, 6, 5], [2, 3, 2, 2]), ([2, 3, 2, 5, 2, 5], [2, 2, 1, 3, 1, 2]),
                                                  ([10, 6, 10], [2, 3, 4])])  # odd: the first half has ceil(D/2) cores
def test_ttm_flop_formulas_match_measurement(row_modes, col_modes):
    emb = TTEmbedding(600, 24, row_modes=row_modes, col_modes=col_modes, max_rank=5)  # halves of 2 and 3 cores
    ids = torch.randperm(600)[:37]  # distinct ids: the dedup finds nothing to skip
    cores, masks, ranks = list(emb.cores), emb.masked_gates(), emb.full_ranks()
    flops, _, _ = _measure(lambda: contract.ttm_lookup_pairs(ids, *contract.ttm_pair_contract(cores, masks)))
    assert flops == accounting.ttm_pair_flops(37, emb.row_modes, emb.col_modes, ranks)
    flops, _, _ = _measure(lambda: contract.ttm_lookup_naive(ids, cores, masks))
    assert flops == accounting.ttm_naive_flops(37, emb.row_modes, emb.col_modes, ranks)
    if len(row_modes) == 4:
        assert emb.flops_per_token() == 2 * 6 * ranks[2] * 4
    if len(row_modes) == 3:  # A = cores 0-1 (N1 = 2*3), B = core 2 (N2 = 4), cut at bond 2
        assert emb.flops_per_token() == 2 * 6 * ranks[2] * 4


def test_param_counts():
    assert accounting.tt_params([12, 8, 8, 8, 8, 12], [1, 12, 30, 30, 30, 12, 1]) == 20448
    assert accounting.ttm_params([16, 20, 10, 10], [4, 4, 8, 6], [1, 32, 32, 32, 1]) == 167808
    with pytest.raises(ValueError, match="must have length"):
        accounting.tt_params([2, 2], [1, 2])
    with pytest.raises(ValueError, match="order must be one of"):
        accounting.tt_flops_per_token(*PAPER, order="fast")
    with pytest.raises(ValueError, match="tokens must be >= 0, got -1"):
        order_costs(-1, *PAPER)
    with pytest.raises(ValueError, match="d=2 differs"):
        choose_order(4, *PAPER, d=2)
    assert math.prod(PAPER[0]) == 768

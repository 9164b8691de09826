"""TiedTTHead: h E^T from the TTM embedding's cores vs the densified table, forward and backward
(layers/tied_head.py, tensor/contract.py ttm_head_*, tensor/cost.py ttm_head_costs)."""

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from tt_cases import gated_embedding

from comera_dist.compression.accounting import compression_report, model_size
from comera_dist.compression.config import LrConfig
from comera_dist.compression.groups import param_groups
from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.compression.walk import tensorized_modules
from comera_dist.layers import TiedTTHead
from comera_dist.tensor import contract
from comera_dist.tensor.cost import (
    choose_ttm_head_order,
    parse_ttm_head_order,
    ttm_head_costs,
    ttm_head_orders,
)


def _with_bias(head):
    with torch.no_grad():
        if head.bias is not None:
            head.bias.normal_()
    return head


@pytest.mark.parametrize("num_cores", [2, 3, 4])
def test_every_order_matches_the_densified_table_forward_and_backward(num_cores):
    emb = gated_embedding(V=61, N=12, num_cores=num_cores)  # 61 rows: the TTM pads them up to prod(row_modes)
    assert math.prod(emb.row_modes) > 61
    head = _with_bias(TiedTTHead(emb, bias=True))
    h = torch.randn(2, 5, 12, dtype=torch.float64)
    w = torch.randn(2, 5, 61, dtype=torch.float64)
    params = [emb.core, emb.gate, head.bias]
    h.requires_grad_(True)
    want_out = h @ emb.table().t() + head.bias  # (B, T, V): the densified reference
    want = torch.autograd.grad((want_out * w).sum(), [h, *params])
    want_out = want_out.detach()
    orders = ttm_head_orders(num_cores)
    assert len(orders) == 2 * (num_cores - 1) + 1
    for order in (*orders, "auto"):
        head.order = order
        out = head(h)
        assert out.shape == (2, 5, 61), order
        torch.testing.assert_close(out, want_out, msg=order)
        got = torch.autograd.grad((out * w).sum(), [h, *params])
        for k, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, msg=f"{order} grad {k}")
    assert emb.gate.grad is None  # autograd.grad so far; now .grad lands on the shared Parameters
    head.order = "auto"
    (head(h) * w).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (emb.core, head.bias))
    assert all(g.abs().sum() > 0 for g in emb.split_cores(emb.core.grad))  # every core's part


@pytest.mark.parametrize("num_cores", [2, 3, 4])
def test_gradcheck_float64(num_cores):
    emb = gated_embedding(V=10, N=6, num_cores=num_cores, max_rank=3)
    n = len(emb.cores)
    h = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    inputs = (h, *[c.detach().clone().requires_grad_() for c in emb.cores],
              emb.gate.detach().clone().requires_grad_())
    for order in ttm_head_orders(num_cores)[:-1]:  # every split and side (dense is the reference)
        split, side = parse_ttm_head_order(order, num_cores)

        def f(x, *p, split=split, side=side):
            return contract.ttm_head_contract(x, *contract.ttm_head_halves(list(p[:n]), emb._mask(p[n]), split), side)

        assert torch.autograd.gradcheck(f, inputs), order
    head = _with_bias(TiedTTHead(emb, bias=True))
    assert torch.autograd.gradcheck(lambda x, b: head(x) + 0 * b, (h, head.bias))


def test_padding_idx_column_is_zero_like_the_table():
    emb = gated_embedding(V=20, N=6, num_cores=2, padding_idx=3)
    head = TiedTTHead(emb, bias=False)
    h = torch.randn(4, 6, dtype=torch.float64)
    out = head(h)
    torch.testing.assert_close(out, h @ emb.table().t())
    assert torch.all(out[:, 3] == 0)


@pytest.mark.parametrize("order", [*ttm_head_orders(3), "auto"])
def test_autocast_bf16_logits_are_bf16_like_nn_linear(order):
    # An fp32 bias (the module is not cast under autocast) must not promote the bf16 logits to fp32:
    # the (T, V) logits are the largest activation of an MLM step.
    emb = gated_embedding(V=61, N=12, num_cores=3, dtype=torch.float32)
    head = _with_bias(TiedTTHead(emb, bias=True, order=order))
    dense = head.to_linear()
    h = torch.randn(2, 5, 12)
    want = (h.double() @ emb.table().double().t() + head.bias.double()).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = head(h), dense(h)
    assert ref.dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 61)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("num_cores", [3, 4, 5])  # 4 and 5: halves of 3+ cores, built inward from their rank-1 end
def test_cost_model_flops_are_the_counted_flops_and_the_choice_is_the_cheapest(num_cores):
    emb = gated_embedding(V=300, N=24, num_cores=num_cores, max_rank=5, dtype=torch.float32)
    head = TiedTTHead(emb, bias=False)
    h = torch.randn(7, 24)
    ranks = emb.full_ranks(active=False)
    costs = ttm_head_costs(7, emb.row_modes, emb.col_modes, ranks)
    for order in ttm_head_orders(num_cores):
        head.order = order
        with FlopCounterMode(display=False) as counter:
            head(h)
        assert counter.get_total_flops() == costs[order].flops, order
    best = choose_ttm_head_order(7, emb.row_modes, emb.col_modes, ranks)
    assert best.name != "dense" and best.score == min(o.score for n, o in costs.items() if n != "dense")
    head.order = "auto"
    assert head.chosen_order(7) == best.name
    assert choose_ttm_head_order(7, emb.row_modes, emb.col_modes, ranks, allow_dense=True).score == \
        min(o.score for o in costs.values())
    # The vocabulary is paid for at 2 M r x (column modes left on the far side) per token: a TTM whose
    # last core holds few columns and many rows makes split{D-1}_left far cheaper than a dense head.
    c = ttm_head_costs(1, [8, 8, 128], [16, 6, 4], [1, 16, 16, 1])
    dense_head = 2 * 8192 * 384
    assert min(o.flops for o in c.values()) - min(o.flops for o in ttm_head_costs(0, [8, 8, 128], [16, 6, 4],
                                                                              [1, 16, 16, 1]).values()) < dense_head


def test_bad_arguments_are_clear_errors():
    emb = gated_embedding()
    with pytest.raises(TypeError, match="embedding must be a TTEmbedding, got Embedding"):
        TiedTTHead(nn.Embedding(5, 4))
    with pytest.raises(ValueError, match="order must be 'auto' or one of .*got 'lr'"):
        TiedTTHead(emb, order="lr")
    head = TiedTTHead(emb)
    with pytest.raises(ValueError, match="order must be 'auto' or one of .*got 'split7_left'"):
        head.order = "split7_left"
    with pytest.raises(ValueError, match=r"h must end in embedding_dim=12, got shape \(3, 5\)"):
        head(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="split must lie in"):
        contract.ttm_head_halves(list(emb.cores), None, 0)
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        contract.ttm_head_contract(torch.randn(2, 12, dtype=torch.float64),
                                   *contract.ttm_head_halves(list(emb.cores), None, 1), "up")
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        ttm_head_costs(-1, [2, 2], [2, 2], [1, 2, 1])


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.word = gated_embedding(V=40, N=12, num_cores=3, max_rank=4)
        self.head = TiedTTHead(self.word, bias=True)


def test_shared_cores_are_counted_sliced_and_optimized_once():
    model = _Tied()
    assert [n for n, _ in tensorized_modules(model)] == ["word"]
    assert [n for n, _ in model.named_modules()] == ["", "word", "head"]
    assert set(model.state_dict()) == {"word.core", "word.gate", "word.tau", "word.bond_sizes", "head.bias"}
    groups = param_groups(model, LrConfig())
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters())) == 3
    rep = compression_report(model)
    assert rep["leftover_params"] == 40 and rep["dense_params_tensorized"] == 40 * 12  # head bias; one table
    # Prune the embedding's dead rank: the head sees the sliced cores, the output is unchanged.
    h = torch.randn(5, 12, dtype=torch.float64)
    size, dims = model_size(model), model.word.bond_dims()
    opt = torch.optim.AdamW(model.parameters())
    model.head(h).sum().backward()
    opt.step()
    before = model.head(h).detach()
    apply_plan(model, make_plan(model), opt)
    assert model.word.bond_dims() == [dims[0] - 1, *dims[1:]]
    torch.testing.assert_close(model.head(h), before)
    torch.testing.assert_close(model.head(h), h @ model.word.table().t() + model.head.bias)
    assert model_size(model) <= size
    live = {id(p) for p in model.parameters()}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == live  # the optimizer holds the new ones once

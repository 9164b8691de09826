"""TTLinear: every order vs the densified weight, conversion, gates, bad input (layers/linear.py)."""

import pytest
import torch
from torch import nn

from comera_dist.kernels import dispatch
from comera_dist.layers import TTLinear
from comera_dist.tensor.tt import tt_to_dense

ORDERS = ["lr", "sequential", "dense"]


def _layer(in_f=24, out_f=30, num_cores=4, max_rank=4, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = TTLinear(in_f, out_f, num_cores=num_cores, max_rank=max_rank, dtype=dtype, **kw)
    with torch.no_grad():
        layer.bias.normal_()
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
        layer.gates[-1][1] = 0.001  # below tau: masked out, but kept in storage
    return layer


@pytest.mark.parametrize("num_cores", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("order", ORDERS)
def test_forward_backward_match_the_dense_layer(order, num_cores):
    layer = _layer(in_f=48, out_f=32, num_cores=num_cores, order=order)
    dense = layer.to_linear()
    x = torch.randn(2, 3, 48, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y, dense(x))
    w = torch.randn_like(y)
    gx, = torch.autograd.grad((y * w).sum(), x)
    gx_dense, = torch.autograd.grad((dense(x) * w).sum(), x)
    torch.testing.assert_close(gx, gx_dense)
    # Parameter gradients against the same loss through the densified (masked) weight.
    got = torch.autograd.grad((layer(x) * w).sum(), list(layer.parameters()))
    want = torch.autograd.grad(((x @ layer.dense_weight() + layer.bias) * w).sum(), list(layer.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("order", ORDERS)
def test_layer_gradcheck(order):
    layer = _layer(in_f=12, out_f=6, num_cores=4, max_rank=3, order=order)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    params = list(layer.parameters())

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip([n for n, _ in layer.named_parameters()], ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7)


def test_auto_order_follows_the_cost_model_and_lr_goes_through_dispatch(monkeypatch):
    layer = TTLinear(768, 768)
    assert layer.chosen_order(1) == "sequential" and layer.chosen_order(4096) == "lr"
    calls = []
    real = dispatch.tt_linear
    monkeypatch.setattr(dispatch, "tt_linear", lambda *a: calls.append(a[1].shape) or real(*a))
    x = torch.randn(256, 768)
    with dispatch.use_backend("torch"):
        y = layer(x)
        y1 = layer(x[:1])
    assert calls == [(768, dispatch.aligned_rank(30))]  # only the 256-token call took the (x L) R path
    torch.testing.assert_close(y, x @ layer.dense_weight() + layer.bias, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y1, y[:1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gelu_input", [False, True])
@pytest.mark.parametrize("order", [*ORDERS, "auto"])
def test_empty_batch_matches_nn_linear_shapes(order, gelu_input):
    # T = 0 (an empty shard or a fully padded micro-batch): auto picks ``sequential`` there.
    layer = _layer(in_f=48, out_f=32, num_cores=6, order=order)
    dense = layer.to_linear()
    x = torch.randn(0, 48, dtype=torch.float64, requires_grad=True)
    y = layer(x, gelu_input=gelu_input)
    want = dense(x)
    assert y.shape == want.shape == (0, 32) and y.dtype == want.dtype
    assert layer(torch.randn(2, 0, 48, dtype=torch.float64)).shape == (2, 0, 32)
    params = list(layer.parameters())
    got = torch.autograd.grad(y.sum(), [x, *params])
    assert got[0].shape == (0, 48)
    for p, g in zip(params, got[1:]):
        assert g.shape == p.shape and not g.any()  # no tokens, no gradient (bias included)


@pytest.mark.parametrize("num_cores", [2, 4, 6])
def test_from_linear_full_rank_is_exact(num_cores):
    lin = nn.Linear(24, 36, dtype=torch.float64)
    layer = TTLinear.from_linear(lin, max_rank=10**6, num_cores=num_cores)
    x = torch.randn(5, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x), lin(x), rtol=1e-10, atol=1e-10)
    back = layer.to_linear()
    torch.testing.assert_close(back.weight, lin.weight, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(back.bias, lin.bias)


def test_from_linear_truncated_is_a_good_low_rank_fit():
    u, v = torch.randn(24, 2, dtype=torch.float64), torch.randn(2, 36, dtype=torch.float64)
    lin = nn.Linear(24, 36, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_((u @ v).T)  # rank 2 across the middle bond (input modes | output modes)
    layer = TTLinear.from_linear(lin, max_rank=10**6, num_cores=4, ranks=[1, 6, 2, 6, 1])
    assert layer.bond_dims() == [6, 2, 6] and layer.bias is None
    torch.testing.assert_close(layer.to_linear().weight, lin.weight, rtol=1e-9, atol=1e-9)


def test_default_init_std():
    torch.manual_seed(0)
    stds = [TTLinear(256, 256, num_cores=4, max_rank=16).dense_weight().std().item() for _ in range(8)]
    assert abs(sum(stds) / len(stds) / (1 / 512) ** 0.5 - 1) < 0.1


def test_gates_mask_without_overwriting():
    layer = _layer()
    before = [g.detach().clone() for g in layer.gates]
    x = torch.randn(4, 24, dtype=torch.float64)
    layer.eval()
    layer(x)
    layer.train()
    layer(x).sum().backward()
    for g, b in zip(layer.gates, before):
        assert torch.equal(g.detach(), b)
    grad = layer.gate.grad.split(layer.bond_dims())[-1]  # the last bond's part of the one gate vector
    assert grad[1] == 0 and grad[0] != 0
    assert layer.ranks()[-1] == layer.bond_dims()[-1] - 1
    # Raising the gate back above tau restores the rank: masking is reversible.
    with torch.no_grad():
        layer.gates[-1][1] = 1.0
    assert layer.ranks()[-1] == layer.bond_dims()[-1]
    assert set(layer.state_dict()) == {"tau", "gate", "core", "bond_sizes", "bias"}
    # one core and one gate parameter for the layer (each parameter tensor costs the optimizer and ZeRO per step)
    assert [n for n, _ in layer.named_parameters()] == ["core", "gate", "bias"]
    assert [tuple(g.shape) for g in layer.gates] == [(r,) for r in layer.bond_dims()]
    size = layer.gate.element_size()  # the views share the parameter's storage, each at its bond's offset
    assert all(g.data_ptr() == layer.gate.data_ptr() + size * at for g, at in zip(layer.gates, layer.bond_offsets()))
    assert [tuple(c.shape) for c in layer.cores] == layer.core_shapes() and layer.core.numel() == layer.param_count(False)
    at = 0
    for c in layer.cores:  # the cores too: views of the flat core, end to end
        assert c.data_ptr() == layer.core.data_ptr() + size * at
        at += c.numel()


def test_bad_input_names_the_parameter():
    cases = [
        ({"in_modes": [5, 5], "out_modes": [6, 5]}, r"in_modes=\[5, 5\] has product 25, which differs from the dimension 24"),
        ({"in_modes": [4, 6], "out_modes": [6, 6]}, r"out_modes=\[6, 6\] has product 36, which differs from the dimension 30"),
        ({"ranks": [1, 0, 4, 1, 1]}, r"ranks\[1\] must be an int >= 1 \(rank\), got 0"),
        ({"max_rank": 0}, r"max_rank must be an int >= 1, got 0"),
        ({"tau": 0.0}, r"tau must be a number > 0 \(the gate threshold\), got 0.0"),
        ({"tau": -1e-3}, r"tau must be a number > 0 \(the gate threshold\), got -0.001"),
        ({"num_cores": 1}, r"num_cores must be an int >= 2, got 1"),
        ({"order": "fastest"}, r"order must be 'auto' or one of .*, got 'fastest'"),
        ({"init_std": 0.0}, r"init std must be > 0, got 0.0"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            TTLinear(24, 30, **{"num_cores": 4, **kw})
    with pytest.raises(ValueError, match=r"in_features must be an int >= 1, got 0"):
        TTLinear(0, 30)
    for num_cores in (2, 3):  # in_modes alone: the output side gets num_cores - len(in_modes) cores
        with pytest.raises(ValueError, match=rf"num_cores={num_cores} leaves no output core after in_modes=\[2, 3, 4\] "
                                             rf"\(3 cores\): pass num_cores >= 4 or out_modes"):
            TTLinear(24, 24, in_modes=[2, 3, 4], num_cores=num_cores)
    assert TTLinear(24, 24, in_modes=[2, 3, 4], num_cores=4).out_modes == [24]
    # an odd core count puts ceil(num_cores / 2) cores on the input side (the class docstring)
    assert (len(TTLinear(24, 30, num_cores=5).in_modes), len(TTLinear(24, 30, num_cores=5).out_modes)) == (3, 2)
    assert (len(TTLinear(24, 30, num_cores=3).in_modes), len(TTLinear(24, 30, num_cores=3).out_modes)) == (2, 1)
    with pytest.raises(ValueError, match=r"input last dim is 23, TTLinear expects in_features=24"):
        TTLinear(24, 30)(torch.randn(2, 23))


def test_from_dense_and_to_dense_round_trip():
    W = torch.randn(12, 20, dtype=torch.float64)
    b = torch.randn(20, dtype=torch.float64)
    layer = TTLinear.from_dense(W, b, max_rank=10**6, num_cores=3)
    torch.testing.assert_close(layer.to_dense(), W, rtol=1e-10, atol=1e-10)
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ W + b, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"weight must be 2-D \(N_in, N_out\), got shape \(12,\)"):
        TTLinear.from_dense(b[:12], max_rank=4)


def test_a_gate_equal_to_tau_is_dead():
    """``m(g) = g [g > tau]`` (method doc section 2): the comparison is strict, so a gate exactly at the
    threshold is masked out of the forward and the rank (0.5 is exact in every float dtype)."""
    layer = _layer(tau=0.5)
    with torch.no_grad():
        layer.gate.fill_(1.0)
        layer.gates[1][0] = 0.5
        layer.gates[1][1] = 0.5 + 2**-20
    assert layer.ranks() == [r - (k == 1) for k, r in enumerate(layer.bond_dims())]
    assert layer.masked_gates()[1][0] == 0 and layer.masked_gates()[1][1] == 0.5 + 2**-20
    x = torch.randn(5, 24, dtype=torch.float64)
    cores = list(layer.cores)
    masks = [g.detach().clone() for g in layer.gates]
    masks[1][0] = 0.0
    torch.testing.assert_close(layer(x), x @ tt_to_dense(cores, masks, layer.d) + layer.bias)

"""``tensor.fused.gelu_matmul`` and the FFN out-projections that use it, against the unfused reference.

The fused op must equal ``F.gelu(u) @ w`` forward and backward, and it must keep less for backward:
``u`` alone, not ``gelu(u)`` as well (measured with saved-tensor hooks).
"""

import pytest
import torch
import torch.nn.functional as F
from autograd_testlib import saved_storages

from comera_dist.layers import TTLinear
from comera_dist.layers.dense import Linear
from comera_dist.tensor import contract
from comera_dist.tensor.fused import gelu_matmul, scaled_bmm


def test_gelu_matmul_passes_gradcheck_in_fp64():
    torch.manual_seed(0)
    u = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gelu_matmul, (u, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_matmul_equals_gelu_then_matmul_forward_and_backward(dtype):
    torch.manual_seed(1)
    u0, w0, g = torch.randn(64, 96, dtype=dtype), torch.randn(96, 12, dtype=dtype), torch.randn(64, 12, dtype=dtype)
    outs = []
    for fused in (True, False):
        u, w = u0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = gelu_matmul(u, w) if fused else F.gelu(u) @ w
        y.backward(g)
        outs.append((y, u.grad, w.grad))
    for a, b in zip(*outs):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b)  # the same ops in the same dtype


@pytest.mark.parametrize("u_dtype", [torch.float32, torch.bfloat16])
def test_gelu_matmul_under_autocast_computes_what_the_unfused_ops_do(u_dtype):
    """GELU in u's own dtype, then the product and its bias in autocast's; gradients in the inputs' dtypes."""
    torch.manual_seed(2)
    u0, w0, b0 = torch.randn(32, 48, dtype=u_dtype), torch.randn(48, 8), torch.randn(8)
    res = []
    for fused in (True, False):
        u, w, b = (t.clone().requires_grad_() for t in (u0, w0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = gelu_matmul(u, w, b) if fused else torch.nn.functional.linear(F.gelu(u), w.T, b)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        assert (u.grad.dtype, w.grad.dtype, b.grad.dtype) == (u_dtype, torch.float32, torch.float32)
        res.append((y, u.grad, w.grad, b.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b)


def test_gelu_matmul_leaves_fp64_alone_under_autocast():
    u, w = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gelu_matmul(u, w)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, F.gelu(u) @ w)


def test_gelu_matmul_keeps_the_pre_activation_only():
    u = torch.randn(128, 256, requires_grad=True)
    w = torch.randn(256, 8, requires_grad=True)
    _, fused = saved_storages(lambda: gelu_matmul(u, w))
    _, plain = saved_storages(lambda: F.gelu(u) @ w)
    leaf = {u.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    assert sum(b for k, b in fused.items() if k not in leaf) == 0  # u and w only
    assert sum(b for k, b in plain.items() if k not in leaf) == 128 * 256 * 4  # gelu(u) as well


def test_gelu_matmul_names_bad_shapes():
    with pytest.raises(ValueError, match=r"u \(T, F\) and w \(F, N\).*\(4, 5\) and \(6, 2\)"):
        gelu_matmul(torch.randn(4, 5), torch.randn(6, 2))
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\), got \(3,\)"):
        gelu_matmul(torch.randn(4, 5), torch.randn(5, 2), torch.randn(3))


@pytest.mark.parametrize("order", ["lr", "sequential", "dense"])
def test_tt_linear_gelu_input_equals_the_layer_of_gelu(order):
    torch.manual_seed(3)
    layer = TTLinear(96, 40, num_cores=4, max_rank=6, order=order)
    with torch.no_grad():
        layer.gate.uniform_(0.0, 1.0)  # some bonds masked
    x0 = torch.randn(2, 10, 96)
    res = []
    for fused in (True, False):
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        y = layer(x, gelu_input=True) if fused else layer(F.gelu(x))
        y.square().sum().backward()
        res.append((y, x.grad, layer.core.grad, layer.gate.grad, layer.bias.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tt_linear_gelu_input_with_shared_factors_equals_the_reference():
    torch.manual_seed(4)
    layer = TTLinear(96, 40, num_cores=4, max_rank=6)
    x = torch.randn(12, 96)
    L, R = layer._halves(layer.core, layer.gate)
    torch.testing.assert_close(layer(x, factors=(L, R), gelu_input=True),
                               contract.tt_linear_lr(F.gelu(x), L, R, layer.bias), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(x, factors=(L, R), gelu_input=True), F.gelu(x) @ layer.to_dense() + layer.bias,
                               rtol=1e-4, atol=1e-5)  # the TT format against its densified matrix


def test_dense_linear_gelu_input_equals_nn_linear_of_gelu():
    torch.manual_seed(5)
    layer = Linear(48, 16)
    x0 = torch.randn(3, 7, 48)
    res = []
    for fused in (True, False):
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        y = layer(x, gelu_input=True) if fused else torch.nn.functional.linear(F.gelu(x), layer.weight, layer.bias)
        y.square().sum().backward()
        res.append((y, x.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b)
    assert torch.equal(layer(x0), torch.nn.functional.linear(x0, layer.weight, layer.bias))  # default: plain


def test_dense_linear_under_zero3_takes_the_unfused_path():
    """A ZeRO-3 weight (DeepSpeed marks it with ``ds_id``) is freed after the forward; the fused path
    would save ``weight.T``, a view that keeps the gathered storage alive, so it takes the unfused path
    (whose linear DeepSpeed replaces with one that saves the parameter; not run here)."""
    torch.manual_seed(9)
    layer = Linear(48, 16)
    x = torch.randn(5, 48, requires_grad=True)
    _, fused = saved_storages(lambda: layer(x, gelu_input=True))
    layer.weight.ds_id = 0
    y, zero3 = saved_storages(lambda: layer(x, gelu_input=True))
    weight = layer.weight.untyped_storage().data_ptr()
    assert weight in fused and weight in zero3  # each saves the weight: as a view of it, or as itself
    assert len(zero3) > len(fused)  # ... and unfused, gelu(x) as well
    torch.testing.assert_close(y, torch.nn.functional.linear(F.gelu(x), layer.weight, layer.bias))


def test_gelu_matmul_compiles_fullgraph():
    torch.manual_seed(6)
    layer = TTLinear(96, 40, num_cores=4, max_rank=6)
    x0 = torch.randn(16, 96)
    fn = torch.compile(lambda x: layer(x, gelu_input=True), fullgraph=True, backend="aot_eager")
    res = []
    for f in (fn, lambda x: layer(x, gelu_input=True)):
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        y = f(x)
        y.sum().backward()
        res.append((y, x.grad, layer.core.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("core_left", [False, True])
def test_scaled_bmm_passes_gradcheck_in_fp64(core_left):
    torch.manual_seed(7)
    G, r, n, r2 = 2, 3, 4, 5
    c = torch.randn(G, r, n, r2, dtype=torch.float64, requires_grad=True)
    m = torch.randn(G, r2, dtype=torch.float64, requires_grad=True)
    a = torch.randn(G, r2, 6, dtype=torch.float64, requires_grad=True) if core_left else \
        torch.randn(G, 6, r, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c, m: scaled_bmm(a, c, m, core_left), (a, c, m))


@pytest.mark.parametrize("core_left", [False, True])
def test_scaled_bmm_equals_bmm_of_the_scaled_core_and_keeps_no_scaled_copy(core_left):
    torch.manual_seed(8)
    G, r, n, r2 = 3, 4, 6, 5
    stack = torch.randn(G, r * n * r2 + 7, requires_grad=True)  # a group's stacked flat cores
    m0 = torch.rand(G, r2)
    a0 = torch.randn(G, r2, 9) if core_left else torch.randn(G, 9, r)
    res, kept = [], []
    for fused in (True, False):
        stack.grad = None
        m, a = m0.clone().requires_grad_(), a0.clone().requires_grad_()
        c = stack[:, 7:].view(G, r, n, r2)  # a view, as layers.ragged hands it over

        def step(c=c, m=m, a=a, fused=fused):
            if fused:
                return scaled_bmm(a, c, m, core_left)
            s = c * m.view(G, 1, 1, -1)
            return torch.bmm(s.reshape(G, r * n, r2), a) if core_left else torch.bmm(a, s.reshape(G, r, n * r2))

        y, seen = saved_storages(step)
        y.square().sum().backward()
        res.append((y, stack.grad.clone(), m.grad, a.grad))
        leaves = {t.untyped_storage().data_ptr() for t in (stack, m, a)}
        kept.append(sum(b for k, b in seen.items() if k not in leaves))
    for x, z in zip(*res):
        torch.testing.assert_close(x, z)
    assert kept[0] == 0 and kept[1] == G * r * n * r2 * 4  # the plain path keeps the scaled core


def test_scaled_bmm_without_a_mask_is_a_plain_bmm():
    c, a = torch.randn(2, 3, 4, 5), torch.randn(2, 6, 3)
    torch.testing.assert_close(scaled_bmm(a, c, None, False), torch.bmm(a, c.reshape(2, 3, 20)))

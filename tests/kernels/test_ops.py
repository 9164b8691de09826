"""The ``comera::`` custom ops: schema/fake/autograd registrations (opcheck) and torch.compile tracing."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import DEVICE, needs_interpreter, needs_kernels

from comera_dist.kernels import dispatch
from comera_dist.kernels import ops as _ops  # noqa: F401  (importing registers the comera:: ops)
from comera_dist.tensor.contract import tt_linear_lr, ttm_lookup_pairs


@needs_kernels
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_tt_linear(bias):
    x = torch.randn(20, 18, device=DEVICE, requires_grad=True)
    L = torch.randn(18, 5, device=DEVICE, requires_grad=True)
    R = torch.randn(5, 17, device=DEVICE, requires_grad=True)
    b = torch.randn(17, device=DEVICE, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.comera.tt_linear.default, (x, L, R, b))


@needs_kernels
def test_opcheck_ttm_lookup():
    ids = torch.tensor([3, 1, 3, 0, 5, 3], device=DEVICE)
    A = torch.randn(3, 4, 5, device=DEVICE, requires_grad=True)
    B = torch.randn(5, 2, 6, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.comera.ttm_lookup.default, (ids, A, B))


def test_fake_tensors_give_shapes_without_running_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.ops.comera.tt_linear(torch.empty(7, 16), torch.empty(16, 3), torch.empty(3, 9), None)
        rows = torch.ops.comera.ttm_lookup(torch.zeros(11, dtype=torch.int64), torch.empty(4, 3, 5),
                                           torch.empty(5, 6, 2))
    assert y.shape == (7, 9) and rows.shape == (11, 6)


@needs_kernels
def test_compile_traces_dispatch_fwd_and_bwd_without_graph_breaks():
    """fullgraph=True fails on any graph break; AOT autograd must trace both directions as our ops."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, list] = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))

    def step(x, L, R, b, ids, A, B):
        y = dispatch.tt_linear(x, L, R, b)  # (T, N_out)
        e = dispatch.ttm_lookup(ids, A, B)  # (T, N1*N2)
        return (y * e).sum()

    args = [a.to(DEVICE) for a in (torch.randn(6, 16), torch.randn(16, 3), torch.randn(3, 8), torch.randn(8),
                                   torch.tensor([0, 2, 2, 5, 1, 0]), torch.randn(3, 2, 4), torch.randn(4, 2, 4))]
    fast = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    ref = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with dispatch.use_backend("triton"):
        loss = compiled(*fast)
    loss.backward()
    fw, bw = graphs["fw"][0].code, graphs["bw"][0].code
    assert "comera.tt_linear.default" in fw and "comera.ttm_lookup.default" in fw
    assert "comera.tt_linear_backward.default" in bw and "comera.ttm_lookup_backward.default" in bw

    expected = (tt_linear_lr(*ref[:4]) * ttm_lookup_pairs(*ref[4:])).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for i, (f, r) in enumerate(zip(fast, ref)):
        if r.requires_grad:
            torch.testing.assert_close(f.grad, r.grad, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"arg {i}: {m}")


@needs_interpreter
def test_autocast_matches_the_reference_path():
    """Custom ops are invisible to autocast: the wrapper casts like the reference's matmul/addmm do."""
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(20, 18, generator=g), torch.randn(17, generator=g)
    L, R = torch.randn(18, 5, generator=g) / 18**0.5, torch.randn(5, 17, generator=g) / 5**0.5
    ids, A, B = torch.tensor([0, 4, 4, 7]), torch.randn(3, 4, 5, generator=g), torch.randn(5, 3, 6, generator=g)
    results = {}
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_(True) for t in (x, L, R, b, A, B)]
        with dispatch.use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
            y = dispatch.tt_linear(leaves[0].to(torch.bfloat16), *leaves[1:4])  # (20, 17)
            e = dispatch.ttm_lookup(ids, leaves[4].to(torch.bfloat16), leaves[5])  # (4, 12)
        (y.float().square().sum() + e.float().square().sum()).backward()
        results[backend] = [y, e] + [t.grad for t in leaves]
    for i, (ref, got) in enumerate(zip(results["torch"], results["triton"])):
        assert got.dtype == ref.dtype, f"output {i}: {got.dtype} != {ref.dtype}"
        scale = ref.abs().max().item()
        torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2 * scale,
                                   msg=lambda m, i=i: f"output {i}: {m}")


@needs_kernels
def test_stride_zero_upstream_gradient():
    """``.sum().backward()`` hands the op an expanded (stride 0) gradient; both ops must accept it."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(20, 18, generator=g), torch.randn(18, 5, generator=g), torch.randn(5, 17, generator=g),
            torch.tensor([0, 4, 4, 7]), torch.randn(3, 4, 5, generator=g), torch.randn(5, 3, 6, generator=g)]
    args = [a.to(DEVICE) for a in args]
    grads = {}
    for backend in ("torch", "triton"):
        leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        with dispatch.use_backend(backend):
            loss = dispatch.tt_linear(*leaves[:3]).sum() + dispatch.ttm_lookup(*leaves[3:]).sum()
        loss.backward()
        grads[backend] = [t.grad for t in leaves if t.requires_grad]
    for ref, got in zip(grads["torch"], grads["triton"]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

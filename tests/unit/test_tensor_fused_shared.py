"""``tensor.fused.shared_input_lr`` (attention's Q, K, V through one input GEMM) against the plain ops.

It must equal ``x [L_1|..|L_n]`` then ``h_i R_i + b_i`` (batched when the layers have one shape), forward and
backward, in fp64, fp32, bf16 and under autocast, and keep less for backward: the factors as given (views of
their group's stacks), not the concatenation of the L's and the stack of the R's (saved-tensor hooks).
The CUDA cases need a GPU (``launch/gpu_check.sh``'s kernel-tests run this file).
"""

import pytest
import torch
from autograd_testlib import saved_storages

from comera_dist.tensor.fused import shared_input_lr

ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


def _plain(x, Ls, Rs, biases):
    """The ops the fused one replaces (``contract.tt_linear_lr_shared`` before it)."""
    h = x @ torch.cat(Ls, dim=1)
    if len({tuple(R.shape) for R in Rs}) == 1 and len({b is None for b in biases}) == 1:
        hs = h.view(h.shape[0], len(Rs), Rs[0].shape[0]).transpose(0, 1)
        R = torch.stack(Rs)
        out = torch.bmm(hs, R) if biases[0] is None else torch.baddbmm(torch.stack(biases).unsqueeze(1), hs, R)
        return list(out.unbind(0))
    parts = h.split([L.shape[1] for L in Ls], dim=1)
    return [hi @ R if b is None else torch.addmm(b, hi, R) for hi, R, b in zip(parts, Rs, biases, strict=True)]


# (middle ranks, which layers have a bias): one shape (batched output side) or ragged (a prune on the CPU)
CASES = {"one-shape": ((4, 4, 4), (True, True, True)), "one-shape-no-bias": ((4, 4, 4), (False, False, False)),
         "one-shape-some-bias": ((4, 4, 4), (True, False, True)), "ragged": ((4, 2, 3), (True, False, True))}


def _operands(ranks, biased, dtype=torch.float64, n_in=10, n_out=12, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_()

    return leaf(7, n_in), [leaf(n_in, r) for r in ranks], [leaf(r, n_out) for r in ranks], \
        [leaf(n_out) if b else None for b in biased]


@pytest.mark.parametrize("case", list(CASES))
def test_shared_input_lr_passes_gradcheck_in_fp64(case):
    x, Ls, Rs, bs = _operands(*CASES[case])
    n = len(Ls)
    inputs = (x, *Ls, *Rs, *[b for b in bs if b is not None])
    where = [i for i, b in enumerate(bs) if b is not None]

    def fn(x, *p):
        biases = [None] * n
        for i, b in zip(where, p[2 * n:], strict=True):
            biases[i] = b
        return tuple(shared_input_lr(x, list(p[:n]), list(p[n:2 * n]), biases))

    assert torch.autograd.gradcheck(fn, inputs)


def _run(fn, x, Ls, Rs, bs, autocast=False):
    leaves = [x, *Ls, *Rs, *[b for b in bs if b is not None]]
    for t in leaves:
        t.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        ys = fn(x, Ls, Rs, bs)
    g = torch.Generator().manual_seed(9)
    sum((y.float() * torch.randn(y.shape, generator=g).to(y.device)).sum() for y in ys).backward()
    return [y.detach() for y in ys], [t.grad for t in leaves]


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)], ids=["fp32", "bf16", "autocast"])
def test_shared_input_lr_equals_the_plain_ops_forward_and_backward(case, dtype, autocast, device):
    operands = _operands(*CASES[case], dtype=dtype, device=device)
    fused_out, fused_grads = _run(shared_input_lr, *operands, autocast=autocast)
    plain_out, plain_grads = _run(_plain, *operands, autocast=autocast)
    for a, b in zip(fused_out, plain_out, strict=True):
        assert a.dtype == b.dtype == (torch.bfloat16 if autocast else dtype) and a.is_contiguous()
        torch.testing.assert_close(a, b)
    x, Ls, Rs, bs = operands
    leaves = [x, *Ls, *Rs, *[b for b in bs if b is not None]]
    for a, b, leaf in zip(fused_grads, plain_grads, leaves, strict=True):
        assert a.dtype == b.dtype == leaf.dtype  # each gradient in its input's dtype
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("ranks", [(4, 4, 4), (4, 2, 3)], ids=["one-shape", "ragged"])
def test_shared_input_lr_keeps_the_factors_not_their_concatenation_and_stack(ranks):
    """The factors are views of their group's stacked contraction (``layers.group``), as in a model: the
    fused op keeps x, h and those stacks; the plain ops keep a concatenated L and, batched, a stacked R."""
    T, n_in, n_out, r = 64, 96, 80, max(ranks)
    x = torch.randn(T, n_in, requires_grad=True)
    L_stack = torch.randn(3, n_in, r, requires_grad=True) * 1.0  # non-leaf, like a group's contraction
    R_stack = torch.randn(3, r, n_out, requires_grad=True) * 1.0
    Ls = [L[:, :k] for L, k in zip(L_stack.unbind(0), ranks, strict=True)]
    Rs = [R[:k] for R, k in zip(R_stack.unbind(0), ranks, strict=True)]
    bs = [None] * 3
    _, fused = saved_storages(lambda: shared_input_lr(x, Ls, Rs, bs))
    _, plain = saved_storages(lambda: _plain(x, Ls, Rs, bs))
    h_bytes = T * sum(ranks) * 4
    kept = {x.untyped_storage().data_ptr(), L_stack.untyped_storage().data_ptr(),
            R_stack.untyped_storage().data_ptr()}
    assert set(fused) - kept == {next(p for p in fused if p not in kept)}  # h alone besides those
    assert sum(b for p, b in fused.items() if p not in kept) == h_bytes
    extra = n_in * sum(ranks) * 4 + (3 * r * n_out * 4 if len(set(ranks)) == 1 else 0)  # cat (and stack)
    assert sum(b for p, b in plain.items() if p not in kept) == h_bytes + extra


def test_shared_input_lr_names_bad_operands():
    x, Ls, Rs, bs = _operands((4, 4), (False, False))
    with pytest.raises(ValueError, match="as many L, R and biases.*2, 1 and 2"):
        shared_input_lr(x, Ls, Rs[:1], bs)
    with pytest.raises(ValueError, match=r"x \(7, 10\), L \(10, 4\) and R \(3, 12\) do not chain"):
        shared_input_lr(x, Ls, [Rs[0], Rs[1][:3]], bs)

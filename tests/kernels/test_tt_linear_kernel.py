"""The fused TT-linear Triton kernels against the reference ``(x L) R + b``, forward and backward.

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py);
the ``gpu`` tests repeat the comparison natively (TRITON_INTERPRET=0), in fp32 and bf16, at the paper's
shape and an odd one, and in bf16 for every autotuning config.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import (
    DEVICE,
    bf16_cases,
    bf16_error_vs_torch,
    compare_with_reference,
    gpu_test,
    needs_kernels,
    pin_config,
    tt_operands,
)

from comera_dist.kernels import ops, tt_linear_kernel
from comera_dist.tensor.contract import tt_linear_lr

pytestmark = needs_kernels

# (T, N_in, N_out, r, bias): sizes off the block grid, r = 1, r not a power of two (5, 17, 30),
# several row/column/reduction tiles, T spanning several 64-row tiles.
SHAPES = [
    (1, 16, 16, 1, True),
    (37, 20, 33, 5, True),
    (70, 40, 18, 30, False),
    (16, 96, 80, 17, True),
    (130, 24, 24, 8, True),
]


@pytest.mark.parametrize("T,n_in,n_out,rank,bias", SHAPES)
def test_matches_reference_fp32(T, n_in, n_out, rank, bias):
    args = tt_operands(T, n_in, n_out, rank, bias=bias)
    compare_with_reference(ops.tt_linear, tt_linear_lr, args, rtol=1e-4, atol=1e-4)


def test_bf16_operands_match_fp32_reference():
    """bf16 in, bf16 out, fp32 accumulation (the interpreter upcasts dot operands; GPUs use bf16 MMA)."""
    args = tt_operands(37, 20, 33, 5, bias=True, dtype=torch.bfloat16)
    y = tt_linear_kernel.tt_linear_fwd(*args)
    assert y.dtype == torch.bfloat16
    compare_with_reference(ops.tt_linear, lambda *a: tt_linear_lr(*[t.float() for t in a]).to(torch.bfloat16),
                           args, rtol=3e-2, atol=3e-2)


@settings(max_examples=6, deadline=None)
@given(T=st.integers(1, 50), n_in=st.integers(1, 40), n_out=st.integers(1, 40), rank=st.integers(1, 33),
       bias=st.booleans())
def test_matches_reference_random_shapes(T, n_in, n_out, rank, bias):
    args = tt_operands(T, n_in, n_out, rank, bias=bias, seed=T * 1000 + n_in)
    compare_with_reference(ops.tt_linear, tt_linear_lr, args, rtol=1e-4, atol=1e-4)


def test_split_grids_match_reference():
    """Forcing several programs per row tile (forward) and per T-slice (backward) changes nothing."""
    x, L, R, b = tt_operands(130, 24, 80, 8, bias=True)
    y = tt_linear_kernel.tt_linear_fwd(x, L, R, b, n_split=2)  # (130, 80)
    torch.testing.assert_close(y, tt_linear_lr(x, L, R, b), rtol=1e-4, atol=1e-4)
    dy = torch.randn_like(y)
    leaves = [t.clone().requires_grad_(True) for t in (x, L, R, b)]
    tt_linear_lr(*leaves).backward(dy)
    grads = tt_linear_kernel.tt_linear_bwd(dy, x, L, R, need_db=True, t_split=3)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("blocks", [(16, 64, 16), (64, 16, 32)])
def test_other_autotune_block_shapes_match_reference(monkeypatch, blocks):
    """The interpreter runs the first autotune config only; force others (on GPU the tuner picks any)."""
    import triton

    bm, bk, bn = blocks
    for name in ("_tt_linear_fwd_kernel", "_tt_linear_bwd_dx_kernel", "_tt_linear_bwd_w_kernel"):
        kernel = getattr(tt_linear_kernel, name)
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_N": bn})])
        monkeypatch.setattr(kernel, "cache", {})
    x, L, R, b = tt_operands(130, 40, 70, 9, bias=True)
    y = tt_linear_kernel.tt_linear_fwd(x, L, R, b, n_split=3)  # (130, 70)
    torch.testing.assert_close(y, tt_linear_lr(x, L, R, b), rtol=1e-4, atol=1e-4)
    dy = torch.randn_like(y)
    leaves = [t.clone().requires_grad_(True) for t in (x, L, R, b)]
    tt_linear_lr(*leaves).backward(dy)
    grads = tt_linear_kernel.tt_linear_bwd(dy, x, L, R, need_db=True, t_split=3)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-4)
    for name in ("_tt_linear_fwd_kernel", "_tt_linear_bwd_dx_kernel", "_tt_linear_bwd_w_kernel"):
        assert getattr(tt_linear_kernel, name).best_config.kwargs == {"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_N": bn}


def test_only_requested_gradients_are_computed():
    x, L, R, _ = tt_operands(20, 18, 17, 5, bias=True)
    dy = torch.randn(20, 17).to(x)
    dx, dl, dr, db = tt_linear_kernel.tt_linear_bwd(dy, x, L, R, need_dx=False, need_dl=False, need_dr=True)
    assert dx is None and dl is None and db is None
    torch.testing.assert_close(dr, (x @ L).T @ dy, rtol=1e-4, atol=1e-4)
    # Through autograd: frozen factors get no gradient, the input still gets the right one.
    L.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    ops.tt_linear(xg, L, R, None).backward(dy)
    torch.testing.assert_close(xg.grad, dy @ R.T @ L.T, rtol=1e-4, atol=1e-4)


def test_leading_dims_and_strided_input():
    x, L, R, b = tt_operands(24, 20, 18, 6, bias=True)
    x3 = x.reshape(2, 12, 20)  # (B, S, N_in)
    torch.testing.assert_close(ops.tt_linear(x3, L, R, b), tt_linear_lr(x, L, R, b).reshape(2, 12, 18),
                               rtol=1e-4, atol=1e-4)
    xt = torch.randn(20, 24, device=DEVICE).T  # (24, 20), column-major view
    Lt = torch.randn(6, 20, device=DEVICE).T  # (20, 6), column-major view
    assert not xt.is_contiguous() and not Lt.is_contiguous()
    torch.testing.assert_close(tt_linear_kernel.tt_linear_fwd(xt, Lt, R, b), tt_linear_lr(xt, Lt, R, b),
                               rtol=1e-4, atol=1e-4)


def test_zero_tokens():
    x, L, R, b = tt_operands(0, 16, 16, 4, bias=True)
    assert tt_linear_kernel.tt_linear_fwd(x, L, R, b).shape == (0, 16)
    dx, dl, dr, db = tt_linear_kernel.tt_linear_bwd(torch.empty(0, 16).to(x), x, L, R, need_db=True)
    assert dx.shape == (0, 16) and not dl.any() and not dr.any() and not db.any()


@pytest.mark.parametrize("bad,match", [
    ({"L": torch.randn(15, 4)}, r"do not chain"),
    ({"R": torch.randn(3, 16)}, r"do not chain"),
    ({"x": torch.randn(2, 3, 16)}, r"must be 2-D"),
    ({"bias": torch.randn(15)}, r"bias must have shape \(16,\)"),
    ({"L": torch.randn(16, 4, dtype=torch.float64)}, r"L=torch.float64"),
])
def test_bad_input_raises_naming_it(bad, match):
    x, L, R, b = tt_operands(8, 16, 16, 4, bias=True)
    args = {"x": x, "L": L, "R": R, "bias": b} | {k: v.to(DEVICE) for k, v in bad.items()}
    with pytest.raises(ValueError, match=match):
        tt_linear_kernel.tt_linear_fwd(**args)


# Native (``gpu``) tests. Compiling, not running, is their cost: every new specialization (dtype,
# ints divisible by 16 or not) compiles each autotuning config it meets, and an fp32 config (tl.dot
# lowered to FMAs) takes seconds. So: ROUGH has every dim a multiple of 16 but of no block size (every
# tile config gets partial tiles in T, N_in and N_out) and shares the paper shape's specialization;
# ODD is off 16 everywhere and runs one config. bf16, the training dtype, runs every config at ROUGH,
# then the autotuner's own pick at the paper's 768x3072 layer (nothing left to compile); fp32 runs one.
PAPER, ROUGH, ODD = (4096, 768, 3072, 30), (4080, 784, 3056, 30), (333, 100, 50, 17)


@gpu_test(30)
@pytest.mark.parametrize("T,n_in,n_out,rank", [ROUGH, ODD])
def test_gpu_fp32_matches_reference(monkeypatch, T, n_in, n_out, rank):
    pin_config(monkeypatch, tt_linear_kernel, 0)
    args = tt_operands(T, n_in, n_out, rank, bias=True, device="cuda")
    compare_with_reference(ops.tt_linear, tt_linear_lr, args, rtol=2e-3, atol=2e-3)


def test_bf16_error_within_twice_the_torch_bf16_error():
    """The derived-tolerance check at an interpreter-sized shape (the interpreter upcasts bf16 dots)."""
    args = tt_operands(64, 48, 40, 8, bias=True)
    bf16_error_vs_torch(ops.tt_linear, tt_linear_lr, args)


@gpu_test(30)
@pytest.mark.parametrize("shape,config", bf16_cases(tt_linear_kernel, "rough", ROUGH, PAPER, ODD))
def test_gpu_bf16_error_within_twice_the_torch_bf16_error(monkeypatch, shape, config):
    """Native bf16 MMA with fp32 accumulation: no worse than 2x torch's own bf16 path vs fp64."""
    if config is not None:
        pin_config(monkeypatch, tt_linear_kernel, config)
    bf16_error_vs_torch(ops.tt_linear, tt_linear_lr, tt_operands(*shape, bias=True, device="cuda"))

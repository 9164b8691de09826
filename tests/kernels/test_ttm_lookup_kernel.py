"""The fused, deduplicated TTM lookup kernels against ``ttm_lookup_pairs``, forward and backward.

Duplicated ids matter twice: the forward computes each distinct row once and writes it to every
position, and the backward must sum the gradients of all those positions before the segment
reductions into A (grouped by i1 = id // M2) and B (grouped by i2 = id % M2).
"""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import (
    DEVICE,
    bf16_cases,
    bf16_error_vs_torch,
    compare_with_reference,
    gpu_test,
    needs_kernels,
    pin_config,
    ttm_operands,
)

from comera_dist.kernels import ops, ttm_lookup_kernel
from comera_dist.tensor.contract import ttm_lookup_pairs

pytestmark = needs_kernels


def _ids(T: int, n_rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n_rows, (T,), generator=g)  # (T,)
    ids[: T // 3] = ids[0]  # a third of the tokens share one id
    return ids.to(DEVICE)


# (M1, N1, r, M2, N2, T): r, N1, N2 not powers of two and below 16 (padded), r = 30 and 32,
# more tokens than rows (every id repeats), ids touching the first and last rows.
SHAPES = [
    (5, 3, 4, 7, 5, 23),
    (4, 16, 32, 4, 16, 10),
    (6, 4, 30, 5, 6, 40),
    (3, 17, 7, 2, 9, 25),
]


@pytest.mark.parametrize("M1,N1,rank,M2,N2,T", SHAPES)
def test_matches_reference_fp32(M1, N1, rank, M2, N2, T):
    A, B = ttm_operands(M1, N1, rank, M2, N2)
    ids = _ids(T, M1 * M2, seed=T)
    ids[-1], ids[-2] = 0, M1 * M2 - 1
    compare_with_reference(ops.ttm_lookup, ttm_lookup_pairs, [ids, A, B], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("run", [1, 2, 5])
def test_frequent_ids_split_into_chunks_match_reference(run):
    """An id's positions are cut into chunks of <= run tokens; products and dRows are still exact."""
    A, B = ttm_operands(5, 3, 4, 7, 5)
    ids = _ids(23, 35, seed=7)  # one id holds 7 positions, others repeat too
    ref_leaves = [A.clone().requires_grad_(True), B.clone().requires_grad_(True)]
    ref = ttm_lookup_pairs(ids, *ref_leaves)
    torch.testing.assert_close(ttm_lookup_kernel.ttm_lookup_fwd(ids, A, B, run=run), ref, rtol=1e-4, atol=1e-4)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dA, dB = ttm_lookup_kernel.ttm_lookup_bwd(dout, ids, A, B, run=run)
    torch.testing.assert_close(dA, ref_leaves[0].grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dB, ref_leaves[1].grad, rtol=1e-4, atol=1e-4)


def test_chunks_cover_every_position_once():
    s = ttm_lookup_kernel._Sorted(torch.tensor([4, 1, 4, 4, 0, 4, 4, 1]), 10, run=2)
    assert s.uniq.tolist() == [0, 1, 4]
    assert s.chunk_id.tolist() == [0, 1, 2, 2, 2] and s.chunk_off.tolist() == [0, 1, 2, 5]
    covered = torch.cat([s.order[a:b] for a, b in zip(s.chunk_start.tolist(), s.chunk_end.tolist())])
    assert sorted(covered.tolist()) == list(range(8))
    assert max(b - a for a, b in zip(s.chunk_start.tolist(), s.chunk_end.tolist())) <= 2


def test_bf16_factors_match_fp32_reference():
    A, B = ttm_operands(5, 3, 4, 7, 5, dtype=torch.bfloat16)
    ids = _ids(23, 35, seed=8)
    assert ttm_lookup_kernel.ttm_lookup_fwd(ids, A, B).dtype == torch.bfloat16
    compare_with_reference(ops.ttm_lookup, lambda i, a, b: ttm_lookup_pairs(i, a.float(), b.float()).to(torch.bfloat16),
                           [ids, A, B], rtol=3e-2, atol=3e-2)


def test_all_tokens_one_id_and_all_ids_distinct():
    A, B = ttm_operands(4, 5, 6, 3, 7)
    for ids in (torch.full((9,), 7, device=DEVICE), torch.randperm(12).to(DEVICE)):
        compare_with_reference(ops.ttm_lookup, ttm_lookup_pairs, [ids, A, B], rtol=1e-4, atol=1e-4)


def test_rows_no_token_reads_get_zero_gradient():
    A, B = ttm_operands(4, 5, 6, 3, 7)
    ids = torch.tensor([0, 4, 4], device=DEVICE)  # rows (0, 0) and (1, 1): A[2:], B[:, 2] are never read
    dA, dB = ttm_lookup_kernel.ttm_lookup_bwd(torch.randn(3, 35).to(A), ids, A, B)
    assert not dA[2:].any() and not dB[:, 2].any()
    assert dA[:2].abs().min() > 0


def test_batched_ids_and_int32():
    A, B = ttm_operands(5, 3, 4, 7, 5)
    ids = _ids(24, 35, seed=3).reshape(4, 6)  # (batch, seq)
    torch.testing.assert_close(ops.ttm_lookup(ids, A, B), ttm_lookup_pairs(ids, A, B))
    assert ops.ttm_lookup(ids, A, B).shape == (4, 6, 15)
    torch.testing.assert_close(ttm_lookup_kernel.ttm_lookup_fwd(ids.reshape(-1).int(), A, B),
                               ttm_lookup_pairs(ids.reshape(-1), A, B))


def test_strided_factors():
    A, B = ttm_operands(5, 3, 4, 7, 5)
    At = A.permute(2, 1, 0).contiguous().permute(2, 1, 0)  # same values, other strides
    Bt = B.transpose(0, 2).contiguous().transpose(0, 2)
    ids = _ids(15, 35, seed=4)
    compare_with_reference(ops.ttm_lookup, ttm_lookup_pairs, [ids, At, Bt], rtol=1e-4, atol=1e-4)


def test_empty_ids():
    A, B = ttm_operands(5, 3, 4, 7, 5)
    ids = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert ttm_lookup_kernel.ttm_lookup_fwd(ids, A, B).shape == (0, 15)
    dA, dB = ttm_lookup_kernel.ttm_lookup_bwd(torch.empty(0, 15).to(A), ids, A, B)
    assert not dA.any() and not dB.any()


@pytest.mark.parametrize("ids,A_shape,B_shape,match", [
    (torch.tensor([0, 35]), (5, 3, 4), (4, 7, 5), r"ids must lie in \[0, 35\).*\[0, 35\]"),
    (torch.tensor([-1, 2]), (5, 3, 4), (4, 7, 5), r"ids must lie in \[0, 35\)"),
    (torch.tensor([0.0]), (5, 3, 4), (4, 7, 5), r"ids must be a 1-D int64/int32 tensor, got torch.float32"),
    (torch.tensor([0]), (5, 3, 4), (3, 7, 5), r"A \(M1, N1, r\) and B \(r, M2, N2\), got A\(5, 3, 4\) B\(3, 7, 5\)"),
])
def test_bad_input_raises_naming_it(ids, A_shape, B_shape, match):
    with pytest.raises(ValueError, match=match):
        ttm_lookup_kernel.ttm_lookup_fwd(ids.to(DEVICE), torch.randn(A_shape, device=DEVICE),
                                         torch.randn(B_shape, device=DEVICE))


# Native (``gpu``) tests (see test_tt_linear_kernel.py for why they pin configs): the paper's
# 30522x768 embedding (N1*N2 = 16*48, so N2 fills 48 of a 64-wide tile) and an odd one off 16 everywhere.
PAPER, ODD = (320, 16, 32, 100, 48, 8192), (7, 5, 30, 11, 3, 500)


@gpu_test(30)
@pytest.mark.parametrize("M1,N1,rank,M2,N2,T", [PAPER, ODD])
def test_gpu_fp32_matches_reference(monkeypatch, M1, N1, rank, M2, N2, T):
    pin_config(monkeypatch, ttm_lookup_kernel, 0)
    A, B = ttm_operands(M1, N1, rank, M2, N2, device="cuda")
    ids = _ids(T, M1 * M2, seed=5).cuda()
    compare_with_reference(ops.ttm_lookup, ttm_lookup_pairs, [ids, A, B], rtol=2e-3, atol=2e-3)


def test_bf16_error_within_twice_the_torch_bf16_error():
    """The derived-tolerance check at an interpreter-sized shape (the interpreter upcasts bf16 dots)."""
    A, B = ttm_operands(5, 3, 4, 7, 5)
    bf16_error_vs_torch(ops.ttm_lookup, ttm_lookup_pairs, [_ids(23, 35, seed=9), A, B])


@gpu_test(30)
@pytest.mark.parametrize("shape,config", bf16_cases(ttm_lookup_kernel, "paper", PAPER, PAPER, ODD))
def test_gpu_bf16_error_within_twice_the_torch_bf16_error(monkeypatch, shape, config):
    """Native bf16 with fp32 accumulation: no worse than 2x torch's own bf16 path vs fp64."""
    if config is not None:
        pin_config(monkeypatch, ttm_lookup_kernel, config)
    M1, N1, rank, M2, N2, T = shape
    A, B = ttm_operands(M1, N1, rank, M2, N2, device="cuda")
    bf16_error_vs_torch(ops.ttm_lookup, ttm_lookup_pairs, [_ids(T, M1 * M2, seed=5).cuda(), A, B])

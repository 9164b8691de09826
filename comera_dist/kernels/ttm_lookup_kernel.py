"""Fused Triton kernels for the table-free TTM embedding lookup from two pair-contracted halves.

Reference: ``comera_dist.tensor.contract.ttm_lookup_pairs``. For a row id ``i`` with
``(i1, i2) = (i // M2, i % M2)``:

    forward   out[t] = A[i1] @ B[:, i2]                (N1 x r) @ (r x N2), flattened to N1*N2
    backward  dRows[u] = sum over tokens t of id u of dOut[t]
              dA[i1]    = sum over ids u with that i1 of dRows[u] @ B[:, i2]^T
              dB[:, i2] = sum over ids u with that i2 of A[i1]^T @ dRows[u]

Deduplication: ids are sorted once and each distinct id's run of token positions is cut into
chunks of at most ``run`` tokens (so one frequent id, e.g. padding, cannot serialize the launch).
A chunk is one program: it computes the id's slice product once and writes it to its positions;
an id costs ``ceil(count / run)`` products instead of ``count``. The backward is a sorted segment
reduction (no atomics, deterministic): chunks sum their dOut rows, the distinct ids are already
grouped by ``i1`` (they are sorted) and a stable sort by ``i2`` groups them for ``dB``; each group
is one program that accumulates on chip and writes its slice of dA or dB once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from comera_dist.kernels.launch import INTERPRET, check_same_device, dot_precision, downcast, warp_configs

# The tiles are fixed by (N1, r, N2); only the warp count is worth tuning for these small products.
_CONFIGS = warp_configs((4, 2, 1, 8))
RUN = 32  # most token positions one program handles (bounds the work of very frequent ids)


@triton.autotune(configs=_CONFIGS, key=["N1", "N2", "RANK"])
@triton.jit
def _ttm_lookup_fwd_kernel(
    uniq_ptr, chunk_id_ptr, chunk_start_ptr, chunk_end_ptr, order_ptr, a_ptr, b_ptr, out_ptr,
    M2, N1, N2, RANK,
    stride_a0, stride_a1, stride_a2, stride_b0, stride_b1, stride_b2, stride_om,
    N1_PAD: tl.constexpr, N2_PAD: tl.constexpr, R_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per chunk: the product for its id once, stored to the chunk's token positions."""
    c = tl.program_id(0)
    row = tl.load(uniq_ptr + tl.load(chunk_id_ptr + c))
    i1 = row // M2
    i2 = row % M2
    offs_n1 = tl.arange(0, N1_PAD)
    offs_n2 = tl.arange(0, N2_PAD)
    offs_r = tl.arange(0, R_PAD)
    mask_n1 = offs_n1 < N1
    mask_n2 = offs_n2 < N2
    mask_r = offs_r < RANK
    a = tl.load(a_ptr + i1 * stride_a0 + offs_n1[:, None] * stride_a1 + offs_r[None, :] * stride_a2,
                mask=mask_n1[:, None] & mask_r[None, :], other=0.0)  # (N1P, RP) = A[i1]
    b = tl.load(b_ptr + offs_r[:, None] * stride_b0 + i2 * stride_b1 + offs_n2[None, :] * stride_b2,
                mask=mask_r[:, None] & mask_n2[None, :], other=0.0)  # (RP, N2P) = B[:, i2]
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    rows = downcast(tl.dot(a, b, input_precision=PRECISION), out_ptr.dtype.element_ty, DOT_FP32)  # (N1P, N2P)
    cols = offs_n1[:, None] * N2 + offs_n2[None, :]  # (N1P, N2P) flat column n1*N2 + n2
    mask = mask_n1[:, None] & mask_n2[None, :]
    for j in range(tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)):  # <= run positions
        t = tl.load(order_ptr + j)
        tl.store(out_ptr + t * stride_om + cols, rows, mask=mask)


@triton.autotune(configs=_CONFIGS, key=["N1", "N2"])  # no rank: this kernel only sums dOut rows
@triton.jit
def _ttm_lookup_bwd_chunk_kernel(
    chunk_start_ptr, chunk_end_ptr, order_ptr, dout_ptr, part_ptr,
    N1, N2, stride_dom,
    N1_PAD: tl.constexpr, N2_PAD: tl.constexpr, R_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per chunk: the fp32 sum of its tokens' dOut rows (a partial of dRows[id])."""
    c = tl.program_id(0)
    offs_n1 = tl.arange(0, N1_PAD)
    offs_n2 = tl.arange(0, N2_PAD)
    mask = (offs_n1 < N1)[:, None] & (offs_n2 < N2)[None, :]
    cols = offs_n1[:, None] * N2 + offs_n2[None, :]  # (N1P, N2P)
    acc = tl.zeros((N1_PAD, N2_PAD), dtype=tl.float32)  # (N1P, N2P)
    for j in range(tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)):
        t = tl.load(order_ptr + j)
        acc += tl.load(dout_ptr + t * stride_dom + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + c * N1 * N2 + cols, acc, mask=mask)


@triton.autotune(configs=_CONFIGS, key=["N1", "N2", "RANK"])
@triton.jit
def _ttm_lookup_bwd_a_kernel(
    group_ptr, group_off_ptr, uniq_ptr, chunk_off_ptr, part_ptr, b_ptr, drows_ptr, da_ptr,
    M2, N1, N2, RANK,
    stride_b0, stride_b1, stride_b2, stride_da0, stride_da1, stride_da2,
    N1_PAD: tl.constexpr, N2_PAD: tl.constexpr, R_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per distinct i1: dRows for its ids (stored, fp32) and dA[i1] (written once)."""
    p = tl.program_id(0)
    i1 = tl.load(group_ptr + p)
    offs_n1 = tl.arange(0, N1_PAD)
    offs_n2 = tl.arange(0, N2_PAD)
    offs_r = tl.arange(0, R_PAD)
    mask_n1 = offs_n1 < N1
    mask_n2 = offs_n2 < N2
    mask_r = offs_r < RANK
    mask = mask_n1[:, None] & mask_n2[None, :]
    cols = offs_n1[:, None] * N2 + offs_n2[None, :]  # (N1P, N2P)
    acc = tl.zeros((N1_PAD, R_PAD), dtype=tl.float32)  # (N1P, RP) = dA[i1]
    for u in range(tl.load(group_off_ptr + p), tl.load(group_off_ptr + p + 1)):
        i2 = tl.load(uniq_ptr + u) % M2
        drow = tl.zeros((N1_PAD, N2_PAD), dtype=tl.float32)  # (N1P, N2P) = sum of this id's dOut rows
        for c in range(tl.load(chunk_off_ptr + u), tl.load(chunk_off_ptr + u + 1)):  # its chunk partials
            drow += tl.load(part_ptr + c * N1 * N2 + cols, mask=mask, other=0.0)
        tl.store(drows_ptr + u * N1 * N2 + cols, drow, mask=mask)
        b_t = tl.load(b_ptr + offs_n2[:, None] * stride_b2 + i2 * stride_b1 + offs_r[None, :] * stride_b0,
                      mask=mask_n2[:, None] & mask_r[None, :], other=0.0)  # (N2P, RP) = B[:, i2]^T
        if DOT_FP32:
            acc = tl.dot(drow, b_t.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(drow.to(b_t.dtype), b_t, acc, input_precision=PRECISION)
    tl.store(da_ptr + i1 * stride_da0 + offs_n1[:, None] * stride_da1 + offs_r[None, :] * stride_da2,
             downcast(acc, da_ptr.dtype.element_ty, DOT_FP32), mask=mask_n1[:, None] & mask_r[None, :])


@triton.autotune(configs=_CONFIGS, key=["N1", "N2", "RANK"])
@triton.jit
def _ttm_lookup_bwd_b_kernel(
    group_ptr, group_off_ptr, by_i2_ptr, uniq_ptr, a_ptr, drows_ptr, db_ptr,
    M2, N1, N2, RANK,
    stride_a0, stride_a1, stride_a2, stride_db0, stride_db1, stride_db2,
    N1_PAD: tl.constexpr, N2_PAD: tl.constexpr, R_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per distinct i2: dB[:, i2] = sum of A[i1]^T dRows[u] over its ids (written once)."""
    p = tl.program_id(0)
    i2 = tl.load(group_ptr + p)
    offs_n1 = tl.arange(0, N1_PAD)
    offs_n2 = tl.arange(0, N2_PAD)
    offs_r = tl.arange(0, R_PAD)
    mask_n1 = offs_n1 < N1
    mask_n2 = offs_n2 < N2
    mask_r = offs_r < RANK
    cols = offs_n1[:, None] * N2 + offs_n2[None, :]  # (N1P, N2P)
    acc = tl.zeros((R_PAD, N2_PAD), dtype=tl.float32)  # (RP, N2P) = dB[:, i2]
    for q in range(tl.load(group_off_ptr + p), tl.load(group_off_ptr + p + 1)):
        u = tl.load(by_i2_ptr + q)
        i1 = tl.load(uniq_ptr + u) // M2
        a_t = tl.load(a_ptr + i1 * stride_a0 + offs_r[:, None] * stride_a2 + offs_n1[None, :] * stride_a1,
                      mask=mask_r[:, None] & mask_n1[None, :], other=0.0)  # (RP, N1P) = A[i1]^T
        drow = tl.load(drows_ptr + u * N1 * N2 + cols, mask=mask_n1[:, None] & mask_n2[None, :],
                       other=0.0)  # (N1P, N2P) fp32
        if DOT_FP32:
            acc = tl.dot(a_t.to(tl.float32), drow, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a_t, drow.to(a_t.dtype), acc, input_precision=PRECISION)
    tl.store(db_ptr + offs_r[:, None] * stride_db0 + i2 * stride_db1 + offs_n2[None, :] * stride_db2,
             downcast(acc, db_ptr.dtype.element_ty, DOT_FP32), mask=mask_r[:, None] & mask_n2[None, :])


def _check(ids: Tensor, A: Tensor, B: Tensor) -> None:
    if A.dim() != 3 or B.dim() != 3 or A.shape[2] != B.shape[0]:
        raise ValueError(f"ttm_lookup: need A (M1, N1, r) and B (r, M2, N2), got A{tuple(A.shape)} "
                         f"B{tuple(B.shape)}")
    if A.dtype != B.dtype or A.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"ttm_lookup: A and B need one dtype among float32/float16/bfloat16, got "
                         f"A={A.dtype} B={B.dtype}")
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise ValueError(f"ttm_lookup: ids must be a 1-D int64/int32 tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    check_same_device("ttm_lookup", ids=ids, A=A, B=B)


class _Sorted:
    """The token ids sorted once: distinct ids, and each id's token positions cut into chunks.

    ``order`` (T,) lists token positions grouped by id; chunk ``c`` covers
    ``order[chunk_start[c]:chunk_end[c]]`` (at most ``run`` positions, all holding id
    ``uniq[chunk_id[c]]``); id ``u`` owns chunks ``chunk_off[u]:chunk_off[u+1]``.
    """

    __slots__ = ("chunk_end", "chunk_id", "chunk_off", "chunk_start", "order", "uniq")

    def __init__(self, ids: Tensor, n_rows: int, run: int):
        sorted_ids, order = torch.sort(ids, stable=True)  # (T,), (T,)
        if sorted_ids.numel() and (int(sorted_ids[0]) < 0 or int(sorted_ids[-1]) >= n_rows):
            raise ValueError(f"ttm_lookup: ids must lie in [0, {n_rows}) (M1*M2), got values in "
                             f"[{int(sorted_ids[0])}, {int(sorted_ids[-1])}]")
        self.uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)  # (U,), (U,)
        self.order = order  # (T,) token positions grouped by id
        offsets = _offsets(counts)  # (U+1,) each id's run in ``order``
        n_chunks = (counts + run - 1) // run  # (U,)
        self.chunk_off = _offsets(n_chunks)  # (U+1,)
        self.chunk_id = torch.repeat_interleave(torch.arange(counts.numel(), device=ids.device), n_chunks)  # (C,)
        k = torch.arange(self.chunk_id.numel(), device=ids.device) - self.chunk_off[self.chunk_id]  # (C,) index within the id
        self.chunk_start = offsets[self.chunk_id] + k * run  # (C,)
        self.chunk_end = torch.minimum(self.chunk_start + run, offsets[self.chunk_id + 1])  # (C,)


def _offsets(counts: Tensor) -> Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)  # (n+1,)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def _pads(A: Tensor, B: Tensor) -> dict[str, int]:
    n1, rank, n2 = A.shape[1], A.shape[2], B.shape[2]
    return {"N1_PAD": max(16, triton.next_power_of_2(n1)), "N2_PAD": max(16, triton.next_power_of_2(n2)),
            "R_PAD": max(16, triton.next_power_of_2(rank))}


def ttm_lookup_fwd(ids: Tensor, A: Tensor, B: Tensor, *, run: int = RUN) -> Tensor:
    """Rows of the TTM table for ``ids`` (T,) from A (M1, N1, r), B (r, M2, N2) -> (T, N1*N2).

    ``run``: most token positions one program writes (tests force small values).
    """
    _check(ids, A, B)
    M1, N1, rank = A.shape
    M2, N2 = B.shape[1], B.shape[2]
    out = torch.empty((ids.numel(), N1 * N2), dtype=A.dtype, device=A.device)  # (T, N1*N2)
    if ids.numel() == 0:
        return out
    s = _Sorted(ids.long(), M1 * M2, run)
    _ttm_lookup_fwd_kernel[(s.chunk_id.numel(),)](
        s.uniq, s.chunk_id, s.chunk_start, s.chunk_end, s.order, A, B, out,
        M2, N1, N2, rank,
        A.stride(0), A.stride(1), A.stride(2), B.stride(0), B.stride(1), B.stride(2), out.stride(0),
        **_pads(A, B), DOT_FP32=INTERPRET, PRECISION=dot_precision(A.dtype),
    )
    return out


def ttm_lookup_bwd(dout: Tensor, ids: Tensor, A: Tensor, B: Tensor, *, run: int = RUN) -> tuple[Tensor, Tensor]:
    """Gradients ``(dA (M1, N1, r), dB (r, M2, N2))`` of the lookup for ``dout`` (T, N1*N2)."""
    _check(ids, A, B)
    M1, N1, rank = A.shape
    M2, N2 = B.shape[1], B.shape[2]
    if tuple(dout.shape) != (ids.numel(), N1 * N2) or dout.dtype != A.dtype:
        raise ValueError(f"ttm_lookup backward: grad must be ({ids.numel()}, {N1 * N2}) {A.dtype}, got "
                         f"{tuple(dout.shape)} {dout.dtype}")
    dout = dout.contiguous()  # the kernels index its columns with unit stride
    dA = torch.zeros_like(A)  # (M1, N1, r); rows no token reads stay zero
    dB = torch.zeros_like(B)  # (r, M2, N2)
    if ids.numel() == 0:
        return dA, dB
    s = _Sorted(ids.long(), M1 * M2, run)
    common = {**_pads(A, B), "DOT_FP32": INTERPRET, "PRECISION": dot_precision(A.dtype)}
    parts = torch.empty((s.chunk_id.numel(), N1 * N2), dtype=torch.float32, device=A.device)  # (C, N1*N2)
    _ttm_lookup_bwd_chunk_kernel[(s.chunk_id.numel(),)](
        s.chunk_start, s.chunk_end, s.order, dout, parts, N1, N2, dout.stride(0), **common,
    )
    # Distinct ids are sorted, so ids sharing i1 = id // M2 are already contiguous.
    i1_groups, i1_counts = torch.unique_consecutive(s.uniq // M2, return_counts=True)  # (G1,), (G1,)
    drows = torch.empty((s.uniq.numel(), N1 * N2), dtype=torch.float32, device=A.device)  # (U, N1*N2)
    _ttm_lookup_bwd_a_kernel[(i1_groups.numel(),)](
        i1_groups, _offsets(i1_counts), s.uniq, s.chunk_off, parts, B, drows, dA,
        M2, N1, N2, rank,
        B.stride(0), B.stride(1), B.stride(2), dA.stride(0), dA.stride(1), dA.stride(2),
        **common,
    )
    i2_sorted, by_i2 = torch.sort(s.uniq % M2, stable=True)  # (U,), (U,) distinct ids grouped by i2
    i2_groups, i2_counts = torch.unique_consecutive(i2_sorted, return_counts=True)  # (G2,), (G2,)
    _ttm_lookup_bwd_b_kernel[(i2_groups.numel(),)](
        i2_groups, _offsets(i2_counts), by_i2, s.uniq, A, drows, dB,
        M2, N1, N2, rank,
        A.stride(0), A.stride(1), A.stride(2), dB.stride(0), dB.stride(1), dB.stride(2),
        **common,
    )
    return dA, dB

"""Fused Triton kernels for the bidirectional TT linear layer ``y = (x L) R + b``.

Reference: ``comera_dist.tensor.contract.tt_linear_lr``. With G = dY R^T and H = X L:

    forward   Y  = (X L) R + b          one kernel; the (BLOCK_M x r) tile H never leaves the chip
    backward  dX = G L^T                kernel 1, per row tile: G once (loop over N_out), then dX
              dL = X^T G                kernel 2, split over T: per N_in tile, fp32 partial sums
              dR = H^T dY, db = sum dY  kernel 2, per N_out tile (H recomputed by kernel 1)

The rank r is padded to ``R_PAD = max(16, next_pow2(r))`` with masked loads, so any r works and
every ``tl.dot`` is at least 16 wide. Accumulation is fp32. Under the Triton interpreter
(``TRITON_INTERPRET=1``) dot operands are upcast to fp32, because its bf16 ``tl.dot`` is broken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from comera_dist.kernels.launch import (
    INTERPRET,
    check_same_device,
    dot_precision,
    downcast,
    split_count,
    tune_configs,
)

# Autotuning candidates (BLOCK_M, BLOCK_K, BLOCK_N, warps, stages); the interpreter uses only the first.
_CONFIGS = tune_configs([(32, 32, 32, 4, 3), (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (128, 64, 64, 8, 3),
                         (128, 64, 128, 8, 3), (64, 128, 64, 4, 4), (32, 64, 64, 4, 3)])
_NOMINAL_BLOCK = 64  # block size the host-side split heuristics assume


@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32; operands upcast first when the interpreter runs the kernel."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.autotune(configs=_CONFIGS, key=["T_BUCKET", "N_IN", "N_OUT", "RANK", "HAS_BIAS"])
@triton.jit
def _tt_linear_fwd_kernel(
    x_ptr, l_ptr, r_ptr, b_ptr, y_ptr,
    T, T_BUCKET, N_IN, N_OUT, RANK,
    stride_xm, stride_xk, stride_lk, stride_lr, stride_rr, stride_rn, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_r = tl.arange(0, R_PAD)  # (RP,)
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    mask_m = offs_m < T
    mask_r = offs_r < RANK

    h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)  # (BM, RP) = X_tile L, stays on chip
    for k0 in range(0, N_IN, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=mask_m[:, None] & (k[None, :] < N_IN), other=0.0)  # (BM, BK)
        lk = tl.load(l_ptr + k[:, None] * stride_lk + offs_r[None, :] * stride_lr,
                     mask=(k[:, None] < N_IN) & mask_r[None, :], other=0.0)  # (BK, RP)
        h = _mma(x, lk, h, DOT_FP32, PRECISION)
    # Round H to the operand dtype like the unfused path does (a no-op in fp32).
    h_op = downcast(h, r_ptr.dtype.element_ty, DOT_FP32)  # (BM, RP)

    # The programs of one row tile share its output tiles: each writes `per_prog` of them from its H.
    per_prog = tl.cdiv(tl.cdiv(N_OUT, BLOCK_N), tl.num_programs(1))
    n_first = pid_n * per_prog * BLOCK_N
    for j in range(per_prog):
        n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        mask_n = n < N_OUT
        rn = tl.load(r_ptr + offs_r[:, None] * stride_rr + n[None, :] * stride_rn,
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # (RP, BN)
        y = _mma(h_op, rn, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_FP32, PRECISION)  # (BM, BN)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + n[None, :] * stride_yn,
                 downcast(y, y_ptr.dtype.element_ty, DOT_FP32), mask=mask_m[:, None] & mask_n[None, :])


@triton.autotune(configs=_CONFIGS, key=["T_BUCKET", "N_IN", "N_OUT", "RANK", "NEED_DX", "NEED_H"])
@triton.jit
def _tt_linear_bwd_dx_kernel(
    dy_ptr, x_ptr, l_ptr, r_ptr, dx_ptr, g_ptr, h_ptr,
    T, T_BUCKET, N_IN, N_OUT, RANK,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_lk, stride_lr, stride_rr, stride_rn,
    stride_dxm, stride_dxk,
    NEED_DX: tl.constexpr, NEED_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per row tile: G = dY R^T once, then dX = G L^T and H = X L in one pass over N_in."""
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_r = tl.arange(0, R_PAD)  # (RP,)
    mask_m = offs_m < T
    mask_r = offs_r < RANK

    g = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)  # (BM, RP) = dY_tile R^T
    for n0 in range(0, N_OUT, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + n[None, :] * stride_dyn,
                     mask=mask_m[:, None] & (n[None, :] < N_OUT), other=0.0)  # (BM, BN)
        r_t = tl.load(r_ptr + n[:, None] * stride_rn + offs_r[None, :] * stride_rr,
                      mask=(n[:, None] < N_OUT) & mask_r[None, :], other=0.0)  # (BN, RP) = R^T tile
        g = _mma(dy, r_t, g, DOT_FP32, PRECISION)
    g_op = downcast(g, l_ptr.dtype.element_ty, DOT_FP32)  # (BM, RP)

    h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)  # (BM, RP) = X_tile L (for dR)
    for k0 in range(0, N_IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < N_IN
        lk = tl.load(l_ptr + k[:, None] * stride_lk + offs_r[None, :] * stride_lr,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # (BK, RP)
        if NEED_DX:
            dx = _mma(g_op, tl.trans(lk), tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32),
                      DOT_FP32, PRECISION)  # (BM, BK)
            tl.store(dx_ptr + offs_m[:, None] * stride_dxm + k[None, :] * stride_dxk,
                     downcast(dx, dx_ptr.dtype.element_ty, DOT_FP32), mask=mask_m[:, None] & mask_k[None, :])
        if NEED_H:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
            h = _mma(x, lk, h, DOT_FP32, PRECISION)

    # G and H are (T, R_PAD), contiguous, in the operand dtype; padded columns are exact zeros.
    gh_offs = offs_m[:, None] * R_PAD + offs_r[None, :]
    tl.store(g_ptr + gh_offs, g_op, mask=mask_m[:, None])
    if NEED_H:
        tl.store(h_ptr + gh_offs, downcast(h, h_ptr.dtype.element_ty, DOT_FP32), mask=mask_m[:, None])


@triton.autotune(configs=_CONFIGS, key=["T_BUCKET", "N_IN", "N_OUT", "NEED_DL", "NEED_DR", "NEED_DB"])
@triton.jit
def _tt_linear_bwd_w_kernel(
    x_ptr, g_ptr, h_ptr, dy_ptr, dl_ptr, dr_ptr, db_ptr,
    T, T_BUCKET, N_IN, N_OUT,
    stride_xm, stride_xk, stride_dym, stride_dyn,
    NEED_DL: tl.constexpr, NEED_DR: tl.constexpr, NEED_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """Split-T reductions: programs [0, n_k_blocks) make dL partials, the rest dR/db partials.

    The two branches use distinct accumulator names: compiled Triton requires a name to keep
    one type across ``if``/``else`` (the interpreter does not check this).

    Partial sums are fp32, shaped (splits, N_in, R_PAD), (splits, R_PAD, N_out), (splits, N_out);
    the wrapper sums over the split axis (deterministic, no atomics). Every split writes its
    slice, an empty one (past T) zeros.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_r = tl.arange(0, R_PAD)  # (RP,)
    rows_per_split = tl.cdiv(tl.cdiv(T, BLOCK_M), tl.num_programs(1)) * BLOCK_M
    t_begin = split * rows_per_split
    t_end = tl.minimum(t_begin + rows_per_split, T)
    n_k_blocks = tl.cdiv(N_IN, BLOCK_K) * NEED_DL  # NEED_DL is 0 or 1
    if pid < n_k_blocks:
        k = pid * BLOCK_K + tl.arange(0, BLOCK_K)  # (BK,)
        mask_k = k < N_IN
        acc_l = tl.zeros((BLOCK_K, R_PAD), dtype=tl.float32)  # (BK, RP) = sum_t X[t, k]^T G[t]
        for t0 in range(t_begin, t_end, BLOCK_M):
            t = t0 + tl.arange(0, BLOCK_M)
            mask_t = t < t_end
            x_t = tl.load(x_ptr + k[:, None] * stride_xk + t[None, :] * stride_xm,
                          mask=mask_k[:, None] & mask_t[None, :], other=0.0)  # (BK, BM) = X^T tile
            g = tl.load(g_ptr + t[:, None] * R_PAD + offs_r[None, :], mask=mask_t[:, None], other=0.0)  # (BM, RP)
            acc_l = _mma(x_t, g, acc_l, DOT_FP32, PRECISION)
        tl.store(dl_ptr + split * N_IN * R_PAD + k[:, None] * R_PAD + offs_r[None, :], acc_l,
                 mask=mask_k[:, None])
    else:
        n = (pid - n_k_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        mask_n = n < N_OUT
        acc_r = tl.zeros((R_PAD, BLOCK_N), dtype=tl.float32)  # (RP, BN) = sum_t H[t]^T dY[t, n]
        acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)  # (BN,) = sum_t dY[t, n]
        for t0 in range(t_begin, t_end, BLOCK_M):
            t = t0 + tl.arange(0, BLOCK_M)
            mask_t = t < t_end
            dy = tl.load(dy_ptr + t[:, None] * stride_dym + n[None, :] * stride_dyn,
                         mask=mask_t[:, None] & mask_n[None, :], other=0.0)  # (BM, BN)
            if NEED_DR:
                h_t = tl.load(h_ptr + t[None, :] * R_PAD + offs_r[:, None], mask=mask_t[None, :],
                              other=0.0)  # (RP, BM) = H^T tile
                acc_r = _mma(h_t, dy, acc_r, DOT_FP32, PRECISION)
            if NEED_DB:
                acc_b += tl.sum(dy.to(tl.float32), axis=0)
        if NEED_DR:
            tl.store(dr_ptr + split * R_PAD * N_OUT + offs_r[:, None] * N_OUT + n[None, :], acc_r,
                     mask=mask_n[None, :])
        if NEED_DB:
            tl.store(db_ptr + split * N_OUT + n, acc_b, mask=mask_n)


def _check(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None) -> None:
    if x.dim() != 2 or L.dim() != 2 or R.dim() != 2:
        raise ValueError(f"tt_linear: x, L, R must be 2-D, got x{tuple(x.shape)} L{tuple(L.shape)} "
                         f"R{tuple(R.shape)}")
    if x.shape[1] != L.shape[0] or L.shape[1] != R.shape[0]:
        raise ValueError(f"tt_linear: shapes do not chain: x{tuple(x.shape)} @ L{tuple(L.shape)} "
                         f"@ R{tuple(R.shape)}")
    if bias is not None and tuple(bias.shape) != (R.shape[1],):
        raise ValueError(f"tt_linear: bias must have shape ({R.shape[1]},), got {tuple(bias.shape)}")
    dtypes = {t.dtype for t in (x, L, R, bias) if t is not None}
    if len(dtypes) != 1 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"tt_linear: x, L, R, bias need one dtype among float32/float16/bfloat16, got "
                         f"x={x.dtype} L={L.dtype} R={R.dtype} bias={None if bias is None else bias.dtype}")
    check_same_device("tt_linear", x=x, L=L, R=R, bias=bias)


def _bucket(tokens: int) -> int:
    """The autotuning key's token count: the next power of two (``T_BUCKET``, unused by the kernels).

    Keying on the exact T re-tunes for every new batch shape (a short last evaluation batch, a
    different micro-batch); one tuning per power-of-two bucket is enough for these tiles.
    """
    return triton.next_power_of_2(max(1, tokens))


def _r_pad(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def tt_linear_fwd(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None, *,
                  n_split: int | None = None) -> Tensor:
    """``(x L) R + bias`` with one fused kernel; x (T, N_in), L (N_in, r), R (r, N_out) -> (T, N_out).

    ``n_split``: how many programs share one row tile's output columns (each recomputes its
    H tile); ``None`` picks enough to fill the GPU, 1 under the interpreter.
    """
    _check(x, L, R, bias)
    T, n_in = x.shape
    rank, n_out = R.shape
    y = torch.empty((T, n_out), dtype=x.dtype, device=x.device)  # (T, N_out)
    if T == 0 or n_out == 0:
        return y
    nominal_n = triton.cdiv(n_out, _NOMINAL_BLOCK)
    want = split_count(triton.cdiv(T, _NOMINAL_BLOCK), nominal_n, x.device) if n_split is None else n_split

    def grid(meta):
        n_blocks = triton.cdiv(n_out, meta["BLOCK_N"])
        per_prog = triton.cdiv(n_blocks, max(1, min(want, n_blocks)))
        return triton.cdiv(T, meta["BLOCK_M"]), triton.cdiv(n_blocks, per_prog)  # no idle programs

    _tt_linear_fwd_kernel[grid](
        x, L, R, bias if bias is not None else y, y,
        T, _bucket(T), n_in, n_out, rank,
        x.stride(0), x.stride(1), L.stride(0), L.stride(1), R.stride(0), R.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, R_PAD=_r_pad(rank), DOT_FP32=INTERPRET, PRECISION=dot_precision(x.dtype),
    )
    return y


def tt_linear_bwd(dy: Tensor, x: Tensor, L: Tensor, R: Tensor, *, need_dx: bool = True, need_dl: bool = True,
                  need_dr: bool = True, need_db: bool = False, t_split: int | None = None,
                  ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dX (T, N_in), dL (N_in, r), dR (r, N_out), db (N_out,))``; unneeded ones are None.

    ``t_split``: how many slices of T the weight reductions are split into (fp32 partials summed
    afterwards); ``None`` picks enough to fill the GPU, 1 under the interpreter.
    """
    _check(x, L, R, None)
    T, n_in = x.shape
    rank, n_out = R.shape
    if tuple(dy.shape) != (T, n_out) or dy.dtype != x.dtype:
        raise ValueError(f"tt_linear backward: grad must be ({T}, {n_out}) {x.dtype}, got "
                         f"{tuple(dy.shape)} {dy.dtype}")
    r_pad = _r_pad(rank)
    common = {"R_PAD": r_pad, "DOT_FP32": INTERPRET, "PRECISION": dot_precision(x.dtype)}
    dx = torch.empty_like(x) if need_dx else None  # (T, N_in)
    if T == 0:  # no tokens: every gradient is an exact zero
        return (dx, torch.zeros_like(L) if need_dl else None, torch.zeros_like(R) if need_dr else None,
                torch.zeros((n_out,), dtype=x.dtype, device=x.device) if need_db else None)
    g = torch.empty((T, r_pad), dtype=x.dtype, device=x.device)  # (T, RP) = dY R^T
    h = torch.empty((T, r_pad), dtype=x.dtype, device=x.device) if need_dr else g  # (T, RP) = X L
    if need_dx or need_dl or need_dr:
        _tt_linear_bwd_dx_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]),)](
            dy, x, L, R, dx if dx is not None else g, g, h,
            T, _bucket(T), n_in, n_out, rank,
            dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), L.stride(0), L.stride(1),
            R.stride(0), R.stride(1), dx.stride(0) if dx is not None else 0, dx.stride(1) if dx is not None else 0,
            NEED_DX=need_dx, NEED_H=need_dr, **common,
        )
    dl = dr = db = None
    need_cols = need_dr or need_db
    if need_dl or need_cols:
        tiles = triton.cdiv(n_in, _NOMINAL_BLOCK) * need_dl + triton.cdiv(n_out, _NOMINAL_BLOCK) * need_cols
        m_tiles = triton.cdiv(T, _NOMINAL_BLOCK)
        splits = split_count(tiles, m_tiles, x.device) if t_split is None else max(1, min(t_split, T))
        f32 = {"dtype": torch.float32, "device": x.device}
        dl_part = torch.empty((splits, n_in, r_pad), **f32) if need_dl else g  # (S, N_in, RP)
        dr_part = torch.empty((splits, r_pad, n_out), **f32) if need_dr else g  # (S, RP, N_out)
        db_part = torch.empty((splits, n_out), **f32) if need_db else g  # (S, N_out)

        def grid(meta):
            return (triton.cdiv(n_in, meta["BLOCK_K"]) * need_dl + triton.cdiv(n_out, meta["BLOCK_N"]) * need_cols,
                    splits)

        _tt_linear_bwd_w_kernel[grid](
            x, g, h, dy, dl_part, dr_part, db_part,
            T, _bucket(T), n_in, n_out,
            x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
            NEED_DL=int(need_dl), NEED_DR=need_dr, NEED_DB=need_db, **common,
        )
        if need_dl:
            dl = dl_part.sum(0)[:, :rank].to(L.dtype)  # (N_in, r)
        if need_dr:
            dr = dr_part.sum(0)[:rank].to(R.dtype)  # (r, N_out)
        if need_db:
            db = db_part.sum(0).to(x.dtype)  # (N_out,)
    return dx, dl, dr, db

"""The middle of a low-rank FFN, ``gelu(h R + b) L``, with its wide activation never kept, in row blocks.

In a TT FFN both projections run in the ``lr`` order: ``x L_in`` is narrow (T, r), ``R_in`` widens it
to the FFN width F, GELU, then ``L_out`` narrows it again before ``R_out``. Only the (T, F) tensors in
between are wide: the pre-activation ``u = h R_in + b_in`` and ``gelu(u)``. Run as plain ops, autograd
keeps ``u`` (12 KiB per token and block at the six-encoder's F = 3072 in fp32), and every wide
element-wise pass, forward and backward, streams (T, F) tensors through memory.

``u`` is a rank-r product, so it is cheap to remake: ``lowrank_gelu`` keeps ``h`` (T, r) and the
factors, and remakes ``u`` in its backward (one more GEMM of the size of the first). With ``rows``
set it does both passes ``rows`` tokens at a time, so each block's wide tensors are a few hundred KiB
that stay in the CPU's cache instead of (T, F) tensors in fresh pages; ``kernels.dispatch.ffn_rows``
picks it (the CPU), and one block of all T tokens elsewhere, where a block is a kernel launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from comera_dist.tensor.fused import autocast_dtype, cast


def lowrank_gelu(h: Tensor, R: Tensor, bias: Tensor | None, L: Tensor, rows: int | None = None) -> Tensor:
    """``gelu(h @ R + bias) @ L`` (exact, erf GELU), keeping ``h`` and the factors, not the (T, F) middle.

    h: (T, r_in); R: (r_in, F); bias: (F,) or None; L: (F, r_out) -> (T, r_out). ``rows``: tokens per
    block (None: all T in one). Under autocast it computes what the plain ops would: the two products
    (the bias in the first's epilogue) and GELU in autocast's dtype, gradients in the inputs' dtypes.
    """
    if h.dim() != 2 or R.dim() != 2 or L.dim() != 2 or h.shape[1] != R.shape[0] or R.shape[1] != L.shape[0]:
        raise ValueError(f"lowrank_gelu needs h (T, r_in), R (r_in, F) and L (F, r_out), got {tuple(h.shape)}, "
                         f"{tuple(R.shape)} and {tuple(L.shape)}")
    if bias is not None and tuple(bias.shape) != (R.shape[1],):
        raise ValueError(f"lowrank_gelu: bias must have shape ({R.shape[1]},), got {tuple(bias.shape)}")
    if rows is not None and rows < 1:
        raise ValueError(f"lowrank_gelu: rows must be >= 1 or None, got {rows}")
    return _LowRankGelu.apply(h, R, bias, L, rows or max(1, h.shape[0]))


def _blocks(total: int, rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + rows, total)) for s in range(0, max(total, 1), rows)]


class _LowRankGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, R: Tensor, bias: Tensor | None, L: Tensor, rows: int) -> Tensor:
        ctx.device_type = h.device.type if h.device.type in ("cpu", "cuda") else "cpu"
        dtype = autocast_dtype(h) or autocast_dtype(R)
        ctx.dtypes = (h.dtype, R.dtype, None if bias is None else bias.dtype, L.dtype)
        ctx.rows = rows
        with torch.autocast(ctx.device_type, enabled=False):
            hc, Rc, bc, Lc = cast(h, dtype), cast(R, dtype), cast(bias, dtype), cast(L, dtype)
            outs = []
            for s, e in _blocks(hc.shape[0], rows):
                u = hc[s:e] @ Rc if bc is None else torch.addmm(bc, hc[s:e], Rc)  # (rows, F), a temporary
                outs.append(F.gelu(u) @ Lc)  # (rows, r_out)
            out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, r_out)
        ctx.save_for_backward(hc, Rc, bc, Lc)  # as cast (autocast keeps its cast copies the same way)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        hc, Rc, bc, Lc = ctx.saved_tensors
        need_h, need_R, need_b, need_L = ctx.needs_input_grad[:4]
        grad_h, grad_R, grad_b, grad_L = [], None, None, None
        blocks = _blocks(hc.shape[0], ctx.rows)
        sums = len(blocks) > 1  # the gradients of R, bias and L are sums over the blocks
        with torch.autocast(ctx.device_type, enabled=False):
            grad = grad.to(Lc.dtype)
            for s, e in blocks:
                hb, gb = hc[s:e], grad[s:e]  # (rows, r_in), (rows, r_out)
                u = hb @ Rc if bc is None else torch.addmm(bc, hb, Rc)  # (rows, F), remade
                if need_L:
                    part = F.gelu(u).T @ gb  # (F, r_out)
                    grad_L = _accumulate(grad_L, part, sums)
                grad_u = torch.ops.aten.gelu_backward(gb @ Lc.T, u)  # (rows, F)
                if need_R:
                    part = hb.T @ grad_u  # (r_in, F)
                    grad_R = _accumulate(grad_R, part, sums)
                if need_b and bc is not None:
                    part = grad_u.sum(0)  # (F,)
                    grad_b = _accumulate(grad_b, part, sums)
                if need_h:
                    grad_h.append(grad_u @ Rc.T)  # (rows, r_in)
        dh, dR, db, dL = ctx.dtypes
        return (_joined(grad_h, dh), _as(grad_R, dR), _as(grad_b, db), _as(grad_L, dL), None)


def _accumulate(total: Tensor | None, part: Tensor, sums: bool) -> Tensor:
    """``total + part``; where there are several blocks (``sums``) summed in at least fp32, so the blocks'
    bf16 partial products are not added in bf16."""
    if total is None:
        return part.to(torch.promote_types(part.dtype, torch.float32)) if sums else part
    return total.add_(part)


def _joined(parts: list[Tensor], dtype: torch.dtype) -> Tensor | None:
    if not parts:
        return None
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)


def _as(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    return None if t is None or dtype is None else t.to(dtype)

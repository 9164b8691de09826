"""Products that keep less for backward: an operand made by a cheap element-wise op is recomputed.

``gelu_matmul(u, w, bias)``: ``gelu(u) @ w + bias``, keeping ``u`` alone. A transformer FFN computes
``out(gelu(u))``; run as two ops, autograd keeps two ``(T, F)`` tensors per block: ``u`` (GELU's
backward needs it) and ``gelu(u)`` (the product's weight gradient needs it). The fused op recomputes
``gelu(u)`` in the backward, one element-wise op next to the products it feeds: 12 KiB per token
and block at the six-encoder's 3072-wide FFN in fp32. The FFN's out-projection takes it through
``gelu_input=True``: a dense one (``layers.dense.Linear``, ``w`` its weight transposed) or a TT one
(``TTLinear``, ``w`` its contracted input half ``L``, so only ``(T, r)`` leaves the fused op).

``shared_input_lr(x, Ls, Rs, biases)``: ``x L_i R_i + b_i`` for layers reading one ``x`` (attention's Q, K,
V), the input side as one GEMM against ``[L_1 | ... | L_n]`` and, when the layers have one shape, the output
side as one batched GEMM against the stacked ``R_i``. Run as plain ops, autograd keeps that concatenation
and that stack, copies of factors it keeps anyway (each ``L_i``/``R_i`` is a view of its group's
contraction, ``layers.group``, which the block's out-projection keeps); the fused op keeps the factors and
remakes the two copies in its backward.

``scaled_bmm(a, c, m, core_left)``: one step of a batched core chain against a gate-scaled TT core
``c * m``, keeping ``c`` and ``m`` but not their product. ``c`` is a view of a group's stacked cores
(``layers.ragged``), which autograd keeps for the gate gradient anyway, so the scaled copy (as large
as the cores) no longer doubles it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gelu_matmul(u: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``gelu(u) @ w (+ bias)`` (exact, erf GELU); u: (T, F), w: (F, N), bias: (N,) -> (T, N).

    Under autocast it computes what the unfused ops would: GELU in ``u``'s dtype, then the product
    (bias in its epilogue, as ``F.linear``'s) in autocast's dtype, with autocast's rule for which
    operands to cast (floating, not float64).
    """
    if u.dim() != 2 or w.dim() != 2 or u.shape[1] != w.shape[0]:
        raise ValueError(f"gelu_matmul needs u (T, F) and w (F, N), got {tuple(u.shape)} and {tuple(w.shape)}")
    if bias is not None and tuple(bias.shape) != (w.shape[1],):
        raise ValueError(f"gelu_matmul: bias must have shape ({w.shape[1]},), got {tuple(bias.shape)}")
    return _GeluMatmul.apply(u, w, bias)


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast would cast ``t`` to for a matmul, or None (autocast off, or ``t`` not eligible)."""
    device_type = t.device.type if t.device.type in ("cpu", "cuda") else "cpu"
    if not torch.is_autocast_enabled(device_type) or not t.is_floating_point() or t.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device_type)


def cast(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """``t`` in ``dtype`` as autocast would cast an operand (None and float64 left alone; no dtype: ``t``)."""
    return t if t is None or dtype is None or t.dtype == torch.float64 else t.to(dtype)


class _GeluMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        ctx.w_dtype = w.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.device_type = u.device.type if u.device.type in ("cpu", "cuda") else "cpu"
        dtype = autocast_dtype(u) or autocast_dtype(w)
        ctx.cast = dtype
        with torch.autocast(ctx.device_type, enabled=False):
            w, bias = cast(w, dtype), cast(bias, dtype)
            g = cast(F.gelu(u), dtype)  # (T, F), a temporary: the backward recomputes it from u
            out = g @ w if bias is None else torch.addmm(bias, g, w)  # (T, N)
        ctx.save_for_backward(u, w)  # w as cast (autocast keeps its cast copy the same way)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        u, w = ctx.saved_tensors
        grad_u = grad_w = grad_b = None
        with torch.autocast(ctx.device_type, enabled=False):
            grad = grad.to(w.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (cast(F.gelu(u), ctx.cast).T @ grad).to(ctx.w_dtype)  # (F, N)
            if ctx.needs_input_grad[0]:
                grad_u = torch.ops.aten.gelu_backward((grad @ w.T).to(u.dtype), u)  # (T, F)
            if ctx.needs_input_grad[2]:
                grad_b = grad.sum(0).to(ctx.b_dtype)  # (N,)
        return grad_u, grad_w, grad_b


def shared_input_lr(x: Tensor, Ls: list[Tensor], Rs: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """``[x @ L_i @ R_i + b_i for each i]``; x: (T, N_in), L_i: (N_in, r_i), R_i: (r_i, N_out_i), b_i: (N_out_i,)
    or None. Returns the (T, N_out_i), contiguous.

    Forward: ``h = x [L_1 | ... | L_n]`` (T, sum r_i), one GEMM; then, when every ``R_i`` has one shape and
    all or none have a bias, ``[h_1 .. h_n] [R_1 .. R_n] + b`` as one ``baddbmm``, else ``h_i R_i + b_i``
    each. Keeps ``x`` and ``h`` (as autocast casts them) and the factors as given. Under autocast it
    computes what the plain ops would: the products and biases in autocast's dtype, with its casting rule.
    """
    n = len(Ls)
    if not n or len(Rs) != n or len(biases) != n:
        raise ValueError(f"shared_input_lr needs as many L, R and biases (one per layer), got {len(Ls)}, "
                         f"{len(Rs)} and {len(biases)}")
    for L, R in zip(Ls, Rs, strict=True):
        if L.dim() != 2 or R.dim() != 2 or L.shape[0] != x.shape[-1] or L.shape[1] != R.shape[0]:
            raise ValueError(f"shared_input_lr: x {tuple(x.shape)}, L {tuple(L.shape)} and R {tuple(R.shape)} "
                             f"do not chain as (T, N_in) (N_in, r) (r, N_out)")
    return list(_SharedInputLR.apply(x, n, *Ls, *Rs, *biases))


def _one_output_shape(Rs: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> bool:
    return len({tuple(R.shape) for R in Rs}) == 1 and len({b is None for b in biases}) == 1


class _SharedInputLR(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, n: int, *params: Tensor | None) -> tuple[Tensor, ...]:
        Ls, Rs, biases = params[:n], params[n:2 * n], params[2 * n:]
        dtype = autocast_dtype(x) or autocast_dtype(Ls[0])
        ctx.n, ctx.cast, ctx.batched = n, dtype, _one_output_shape(Rs, biases)
        ctx.dtypes = [None if t is None else t.dtype for t in params]
        ctx.device_type = x.device.type if x.device.type in ("cpu", "cuda") else "cpu"
        with torch.autocast(ctx.device_type, enabled=False):
            xc = cast(x, dtype)
            h = xc @ cast(torch.cat(Ls, dim=1), dtype)  # (T, sum r_i); the concatenation is a temporary
            if ctx.batched:  # each stack cast once, as autocast casts a plain op's operand
                R = cast(torch.stack(Rs), dtype)  # (n, r, N_out), a temporary too
                hs = h.view(h.shape[0], n, R.shape[1]).transpose(0, 1)  # (n, T, r): a strided view
                out = torch.bmm(hs, R) if biases[0] is None else \
                    torch.baddbmm(cast(torch.stack(biases), dtype).unsqueeze(1), hs, R)
                outs = tuple(out.unbind(0))  # (T, N_out) each
            else:
                parts = h.split([L.shape[1] for L in Ls], dim=1)  # (T, r_i) views
                outs = tuple(hi @ cast(R, dtype) if b is None else torch.addmm(cast(b, dtype), hi, cast(R, dtype))
                             for hi, R, b in zip(parts, Rs, biases, strict=True))
        ctx.save_for_backward(xc, h, *Ls, *Rs)
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        n, dtype = ctx.n, ctx.cast
        xc, h, *factors = ctx.saved_tensors
        Ls, Rs = factors[:n], factors[n:]
        need = ctx.needs_input_grad
        grad_Ls: list[Tensor | None] = [None] * n
        grad_Rs: list[Tensor | None] = [None] * n
        grad_bs: list[Tensor | None] = [None] * n
        with torch.autocast(ctx.device_type, enabled=False):
            g = [t.to(h.dtype) for t in grads]  # (T, N_out_i) each
            if ctx.batched:
                g3 = torch.stack(g)  # (n, T, N_out)
                R = cast(torch.stack(Rs), dtype)  # remade: (n, r, N_out)
                hs = h.view(h.shape[0], n, R.shape[1]).transpose(0, 1)  # (n, T, r)
                grad_h = torch.bmm(g3, R.transpose(1, 2)).transpose(0, 1).reshape(h.shape)  # (T, n r)
                if any(need[2 + n:2 + 2 * n]):  # (r, N_out) each, cast once
                    grad_Rs = list(torch.bmm(hs.transpose(1, 2), g3).to(ctx.dtypes[n]).unbind(0))
                if any(need[2 + 2 * n:]):
                    grad_bs = list(g3.sum(1).to(ctx.dtypes[2 * n]).unbind(0))  # (N_out,) each
            else:
                parts = h.split([L.shape[1] for L in Ls], dim=1)
                grad_h = torch.cat([gi @ cast(R, dtype).T for gi, R in zip(g, Rs, strict=True)], dim=1)
                for i, (hi, gi) in enumerate(zip(parts, g, strict=True)):
                    grad_Rs[i] = hi.T @ gi if need[2 + n + i] else None  # (r_i, N_out_i)
                    grad_bs[i] = gi.sum(0) if need[2 + 2 * n + i] else None
            if any(need[2:2 + n]):
                grad_Ls = list((xc.T @ grad_h).to(ctx.dtypes[0]).split([L.shape[1] for L in Ls], dim=1))  # views
            grad_x = grad_h @ cast(torch.cat(Ls, dim=1), dtype).T if need[0] else None  # remade concatenation
        return (grad_x, None, *grad_Ls, *grad_Rs, *grad_bs)  # autograd casts each to its input's dtype


def scaled_bmm(a: Tensor, c: Tensor, m: Tensor | None, core_left: bool) -> Tensor:
    """One step of a batched core chain against the core ``c`` with its right bond scaled by ``m``.

    c: (G, r, n, r'); m: (G, r') or None (no scaling); ``core_left=False``: ``a`` (G, P, r) and
    the result ``a @ s`` (G, P, n*r'); ``core_left=True``: ``a`` (G, r', Q) and ``s @ a``
    (G, r*n, Q), where ``s = c * m`` with ``c`` viewed as (G, r, n*r') or (G, r*n, r').
    """
    if m is None:
        return torch.bmm(_as_operand(c, core_left), a) if core_left else torch.bmm(a, _as_operand(c, core_left))
    return _ScaledBmm.apply(a, c, m, core_left)


def _as_operand(s: Tensor, core_left: bool) -> Tensor:
    G, r, n, r2 = s.shape
    return s.reshape(G, r * n, r2) if core_left else s.reshape(G, r, n * r2)


class _ScaledBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, c: Tensor, m: Tensor, core_left: bool) -> Tensor:
        s = _as_operand(c * m.view(m.shape[0], 1, 1, -1), core_left)
        ctx.core_left = core_left
        ctx.save_for_backward(a, c, m)  # not s: the backward rebuilds it
        return torch.bmm(s, a) if core_left else torch.bmm(a, s)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        a, c, m = ctx.saved_tensors
        mv = m.view(m.shape[0], 1, 1, -1)
        s = _as_operand(c * mv, ctx.core_left)
        grad_a = grad_c = grad_m = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.bmm(s.transpose(1, 2), grad) if ctx.core_left else torch.bmm(grad, s.transpose(1, 2))
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_s = torch.bmm(grad, a.transpose(1, 2)) if ctx.core_left else torch.bmm(a.transpose(1, 2), grad)
            grad_s = grad_s.reshape(c.shape)  # (G, r, n, r')
            if ctx.needs_input_grad[1]:
                grad_c = grad_s * mv
            if ctx.needs_input_grad[2]:
                grad_m = (grad_s * c).sum(dim=(1, 2))  # (G, r')
        return grad_a, grad_c, grad_m, None

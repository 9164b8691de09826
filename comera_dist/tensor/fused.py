"""Products that keep less for backward: an operand made by a cheap element-wise op is recomputed.

- ``gelu_matmul(u, w)``: ``gelu(u) @ w``, keeping ``u`` alone (below).
- ``scaled_bmm(a, c, m, core_left)``: a batched chain step against a gate-scaled TT core
  ``c * m``, keeping ``c`` and ``m`` but not their product. ``c`` is a view of a group's stacked
  cores (``layers.ragged``), which autograd keeps for the gate gradient anyway, so the scaled copy
  (as large as the cores) no longer doubles it.

GELU fused into the product that consumes it: autograd keeps the pre-activation only.

A transformer FFN computes ``out(gelu(u))``. Run as two ops, autograd keeps two ``(T, F)``
tensors per block: ``u`` (GELU's backward needs it) and ``gelu(u)`` (the product's weight
gradient needs it). ``gelu_matmul(u, w)`` keeps ``u`` alone and recomputes ``gelu(u)`` in the
backward, one element-wise op next to the products it feeds. At the six-encoder's 3072-wide FFN
that is 12 KiB per token and block in fp32.

The FFN's out-projection takes it through ``gelu_input=True``: a dense one
(``layers.dense.Linear``, ``w`` its weight transposed) or a TT one (``TTLinear``, ``w`` its
contracted input half ``L``, so only ``(T, r)`` leaves the fused op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gelu_matmul(u: Tensor, w: Tensor) -> Tensor:
    """``gelu(u) @ w`` (exact, erf GELU); u: (T, F), w: (F, N) -> (T, N).

    Under autocast both operands are cast to its dtype first, as ``matmul`` would be.
    """
    if u.dim() != 2 or w.dim() != 2 or u.shape[1] != w.shape[0]:
        raise ValueError(f"gelu_matmul needs u (T, F) and w (F, N), got {tuple(u.shape)} and {tuple(w.shape)}")
    return _GeluMatmul.apply(u, w)


class _GeluMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u: Tensor, w: Tensor) -> Tensor:
        ctx.dtypes = (u.dtype, w.dtype)
        device_type = u.device.type if u.device.type in ("cpu", "cuda") else "cpu"
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            u, w = u.to(dtype), w.to(dtype)
        ctx.device_type = device_type
        with torch.autocast(device_type, enabled=False):
            out = F.gelu(u) @ w  # (T, N)
        ctx.save_for_backward(u, w)  # u as cast: the backward recomputes gelu(u) bit for bit
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        u, w = ctx.saved_tensors
        grad_u = grad_w = None
        with torch.autocast(ctx.device_type, enabled=False):
            grad = grad.to(u.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (F.gelu(u).T @ grad).to(ctx.dtypes[1])  # (F, N)
            if ctx.needs_input_grad[0]:
                grad_u = torch.ops.aten.gelu_backward(grad @ w.T, u).to(ctx.dtypes[0])  # (T, F)
        return grad_u, grad_w


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

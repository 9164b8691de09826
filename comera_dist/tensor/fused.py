"""GELU fused into the product that consumes it: autograd keeps the pre-activation only.

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

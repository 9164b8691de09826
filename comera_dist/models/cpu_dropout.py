"""Dropout on the CPU: a bool keep-mask drawn with ``torch.rand``, for the hidden states and inside attention.

PyTorch's CPU dropout draws its mask with ``bernoulli_`` and keeps it for backward as a float tensor, 4 bytes
per element (``at::dropout`` takes the fused ``native_dropout`` on accelerators only). SDPA's math path, the
CPU's whenever attention dropout is on, does the same inside attention and also keeps the dropped
probabilities: three ``(B, h, T, T)`` float tensors per block in all. Here the mask is ``rand >= p`` (1.5x
faster to draw than ``bernoulli_`` on the 2-core CI machine) and kept as a bool; attention keeps its softmax output
(which the softmax's own backward keeps anyway) and remakes the dropped probabilities in backward. The
distribution is the same (each element kept with probability ``1 - p``, scaled by ``1 / (1 - p)``); the
draws differ from PyTorch's, so a run's masks change, not its statistics.

Everywhere else the fused kernels stay: on an accelerator (``native_dropout``, SDPA's flash and
memory-efficient kernels keep a bool or an RNG offset already) and under ``torch.compile``, whose inductor
generates its own random numbers inside fused kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _own_path(x: Tensor, p: float, training: bool) -> bool:
    """Whether this module's CPU dropout applies (else PyTorch's own does, or nothing does)."""
    return training and p > 0 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """Bool mask of ``shape``: True (keep) with probability ``1 - p``, from the default generator."""
    return torch.rand(shape, dtype=torch.float32, device=device) >= p


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``; on the CPU (eager) with a bool mask that is all autograd keeps."""
    if not _own_path(x, p, training):
        return F.dropout(x, p, training)
    # x * keep: autograd keeps only the bool (its backward is grad * keep); a multiply by a bool is 3x
    # faster than torch.where on the 2-core CI machine
    return (x * keep_mask(x.shape, p, x.device)).mul_(1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same parameters, same ``isinstance``) through :func:`dropout`; ``inplace`` is ignored."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


class _DroppedTimesV(torch.autograd.Function):
    """``(probs * keep / (1 - p)) @ v`` for ``(N, T, T)`` probabilities and ``(N, T, d)`` values, keeping
    ``probs``, the bool ``keep`` and ``v`` (not the dropped probabilities: backward remakes them)."""

    @staticmethod
    def forward(ctx, probs: Tensor, keep: Tensor, v: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(probs, keep, v)
        ctx.scale = scale
        return torch.bmm((probs * keep).mul_(scale), v)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None, None]:
        probs, keep, v = ctx.saved_tensors
        grad_probs = grad_v = None
        if ctx.needs_input_grad[0]:  # d/dprobs = keep * scale * (grad @ v^T)
            grad_probs = torch.bmm(grad, v.to(grad.dtype).transpose(1, 2)).mul_(keep).mul_(ctx.scale).to(probs.dtype)
        if ctx.needs_input_grad[2]:  # d/dv = dropped^T @ grad
            dropped = (probs * keep).mul_(ctx.scale).to(grad.dtype)
            grad_v = torch.bmm(dropped.transpose(1, 2), grad).to(v.dtype)
        return grad_probs, None, grad_v, None


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool,
              keep: Tensor | None = None) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)``.

    q, k, v: (B, h, T, d); mask: bool, broadcastable to (B, h, T, T), True where a query may see a key, with
    every query seeing at least one key (``blocks.SelfAttention`` lets each see itself), or None. Where
    attention dropout is on, on the CPU in eager mode, the math path runs here: ``q k^T / sqrt(d)``, the
    mask, softmax, then dropout by a bool mask (``keep``, (B, h, T, T), drawn here unless given: tests pass
    their own) fused with the product by ``v``. It keeps q, k and v as the (B*h, T, d) operands of its two
    products (views where the batch merges into the heads without a copy, as SDPA's math path keeps them),
    the softmax output and the bool mask. Elsewhere SDPA runs.
    """
    # with or without gradients: a forward-only pass in training mode (the session's finite-probe) must
    # draw the masks the real pass draws
    if not _own_path(q, dropout_p, True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    B, h, T, d = q.shape
    q3, k3, v3 = (t.reshape(B * h, T, d) for t in (q, k, v))
    scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(1.0 / math.sqrt(d)).view(B, h, T, T)
    if is_causal:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal if mask is None else mask & causal
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B * h, T, T)
    if keep is None:
        keep = keep_mask(probs.shape, dropout_p, q.device)
    out = _DroppedTimesV.apply(probs, keep.reshape(B * h, T, T), v3, 1.0 / (1.0 - dropout_p))
    return out.view(B, h, T, d)

"""The Triton kernels as ``torch.library`` custom ops (``comera::tt_linear``, ``comera::ttm_lookup``).

Each forward op has a fake (meta) implementation and an autograd formula whose backward is
itself a custom op (``comera::tt_linear_backward``, ``comera::ttm_lookup_backward``), so
``torch.compile`` traces forward and backward as opaque nodes without looking into Triton.
Call these through ``comera_dist.kernels.dispatch``, which decides when they run.
"""

# No ``from __future__ import annotations``: custom_op infers the schema from real annotations.

import torch
from torch import Tensor

from comera_dist.kernels import tt_linear_kernel, ttm_lookup_kernel

_EMPTY = (0,)  # shape of the placeholder returned for a gradient nobody asked for


@torch.library.custom_op("comera::tt_linear", mutates_args=())
def _tt_linear(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None) -> Tensor:
    return tt_linear_kernel.tt_linear_fwd(x, L, R, bias)


@_tt_linear.register_fake
def _(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None) -> Tensor:
    torch._check(x.shape[1] == L.shape[0] and L.shape[1] == R.shape[0],
                 lambda: f"comera::tt_linear: x{tuple(x.shape)} L{tuple(L.shape)} R{tuple(R.shape)} do not chain")
    return x.new_empty((x.shape[0], R.shape[1]))


@torch.library.custom_op("comera::tt_linear_backward", mutates_args=())
def _tt_linear_backward(grad: Tensor, x: Tensor, L: Tensor, R: Tensor, need_dx: bool, need_dl: bool,
                        need_dr: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, dl, dr, db = tt_linear_kernel.tt_linear_bwd(grad, x, L, R, need_dx=need_dx, need_dl=need_dl,
                                                    need_dr=need_dr, need_db=need_db)
    placeholder = x.new_empty(_EMPTY)
    return (dx if dx is not None else placeholder, dl if dl is not None else placeholder.clone(),
            dr if dr is not None else placeholder.clone(), db if db is not None else placeholder.clone())


@_tt_linear_backward.register_fake
def _(grad: Tensor, x: Tensor, L: Tensor, R: Tensor, need_dx: bool, need_dl: bool, need_dr: bool,
      need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (x.new_empty(x.shape if need_dx else _EMPTY), L.new_empty(L.shape if need_dl else _EMPTY),
            R.new_empty(R.shape if need_dr else _EMPTY), x.new_empty((R.shape[1],) if need_db else _EMPTY))


def _tt_linear_setup(ctx, inputs, output) -> None:
    x, L, R, bias = inputs
    ctx.save_for_backward(x, L, R)
    ctx.has_bias = bias is not None


def _tt_linear_grad(ctx, grad: Tensor):
    x, L, R = ctx.saved_tensors
    nx, nl, nr, nb = ctx.needs_input_grad
    dx, dl, dr, db = torch.ops.comera.tt_linear_backward(grad, x, L, R, nx, nl, nr, nb and ctx.has_bias)
    return (dx if nx else None, dl if nl else None, dr if nr else None, db if nb and ctx.has_bias else None)


_tt_linear.register_autograd(_tt_linear_grad, setup_context=_tt_linear_setup)


@torch.library.custom_op("comera::ttm_lookup", mutates_args=())
def _ttm_lookup(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    return ttm_lookup_kernel.ttm_lookup_fwd(ids, A, B)


@_ttm_lookup.register_fake
def _(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    torch._check(A.shape[2] == B.shape[0],
                 lambda: f"comera::ttm_lookup: A{tuple(A.shape)} and B{tuple(B.shape)} ranks differ")
    return A.new_empty((ids.shape[0], A.shape[1] * B.shape[2]))


@torch.library.custom_op("comera::ttm_lookup_backward", mutates_args=())
def _ttm_lookup_backward(grad: Tensor, ids: Tensor, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    return ttm_lookup_kernel.ttm_lookup_bwd(grad, ids, A, B)


@_ttm_lookup_backward.register_fake
def _(grad: Tensor, ids: Tensor, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(A), torch.empty_like(B)


def _ttm_lookup_setup(ctx, inputs, output) -> None:
    ids, A, B = inputs
    ctx.save_for_backward(ids, A, B)


def _ttm_lookup_grad(ctx, grad: Tensor):
    ids, A, B = ctx.saved_tensors
    dA, dB = torch.ops.comera.ttm_lookup_backward(grad, ids, A, B)
    _, na, nb = ctx.needs_input_grad
    return None, dA if na else None, dB if nb else None


_ttm_lookup.register_autograd(_ttm_lookup_grad, setup_context=_ttm_lookup_setup)


def _autocast(*tensors: Tensor | None) -> list[Tensor | None]:
    """Cast float operands to the autocast dtype when autocast is on, as torch does for matmul.

    Custom ops are invisible to autocast, so without this a bf16 activation would meet fp32
    factors contracted from fp32 cores.
    """
    device_type = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device_type):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors]


def tt_linear(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """Fused ``(x L) R + bias``; x (..., N_in), L (N_in, r), R (r, N_out) -> (..., N_out)."""
    lead = x.shape[:-1]
    # Like the reference's addmm under autocast: the bias is cast with the operands.
    x, L, R, bias = _autocast(x, L, R, bias)
    y = torch.ops.comera.tt_linear(x.reshape(-1, x.shape[-1]), L, R, bias)  # (T, N_out)
    return y.reshape(*lead, R.shape[-1])


def ttm_lookup(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """Fused table-free lookup; ids (...) int, A (M1, N1, r), B (r, M2, N2) -> (..., N1*N2)."""
    A, B = _autocast(A, B)
    out = torch.ops.comera.ttm_lookup(ids.reshape(-1), A, B)  # (T, N1*N2)
    return out.reshape(*ids.shape, out.shape[-1])

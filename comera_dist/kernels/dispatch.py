"""The single point that decides which implementation of each TT op runs.

``auto`` picks Triton for CUDA tensors and the pure-PyTorch reference
(``comera_dist.tensor.contract``) everywhere else. Tests force a path with
``use_backend("torch" | "triton")``; users can set ``COMERA_KERNELS``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Literal

from torch import Tensor

from comera_dist.tensor import contract

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("comera_kernels", default=None)


def _requested() -> str:
    name = _override.get() or os.environ.get("COMERA_KERNELS", "auto")
    if name not in BACKENDS:
        raise ValueError(f"COMERA_KERNELS={name!r} is not one of {list(BACKENDS)}")
    return name


def resolve_backend(t: Tensor) -> str:
    """The backend that runs for a tensor on ``t.device``: ``"torch"`` or ``"triton"``."""
    name = _requested()
    if name == "auto":
        return "triton" if t.is_cuda else "torch"
    return name


@contextlib.contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Force a backend inside the block (tests use this to exercise each path)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {list(BACKENDS)}")
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)


def tt_linear(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(x L) R + bias``; x: (T, N_in), L: (N_in, r), R: (r, N_out) -> (T, N_out)."""
    if resolve_backend(x) == "triton":
        from comera_dist.kernels import ops  # imports triton; only on this path

        return ops.tt_linear(x, L, R, bias)
    return contract.tt_linear_lr(x, L, R, bias)


def ttm_lookup(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """Table-free TTM lookup; ids: (T,), A: (M1, N1, r), B: (r, M2, N2) -> (T, N1*N2)."""
    if resolve_backend(A) == "triton":
        from comera_dist.kernels import ops

        return ops.ttm_lookup(ids, A, B)
    return contract.ttm_lookup_pairs(ids, A, B)

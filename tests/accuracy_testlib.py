"""Test helper shared by tests/kernels and tests/unit (``tests/`` is on ``sys.path`` through ``tests/conftest.py``):
the bf16 accuracy rule every fast path is held to."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def bf16_error_vs_torch(fast: Callable[..., Tensor], ref: Callable[..., Tensor], args: list, *,
                        factor: float = 2.0, grad_seed: int = 1) -> dict[str, tuple[float, float]]:
    """bf16 ``fast`` vs the torch bf16 path ``ref``, both judged against ``ref`` in fp64.

    The tolerance is derived, as FlashAttention's tests do: for the output and every gradient,
    ``max|fast - fp64| <= factor * max|ref_bf16 - fp64| + tiny`` (``tiny`` covers outputs the
    torch path gets exactly right). The fp64 reference sees the same bf16-rounded inputs.
    Returns ``{name: (fast error, torch error)}``; asserts the bound.
    """
    floating = [isinstance(a, Tensor) and a.is_floating_point() for a in args]
    rounded = [a.to(torch.bfloat16) if f else a for a, f in zip(args, floating)]  # what all three see

    def leaves(dtype) -> list:
        return [a.detach().to(dtype).clone().requires_grad_(True) if f else a for a, f in zip(rounded, floating)]

    fast_args, torch_args, exact_args = leaves(torch.bfloat16), leaves(torch.bfloat16), leaves(torch.float64)
    outs = [fast(*fast_args), ref(*torch_args), ref(*exact_args)]
    g = torch.Generator().manual_seed(grad_seed)
    dy = torch.randn(outs[2].shape, generator=g).to(device=outs[2].device, dtype=torch.bfloat16)
    for o in outs:
        o.backward(dy.to(o.dtype))
    report: dict[str, tuple[float, float]] = {}
    pairs = [("out", outs[0], outs[1], outs[2])]
    pairs += [(f"grad{i}", a.grad, b.grad, c.grad) for i, (a, b, c) in enumerate(zip(fast_args, torch_args, exact_args))
              if isinstance(a, Tensor) and a.requires_grad]
    for name, got, base, exact in pairs:
        got, base, exact = got.detach(), base.detach(), exact.detach()
        err_fast = float((got.double() - exact).abs().max())
        err_torch = float((base.double() - exact).abs().max())
        tiny = 1e-6 * float(exact.abs().max())
        report[name] = (err_fast, err_torch)
        assert err_fast <= factor * err_torch + tiny, \
            f"{name}: kernel error {err_fast:.3g} > {factor} x torch bf16 error {err_torch:.3g}"
    return report

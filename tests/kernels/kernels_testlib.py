"""Shared pieces of the kernel tests: random operands, reference-vs-fast comparison, the GPU marker."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
from accuracy_testlib import bf16_error_vs_torch  # noqa: F401  (shared with tests/unit)
from torch import Tensor
from triton.runtime.autotuner import Autotuner

from comera_dist.kernels.launch import INTERPRET

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (native Triton)")
# pytest-timeout is a dev dependency, but a bare `timeout` mark without it fails --strict-markers.
_HAS_TIMEOUT = importlib.util.find_spec("pytest_timeout") is not None


def gpu_test(timeout_s: float) -> Callable:
    """A native-GPU kernel test: marked ``gpu``, skipped without CUDA, refused under the interpreter
    (the guard in tests/conftest.py), and stopped after ``timeout_s`` where pytest-timeout is installed.

    Budget: launch/gpu_check.sh gives all the ``gpu`` tests about 150 s, and each new Triton
    specialization compiles every autotuning config it meets. On one H200 the earlier shape sweep
    (fp32 autotuned at four TT-linear shapes, ~27 s each) took 117 s for 11 tests and ran past that
    budget on a cold machine; pinning configs (``pin_config``) and reusing specializations, the 19
    tests now take 28 s from a cold Triton cache (the slowest 6.5 s), hence 30 s a test.
    """
    marks = [pytest.mark.gpu, needs_cuda] + ([pytest.mark.timeout(timeout_s)] if _HAS_TIMEOUT else [])

    def mark(fn: Callable) -> Callable:
        for m in reversed(marks):
            fn = m(fn)
        return fn
    return mark


def bf16_cases(module, name: str, every_config_at: tuple, paper: tuple, odd: tuple) -> list:
    """``(shape, config)`` cases of a native bf16 test: every autotune config of ``module`` at one shape
    (``{name}-config{i}``), the paper shape autotuned (``config`` None) and an odd shape at config 0."""
    return ([pytest.param(every_config_at, i, id=f"{name}-config{i}") for i in range(len(module._CONFIGS))]
            + [pytest.param(paper, None, id="paper-autotuned"), pytest.param(odd, 0, id="odd-config0")])


def pin_config(monkeypatch: pytest.MonkeyPatch, module, index: int) -> None:
    """Every autotuned kernel of ``module`` runs only its ``index``-th config (no tuning, one compile)."""
    for name in dir(module):
        kernel = getattr(module, name)
        if isinstance(kernel, Autotuner):
            monkeypatch.setattr(kernel, "configs", [kernel.configs[index]])
# Where the kernel-vs-reference tests put their tensors: CPU under the interpreter (CI), else the GPU
# (``TRITON_INTERPRET=0 pytest tests/kernels`` on a CUDA machine runs the same tests natively).
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_kernels = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                   reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs Triton on CPU tensors: needs TRITON_INTERPRET=1")


def tt_operands(T: int, n_in: int, n_out: int, rank: int, *, bias: bool, dtype=torch.float32,
                device=DEVICE, seed: int = 0) -> list[Tensor | None]:
    """x (T, N_in), L (N_in, r), R (r, N_out), bias (N_out,) scaled so that y is O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n_in, generator=g)  # (T, N_in)
    L = torch.randn(n_in, rank, generator=g) / n_in**0.5  # (N_in, r)
    R = torch.randn(rank, n_out, generator=g) / rank**0.5  # (r, N_out)
    b = torch.randn(n_out, generator=g) if bias else None  # (N_out,)
    return [None if t is None else t.to(device=device, dtype=dtype) for t in (x, L, R, b)]


def ttm_operands(M1: int, N1: int, rank: int, M2: int, N2: int, *, dtype=torch.float32, device=DEVICE,
                 seed: int = 0) -> tuple[Tensor, Tensor]:
    """A (M1, N1, r), B (r, M2, N2) scaled so that the rows are O(1)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(M1, N1, rank, generator=g) / rank**0.25  # (M1, N1, r)
    B = torch.randn(rank, M2, N2, generator=g) / rank**0.25  # (r, M2, N2)
    return A.to(device=device, dtype=dtype), B.to(device=device, dtype=dtype)


def compare_with_reference(fast: Callable[..., Tensor], ref: Callable[..., Tensor], args: list,
                           *, rtol: float, atol: float, grad_seed: int = 1) -> None:
    """Forward outputs and the gradients of every floating input agree between ``fast`` and ``ref``.

    Non-float args (ids) and None pass through unchanged; the same random upstream gradient
    is used for both so the comparison covers the full vector-Jacobian product.
    """
    def leaves() -> list:
        return [a.detach().clone().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point()
                else a for a in args]

    fast_args, ref_args = leaves(), leaves()
    y_fast, y_ref = fast(*fast_args), ref(*ref_args)
    torch.testing.assert_close(y_fast, y_ref, rtol=rtol, atol=atol)
    g = torch.Generator().manual_seed(grad_seed)
    dy = torch.randn(y_ref.shape, generator=g).to(y_ref)
    y_fast.backward(dy)
    y_ref.backward(dy)
    for i, (a, b) in enumerate(zip(fast_args, ref_args)):
        if isinstance(a, Tensor) and a.requires_grad:
            assert a.grad is not None, f"no gradient for argument {i}"
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol, msg=lambda m, i=i: f"grad of arg {i}: {m}")

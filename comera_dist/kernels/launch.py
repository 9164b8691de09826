"""Launch helpers shared by the Triton kernels: interpreter detection, block sizes, grid splits, checks."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


# ``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, so ask a decorated kernel
# rather than the environment (which may have changed since).
INTERPRET: bool = isinstance(_probe, InterpretedFunction)


def native_problem() -> str | None:
    """Why a Triton launch in this process would not be a compiled kernel on a GPU; None when it would.

    ``check_same_device`` lets CUDA tensors through under the interpreter (it copies them to the
    host and back), so a kernel test on CUDA tensors can pass without compiling anything; the
    ``gpu`` tests call this first (tests/conftest.py).
    """
    if INTERPRET:
        return "the kernels were decorated under TRITON_INTERPRET=1, so every launch runs in the Triton interpreter"
    if triton.knobs.runtime.interpret:  # Triton's own reading of the variable ("1", "true", "on")
        return (f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} is set, so kernels decorated from now on "
                "would run in the Triton interpreter")
    if not torch.cuda.is_available():
        return "no CUDA device is visible, and compiled Triton kernels need one"
    return None


@triton.jit
def downcast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` to ``dtype`` with round-to-nearest-even, as compiled Triton casts.

    The interpreter's fp32 -> bf16 cast truncates (twice the rounding error), so under it bf16
    is rounded by hand first (the usual add-0x7FFF-plus-odd-bit trick), then cast exactly.
    """
    if INTERPRETED:  # noqa: SIM102 - two compile-time branches in a @triton.jit function, kept apart
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def tune_configs(candidates: list[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    """Autotuning candidates ``(BLOCK_M, BLOCK_K, BLOCK_N, num_warps, num_stages)``.

    The interpreter gets only the first: it ignores warps/stages and runs programs one by one,
    so tuning there would only cost time. Blocks stay >= 16 (compiled ``tl.dot`` needs it).
    """
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_K": k, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, k, n, w, s in candidates]
    return configs[:1] if INTERPRET else configs


def warp_configs(warps: tuple[int, ...]) -> list[triton.Config]:
    """Autotuning candidates over ``num_warps`` only (kernels whose tiles are fixed by the shapes)."""
    configs = [triton.Config({}, num_warps=w) for w in warps]
    return configs[:1] if INTERPRET else configs


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision that matches what torch's own matmul would do for ``dtype``.

    fp32 uses TF32 only when the user allowed it for cuBLAS; half types ignore the setting.
    """
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def split_count(tiles: int, max_split: int, device: torch.device) -> int:
    """How many ways to split each of ``tiles`` programs' work so that the GPU has ~2 waves.

    The interpreter runs programs one after another: splitting only costs time there, so 1.
    """
    if device.type != "cuda":
        return 1
    want = triton.cdiv(2 * _sm_count(device.index or 0), max(1, tiles))
    return max(1, min(want, max_split))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_same_device(op: str, **tensors: Tensor | None) -> None:
    """All tensors on one device, and that device one the Triton kernels can run on."""
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) != 1:
        where = ", ".join(f"{k}={t.device}" for k, t in present.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {where}")
    device = devices.pop()
    if device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{op}: the Triton kernels need CUDA tensors, got {device}; to run them on "
                           f"the CPU set TRITON_INTERPRET=1 before triton is imported, or use the "
                           f"'torch' backend (COMERA_KERNELS=torch)")

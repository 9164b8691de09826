"""Compile every kernel launch the wrappers make, natively for an sm_90 (H100) GPU, without a GPU.

The interpreter tests check the math but not that Triton can compile the kernels (block-size
rules, dtypes of ``tl.dot`` operands, constexpr branches). This script records the launches the
real wrappers issue for fp32 and bf16 at paper shapes (no kernel runs), then compiles each one
down to a cubin with Triton's bundled LLVM and ptxas. Run by test_native_compile.py in a
subprocess, because the kernels must be decorated with TRITON_INTERPRET unset.

    TRITON_INTERPRET=0 python tests/kernels/native_compile_check.py [--all-configs]
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run with TRITON_INTERPRET unset: the kernels must be compiled, not interpreted")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

from comera_dist.kernels import tt_linear_kernel, ttm_lookup_kernel

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
         torch.int32: "i32"}
launches: list[tuple[object, tuple, dict]] = []


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` is recorded."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            launches.append((self.kernel, args, constexprs))
        return launch


def record_launches() -> None:
    for mod in (tt_linear_kernel, ttm_lookup_kernel):
        mod.check_same_device = lambda *a, **k: None  # CPU tensors stand in for CUDA ones; nothing runs
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(mod, name, Recorder(getattr(mod, name)))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(300, 768, dtype=dtype)
        L, R, b = torch.randn(768, 30, dtype=dtype), torch.randn(30, 3072, dtype=dtype), torch.randn(3072, dtype=dtype)
        tt_linear_kernel.tt_linear_fwd(x, L, R, b)
        tt_linear_kernel.tt_linear_fwd(x, L, R, None)
        dy = torch.randn(300, 3072, dtype=dtype)
        tt_linear_kernel.tt_linear_bwd(dy, x, L, R, need_db=True)
        tt_linear_kernel.tt_linear_bwd(dy, x, L, R, need_dx=False, need_dr=False)
        A, B = torch.randn(320, 16, 32, dtype=dtype), torch.randn(32, 100, 48, dtype=dtype)
        ids = torch.randint(0, 32000, (500,))
        ttm_lookup_kernel.ttm_lookup_fwd(ids, A, B)
        ttm_lookup_kernel.ttm_lookup_bwd(torch.randn(500, 768, dtype=dtype), ids, A, B)


def signature(kernel, args: tuple, constexprs: dict) -> tuple[dict, dict]:
    sig, const = {}, {}
    for name, a in zip(kernel.arg_names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + TYPES[a.dtype]
        elif isinstance(a, int):
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
        else:
            raise TypeError(f"{kernel.__name__}: unexpected argument {name}={a!r}")
    for name, v in constexprs.items():
        sig[name] = "constexpr"
        const[(kernel.arg_names.index(name),)] = v
    return sig, const


def _operand_type(args: tuple) -> str:
    """The operand dtype a launch was made for (fp32 scratch buffers appear in bf16 launches too)."""
    return "*bf16" if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args) else "*fp32"


def variants(kernel, constexprs: dict, all_configs: bool) -> list[tuple[object, dict, dict]]:
    """(jit function, constexprs, compile options) per autotuning config of ``kernel``.

    By default only the config with the largest tiles (the likeliest to break a limit) and the
    most warps; ``all_configs`` compiles every one (about 100 variants, minutes of CPU).
    """
    if not isinstance(kernel, Autotuner):
        return [(kernel, constexprs, {})]
    configs = kernel.configs if all_configs else [max(
        kernel.configs, key=lambda c: (c.kwargs.get("BLOCK_M", 1) * c.kwargs.get("BLOCK_N", 1), c.num_warps))]
    return [(kernel.fn, {**constexprs, **cfg.kwargs}, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            for cfg in configs]


def main() -> int:
    all_configs = "--all-configs" in sys.argv[1:]
    record_launches()
    target = GPUTarget("cuda", 90, 32)
    seen = set()
    for kernel, args, recorded in launches:
        for fn, constexprs, options in variants(kernel, recorded, all_configs):
            sig, const = signature(fn, args, constexprs)
            key = (fn.__name__, tuple(sig.items()), tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
            if key in seen:
                continue
            seen.add(key)
            compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=target, options=options)
            assert compiled.asm.get("cubin"), f"{fn.__name__}: no cubin"
            dtype = _operand_type(args)
            print(f"compiled {fn.__name__} sm_90 {dtype} {dict(sorted(constexprs.items()))} {options} "
                  f"shared={compiled.metadata.shared}B")
    print(f"OK {len(seen)} kernel variants compiled for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())

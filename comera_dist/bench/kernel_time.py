"""Where a step's device time goes: every kernel's time in one step, from ``torch.profiler``, summed by kind.

A step time says how long a step took; on a GPU it does not say whether the kernels or the host's
launches took it, nor which kernels. Here one step runs under the profiler:

- on CUDA, each kernel's own duration on the device (CUPTI's record), not the ranges that
  ``record_function`` annotations span on the device;
- elsewhere, each aten op's self CPU time, the CPU's stand-in for a kernel (the CPU has no launches,
  so its step time is mostly its ops' time). A composite op (``matmul``, ``linear``) keeps only its own
  dispatch time, under "other"; the ``mm`` it runs is the GEMM.

The kinds (``KINDS``) are matched on the kernel's or op's name: cuBLAS/CUTLASS GEMMs and aten's matrix
products, attention, LayerNorm, softmax, reductions, copies, the optimizer's multi-tensor kernels,
Triton's generated kernels; the rest is element-wise or other. Their sum against the step time is how
much of the step the device was busy (``bench six-encoder --profile``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "flash", "fmha", "sdpa")),
    ("optimizer", ("adam", "multi_tensor")),
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm",
              "aten::addbmm")),
    ("triton", ("triton",)),
    ("norm", ("layer_norm", "layernorm")),
    ("softmax", ("softmax",)),
    ("reduce", ("reduce", "aten::sum", "aten::mean", "aten::norm")),
    ("copy", ("copy", "memcpy", "memset", "aten::cat", "aten::fill_", "aten::zero_", "catarray")),
)
"""(kind, name fragments) in matching order: a kernel is the first kind one of whose fragments its
lower-cased name contains ("other" if none); attention comes first, since its kernels' names contain
"gemm" or "softmax" too. ``nvjet`` is cuBLAS's Hopper GEMM family (``nvjet_sm90_tst_...``), which an H200
picks for bf16 products."""


def kind_of(name: str) -> str:
    """The ``KINDS`` kind of a kernel or aten op named ``name``."""
    low = name.lower()
    return next((kind for kind, parts in KINDS if any(p in low for p in parts)), "other")


def kernel_time(step: Callable[[], Any], device: torch.device, top: int = 8) -> dict[str, Any]:
    """Run ``step()`` once under ``torch.profiler`` and sum the time of its kernels on ``device``.

    Returns ``device_ms`` (all of them), ``by_kind_ms`` (``kind_of`` each), ``kernels`` (how many ran)
    and ``top``: the ``top`` names with the most time (name, ms, calls). Raises if the profiler saw no
    kernel, so a step it cannot see is never reported as free.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        step()
        if on_cuda:
            torch.cuda.synchronize(device)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if on_cuda:
            # a record_function range (the optimizer's own "Optimizer.step#AdamW.step") also gets a CUDA
            # record spanning the kernels it launched: counting it would count them twice
            if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            us = event.time_range.elapsed_us()
        else:
            if not event.name.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        per_name[event.name][0] += us / 1e3
        per_name[event.name][1] += 1
    if not per_name:
        raise RuntimeError(f"the profiler recorded no kernel of the step on {device}")
    by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_name.items():
        by_kind[kind_of(name)] += ms
    ranked = sorted(per_name.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {"device_ms": sum(ms for ms, _ in per_name.values()),
            "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernels": sum(n for _, n in per_name.values()),
            "top": [{"name": name[:120], "ms": ms, "calls": n} for name, (ms, n) in ranked]}

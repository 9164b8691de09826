"""The single point that decides which implementation of each TT op runs.

``auto`` picks, per op and shape, whichever implementation ``bench kernels`` measured faster on
the GPU; everything else, and every CPU tensor, runs the pure-PyTorch reference
(``comera_dist.tensor.contract``). Tests force a path with ``use_backend("torch" | "triton")``;
users can set ``COMERA_KERNELS``. Forcing ``triton`` on CPU tensors runs the kernels in Triton's
interpreter (needs ``TRITON_INTERPRET=1`` before triton is imported).

The measured rule (``FASTER_WITH_TRITON``, empty today): on one H200 (project at ae4e305,
2026-11-26, ``docs/bench/kernels`` notes in ``docs/benchmarks.md``) ``bench kernels`` measured the
fused TT linear at 0.32x the torch path (geometric mean over the paper's three layer shapes,
4k and 16k tokens, fp32 and bf16, forward + backward; 1.42 ms fused vs 0.44 ms torch at
768x3072, 16k tokens, bf16) and the fused lookup at 0.56x the naive chain. No shape was faster
with Triton, so on CUDA ``auto`` runs the torch path for both ops. A shape enters the rule only
with a measurement on a named card that shows the kernel ahead.

Under ``torch.compile`` the choice is made when a graph is traced: the ``use_backend`` override
is a module global, which Dynamo guards (changing it re-traces); ``COMERA_KERNELS`` is read when
tracing (torch 2.13 also guards on it and re-traces when it changes; tests/unit/test_dispatch_trace.py
gives each value a fresh trace). The override is process-wide, not per thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor

from comera_dist.tensor import contract

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
TRITON_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# Set only by ``use_backend``; a plain global (not a ContextVar) so that torch.compile can trace it.
_override: str | None = None
# Set only by ``static_shapes``; a plain global for the same reason.
_static: bool = False


class SettingError(ValueError):
    """An environment variable of the dispatch (``COMERA_KERNELS``, ``COMERA_RANK_ALIGN``, ``COMERA_FFN_ROWS``)
    has a bad value; the message names it. ``comera pretrain`` checks them up front (``check_environment``)."""


def check_environment() -> None:
    """Raise ``SettingError`` for a bad value of any of the dispatch's environment variables, before a run
    starts, not at its first step on every rank."""
    _requested()
    _rank_align()
    _ffn_setting_checked()


def check_device(device: torch.device) -> None:
    """``SettingError`` when ``COMERA_KERNELS=triton`` asks for the Triton kernels where they cannot run: on a
    device other than CUDA without the interpreter. Called where the run's device is known (its start), not by
    ``check_environment``, which also runs on a login node without the job's GPUs."""
    if _requested() == "triton" and device.type != "cuda":
        from comera_dist.kernels.launch import INTERPRET

        if not INTERPRET:
            raise SettingError(f"COMERA_KERNELS=triton runs the Triton kernels, which need CUDA; this run's device "
                               f"is {device.type}: set TRITON_INTERPRET=1 to interpret them (slow), or "
                               "COMERA_KERNELS=auto")


def _requested() -> str:
    if _override is not None:
        return _override
    name = os.environ.get("COMERA_KERNELS", "auto")
    if name not in BACKENDS:
        raise SettingError(f"COMERA_KERNELS={name!r} is not one of {list(BACKENDS)}")
    return name


FASTER_WITH_TRITON: dict[str, frozenset[tuple[str, tuple[int, ...], torch.dtype]]] = {
    "tt_linear": frozenset(),
    "ttm_lookup": frozenset(),
}
"""``op -> {(card name, shape key, dtype)}`` where ``bench kernels`` measured the Triton kernel
faster than the torch path. Shape keys: ``(N_in, r, N_out)`` for ``tt_linear``, ``(M1, N1, r, M2,
N2)`` for ``ttm_lookup``. Empty: on the H200 no measured shape was faster (module docstring)."""


def resolve_backend(t: Tensor, op: str | None = None, shape: tuple[int, ...] | None = None) -> str:
    """The backend that runs for ``t`` (the op's float operand): ``"torch"`` or ``"triton"``.

    Under ``auto`` Triton runs only for CUDA tensors of a kernel dtype whose ``(card, shape,
    dtype)`` is in ``FASTER_WITH_TRITON[op]``.
    """
    name = _requested()
    if name == "auto":
        if not (t.is_cuda and t.dtype in TRITON_DTYPES and op is not None and shape is not None):
            return "torch"
        rules = FASTER_WITH_TRITON.get(op, frozenset())
        return "triton" if rules and (_card(t), shape, t.dtype) in rules else "torch"
    return name


def _card(t: Tensor) -> str:
    return torch.cuda.get_device_name(t.device)


@contextlib.contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Force a backend inside the block (tests use this to exercise each path)."""
    global _override
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {list(BACKENDS)}")
    previous, _override = _override, name
    try:
        yield
    finally:
        _override = previous


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    """Inside the block, CPU tensors take the path CUDA tensors and compiled graphs take.

    That path has no data-dependent shapes and no host reads (no ``torch.unique``
    deduplication, no CPU-only id range checks). ``bench ops`` counts a step this way, as the
    CPU proxy of a GPU step; tests use it to exercise the path on the CPU.
    """
    global _static
    previous, _static = _static, True
    try:
        yield
    finally:
        _static = previous


RANK_ALIGN = 8
"""Default of ``COMERA_RANK_ALIGN``: the middle rank a group's ``L``/``R`` are zero-padded up to a multiple of."""


def aligned_rank(r: int) -> int:
    """``r`` rounded up to a multiple of ``COMERA_RANK_ALIGN`` (default ``RANK_ALIGN``, 8; 1 turns it off).

    ``pad_rank`` pads a contracted ``L`` with zero columns and ``R`` with zero rows up to it (``layers.group``
    for each group, ``TTLinear._halves`` for a layer contracted alone: ZeRO-3, singletons, forced orders):
    ``(x L) R`` is unchanged, and the token GEMMs (``x L``, ``h R`` and their backward) get dimensions that
    are multiples of 8. On this project's 2-core CPU a rank of 30 made those GEMMs 1.3-2.1x slower than 32
    (``docs/bench/raw/rank-align-cpu.txt``); NVIDIA's guidance for fp16/bf16 tensor cores asks for multiples
    of 8 too (not measured on a GPU here). The price is the padding's FLOPs (at most 7 ranks) and one pad
    per group and half.
    """
    align = _rank_align()
    return -(-r // align) * align


def _rank_align() -> int:
    raw = os.environ.get("COMERA_RANK_ALIGN", str(RANK_ALIGN))
    try:
        align = int(raw)
    except ValueError:
        align = 0
    if align < 1:
        raise SettingError(f"COMERA_RANK_ALIGN={raw!r} must be a positive integer (1: no padding)")
    return align


def pad_rank(L: Tensor, R: Tensor) -> tuple[Tensor, Tensor]:
    """``L`` (..., N_in, r) with zero columns and ``R`` (..., r, N_out) with zero rows up to ``aligned_rank(r)``:
    ``(x L) R`` is unchanged (exact zeros; only the GEMMs' summation blocking may differ), ``x L`` and
    ``h R`` get an aligned inner dimension. The inputs themselves when ``r`` is aligned already."""
    r = L.shape[-1]
    if R.shape[-2] != r:
        raise ValueError(f"pad_rank: L has rank {r} but R has {R.shape[-2]} (shapes {tuple(L.shape)}, {tuple(R.shape)})")
    width = aligned_rank(r)
    if width == r:
        return L, R
    return torch.nn.functional.pad(L, (0, width - r)), torch.nn.functional.pad(R, (0, 0, 0, width - r))


def host_work_ok(t: Tensor) -> bool:
    """Whether data-dependent host work on ``t`` is free: a CPU tensor, in eager mode, outside
    ``static_shapes()``. Elsewhere such work (``int(t.max())``, ``torch.unique``) would stall the
    GPU, forbid CUDA-graph capture or break a compiled graph."""
    return t.device.type == "cpu" and not _static and not torch.compiler.is_compiling()


def keeps_padded_ranks(t: Tensor) -> bool:
    """Whether a pruned group's factors keep the group's padded middle rank (``layers.group``): off the
    CPU, and under ``static_shapes()``. A padded rank of ``L`` is a zero column and of ``R`` a zero row, so
    ``(x L) R`` is the same, at more FLOPs in the two token GEMMs. A GPU step at these sizes is bound by
    its launches, and the padded form launches fewer kernels: the cut slices' backward (a zero fill and a
    copy each, two per layer and step) is gone, and Q, K and V keep one shape, so their output side stays
    one batched GEMM (``contract.tt_linear_lr_shared``) after a prune. The CPU eager step is bound by
    FLOPs and cuts each layer back to its own rank. Not timed on a GPU."""
    return t.device.type != "cpu" or _static


def tt_linear(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(x L) R + bias``; x: (..., N_in), L: (N_in, r), R: (r, N_out) -> (..., N_out)."""
    x2d = x.reshape(-1, x.shape[-1])  # (T, N_in): both backends take 2-D activations
    if resolve_backend(x, "tt_linear", (L.shape[0], L.shape[1], R.shape[1])) == "triton":
        from comera_dist.kernels import ops  # imports triton; only on this path

        y = ops.tt_linear(x2d, L, R, bias)  # (T, N_out)
    else:
        y = contract.tt_linear_lr(x2d, L, R, bias)  # (T, N_out)
    return y.reshape(*x.shape[:-1], R.shape[-1])


def tt_linear_shared(x: Tensor, factors: list[tuple[Tensor, Tensor]],
                     biases: list[Tensor | None]) -> list[Tensor]:
    """``[tt_linear(x, L, R, b) for (L, R), b in zip(factors, biases)]``, layers reading the same ``x``:
    on the torch path the input side is one GEMM (``contract.tt_linear_lr_shared``); a layer whose
    shape runs in Triton sends them all through ``tt_linear``."""
    backends = {resolve_backend(x, "tt_linear", (L.shape[0], L.shape[1], R.shape[1])) for L, R in factors}
    if "triton" in backends:
        return [tt_linear(x, L, R, b) for (L, R), b in zip(factors, biases, strict=True)]
    x2d = x.reshape(-1, x.shape[-1])  # (T, N_in)
    ys = contract.tt_linear_lr_shared(x2d, [L for L, _ in factors], [R for _, R in factors], biases)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


FFN_BLOCK_ELEMENTS = 2**19
"""The CPU's row blocks of the fused TT FFN (``tt_ffn``) hold at most this many elements of the FFN width (2 MiB
in fp32, about a core's share of the cache), in a power-of-two row count. The six-encoder's b32 FFN (4096 tokens,
F = 3072, so 128 rows) ran fwd + bwd in 130-136 ms against 226-241 ms unfused; 168 rows, the most that fit, in
152-165 (two sweeps on this 2-core CPU: `docs/bench/raw/ffn-rows-cpu.txt`)."""


def ffn_setting() -> str:
    """``COMERA_FFN_ROWS`` as ``ffn_rows`` reads it (``auto`` when unset); the benchmarks record it."""
    return os.environ.get("COMERA_FFN_ROWS", "auto").strip().lower()


def ffn_rows(t: Tensor, width: int) -> int:
    """Tokens per block of the fused TT FFN for activations like ``t`` and FFN width ``width``; 0 for the
    unfused ops. ``COMERA_FFN_ROWS`` forces it: ``off`` (the unfused ops), ``all`` (one block), or a count.
    Default: blocks of ``FFN_BLOCK_ELEMENTS`` on the CPU in eager mode, where the wide tensors then stay in
    cache; one block on a GPU, where a block costs a launch of every kernel in it, and so under
    ``static_shapes()`` (the GPU's step emulated on the CPU, ``bench ops``) and ``torch.compile``."""
    raw = _ffn_setting_checked()
    if raw == "off":
        return 0
    gpu_like = t.device.type != "cpu" or _static or torch.compiler.is_compiling()
    if raw == "all" or (raw == "auto" and gpu_like):
        return max(1, t.numel() // max(1, t.shape[-1]))
    if raw == "auto":
        fit = max(1, FFN_BLOCK_ELEMENTS // max(1, width))
        return max(8, 1 << (fit.bit_length() - 1))  # the largest power of two that fits
    return int(raw)


def _ffn_setting_checked() -> str:
    raw = ffn_setting()
    if raw not in ("auto", "off", "all") and (not raw.isdigit() or int(raw) < 1):
        raise SettingError(f"COMERA_FFN_ROWS must be auto, off, all or a positive row count, got {raw!r}")
    return raw


def tt_ffn(x: Tensor, inp: tuple[Tensor, Tensor], b_in: Tensor | None, out: tuple[Tensor, Tensor],
           b_out: Tensor | None) -> Tensor:
    """``out(gelu(inp(x)))`` for two TT layers given their factors: x: (..., N_in), ``inp`` = (L_in (N_in, r_in),
    R_in (r_in, F)), ``out`` = (L_out (F, r_out), R_out (r_out, N_out)) -> (..., N_out).

    The fused op (``contract.tt_ffn_lr``: the (T, F) middle remade in backward, in ``ffn_rows`` blocks), unless
    ``ffn_rows`` says off or the input projection's shape runs in Triton (``resolve_backend``): then the two
    layers as before, ``tt_linear`` and ``contract.tt_linear_lr_gelu``, which keeps the (T, F) pre-activation."""
    (L_in, R_in), (L_out, R_out) = inp, out
    x2d = x.reshape(-1, x.shape[-1])  # (T, N_in)
    rows = ffn_rows(x2d, R_in.shape[1])
    if rows == 0 or resolve_backend(x, "tt_linear", (L_in.shape[0], L_in.shape[1], R_in.shape[1])) == "triton":
        y = contract.tt_linear_lr_gelu(tt_linear(x2d, L_in, R_in, b_in), L_out, R_out, b_out)  # (T, N_out)
    else:
        y = contract.tt_ffn_lr(x2d, (L_in, R_in, b_in), (L_out, R_out, b_out), rows=rows)  # (T, N_out)
    return y.reshape(*x.shape[:-1], R_out.shape[-1])


def ttm_lookup(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """Table-free TTM lookup; ids: (...) int64, A: (M1, N1, r), B: (r, M2, N2) -> (..., N1*N2).

    The torch path deduplicates ids with ``torch.unique`` only where that is free
    (``host_work_ok``: CPU eager); elsewhere it keeps every shape static.
    """
    if resolve_backend(A, "ttm_lookup", (*A.shape, B.shape[1], B.shape[2])) == "triton":
        from comera_dist.kernels import ops

        return ops.ttm_lookup(ids, A, B)
    flat = ids.reshape(-1)  # (T,)
    rows = contract.ttm_lookup_pairs(flat, A, B, dedup="dynamic" if host_work_ok(flat) else "static")  # (T, N)
    return rows.reshape(*ids.shape, rows.shape[-1])

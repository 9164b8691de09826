"""``bench six-encoder --device cuda``: dense, CoMERA and GaLore on one device, fp32 and bf16.

Each contender runs in every mode it supports:

- ``eager``: the step as written (``Contender.train_step``);
- ``graph`` (CUDA only; dense and CoMERA): the whole step captured once in a CUDA graph and
  replayed (``bench.graphed``), the paper's own GPU optimisation. GaLore's projections are host
  work and cannot be captured.
- ``compiled`` and ``compiled-graph`` (dense and CoMERA, only when ``--modes`` asks): the loss
  (forward and, through AOTAutograd, backward) compiled by ``torch.compile(fullgraph=True)``
  (``--compile-backend``, inductor by default), stepped eagerly or captured like ``graph``. Inductor
  fuses the element-wise work both models share (LayerNorm, GELU, dropout, residuals, the gate
  masks), which is most of a bf16 step once launches are gone; the AdamW step stays torch's fused one.

The headline metrics compare each contender in its **fastest** mode at that batch and dtype
(CoMERA graphed against dense graphed, if that is dense's best), so a speedup is never CoMERA's
best against dense's worst; the eager-only ratios are recorded beside them. Peak memory is the
allocator's peak of the same mode (for a graph: warm-up, capture and its private memory pool),
less what was allocated before the contender was built (on the first H200 run with graphs, memory
that earlier contenders left behind inflated the later contenders' peaks by 200-400 MiB), with
cuBLAS's workspaces freed first so each contender's peak includes its own (``_baseline``); off CUDA,
the profiler's peak of live tensors (``memory_probe.step_peak_bytes``). ``--recompute`` builds every
contender with ``model.activation_checkpointing`` (each block recomputed in backward): what bounds
CoMERA's memory at batch 1, paid in time, measured side by side; its metrics end in ``_recompute``.
``--recompute-factors`` also has each recomputed block remake its TT factors (``model.recompute_factors``);
metrics end in ``_recompute_factors``.
A capture that fails (a host sync inside the step, say) is recorded as that row's ``error``
and the mode drops out of the metrics.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from typing import Any

import torch
from torch import Tensor

from comera_dist.bench.common import CUBLAS_WORKSPACE_ENV, CUBLASLT_ENV, write_result
from comera_dist.bench.compile_stats import graph_kernels, kernel_profile
from comera_dist.bench.kernel_time import kernel_time
from comera_dist.bench.memory_probe import step_peak_bytes
from comera_dist.bench.peak_allocations import peak_allocations
from comera_dist.bench.six_encoder import (
    ADAMW,
    MODES,
    SEQ_LEN,
    SMOKE_SEQ_LEN,
    Contender,
    make_contender,
    random_batch,
    time_steps,
)
from comera_dist.kernels import dispatch

DEVICE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def modes(name: str, device: torch.device, wanted: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The modes of ``wanted`` (default: eager, and graph on CUDA) that ``name`` can run on ``device``:
    graphs need CUDA and a capturable optimizer, and GaLore (host-side projections) runs eagerly only."""
    wanted = ("eager", "graph") if wanted is None else wanted
    unknown = sorted(set(wanted) - set(MODES))
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; the modes are {list(MODES)}")
    if name == "galore":
        return tuple(m for m in wanted if m == "eager")
    return tuple(m for m in wanted if device.type == "cuda" or not m.endswith("graph"))


def compile_loss(c: Contender, backend: str) -> Contender:
    """``c`` with its loss compiled whole (``fullgraph=True``: a graph break is an error, not a silent
    eager fallback; static shapes: each batch size is its own graph). Dynamo's caches are reset first:
    the previous contender's graphs (guarded on its modules) would only count against the recompile limit."""
    torch._dynamo.reset()
    c.loss = torch.compile(c.loss, fullgraph=True, dynamic=False, backend=backend)
    return c


def peak_step_bytes(c: Contender, batch: dict[str, Tensor]) -> int:
    """Peak memory of one eager training step (parameters, gradients, optimizer state, activations, made
    in forward or recomputed in backward): the allocator's peak on CUDA (with the workspaces), the
    profiler's peak of live tensors elsewhere (``memory_probe.step_peak_bytes``)."""
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        c.train_step(batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return step_peak_bytes(lambda: c.train_step(batch))


def measure(c: Contender, mode: str, batch: dict[str, Tensor], steps: int) -> dict[str, float]:
    """Median/min step time of ``steps`` timed steps after the warm-up, and the peak bytes, in ``mode``
    (the allocator's peak: the caller subtracts what was allocated before the contender was built)."""
    _free_cublas_workspaces(batch["input_ids"].device)  # an earlier batch size's (or graph stream's) workspace
    if not mode.endswith("graph"):
        c.train_step(batch)  # warm-up (GaLore: its first projections; compiled: the compilation)
        t = time_steps(c.train_step, batch, steps)
        peak = peak_step_bytes(c, batch)
        return {**t, "peak_bytes": peak, "workspace_bytes": workspace_bytes(batch["input_ids"].device)}
    from comera_dist.bench.graphed import GraphedStep

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    graphed = GraphedStep(c.loss, c.optimizer, batch, autocast=c.autocast)  # warm-up steps + capture
    graphed.step(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    t = time_steps(graphed.step, batch, steps)
    loss = float(graphed.step(batch))
    if not torch.isfinite(torch.tensor(loss)):
        raise RuntimeError(f"graph replay gave a non-finite loss ({loss})")
    del graphed
    return {**t, "peak_bytes": peak, "workspace_bytes": workspace_bytes(batch["input_ids"].device)}


def _baseline(device: torch.device) -> int:
    """Bytes the CUDA caching allocator holds in live tensors now, after freeing cuBLAS's workspaces
    (0 off CUDA: the CPU peak is measured per step by ``memory_probe`` and needs no baseline).

    cuBLAS keeps one workspace per stream in the caching allocator, so it counts in
    ``memory_allocated``, and it stays allocated after its contender is gone. Left in place it would
    be charged to whichever contender first ran on a stream. On the H200 the same ~65 MiB came and
    went with that: CoMERA b1 eager read 142.8 MiB in a run without the baseline subtraction and
    77.5 MiB with it (dense had made the default stream's workspace), its graph mode (a new stream)
    142.5 MiB, and dense's first capture 65 MiB less once warm-up and capture shared one stream.
    Freed here and before every measurement (each graph capture makes a new stream, so without that
    a graph row at batch 32 also carried the workspaces of batches 1 and 8: 65 MiB each), every row
    pays for the workspaces it allocates itself, whatever the order."""
    if device.type != "cuda":
        return 0
    _free_cublas_workspaces(device)
    return torch.cuda.memory_allocated(device)


def workspace_bytes(device: torch.device) -> int:
    """Bytes of the cuBLAS (and cuBLASLt) workspaces alive in the caching allocator now, found by freeing
    them (CUDA; 0 elsewhere). They count in a row's peak; this says how much of it they are. Only between
    measurements, as ``_free_cublas_workspaces``."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    _free_cublas_workspaces(device)
    return before - torch.cuda.memory_allocated(device)


def _free_cublas_workspaces(device: torch.device) -> None:
    """Free cuBLAS's per-stream workspaces (CUDA; a no-op elsewhere). Only between measurements: no
    graph that captured one may be replayed afterwards (``measure`` deletes its graph)."""
    if device.type == "cuda":
        torch._C._cuda_clearCublasWorkspaces()


def _best(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(contender, dtype, batch) -> the row of its fastest mode that ran without error."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["contender"], r["dtype"], r["batch"])
        if "error" not in r and (key not in best or r["step_s"] < best[key]["step_s"]):
            best[key] = r
    return best


def metrics_of(rows: list[dict[str, Any]], sizes: list[int], dev: str) -> dict[str, float]:
    """Speedups and memory ratios, best mode against best mode (and each mode against the same mode:
    ``speedup_vs_dense_eager_...``, ``..._compiled_graph_...``)."""
    best = _best(rows)
    same = {(r["contender"], r["mode"], r["dtype"], r["batch"]): r for r in rows if "error" not in r}
    b_lo = min(sizes)
    out: dict[str, float] = {}
    for dtype in DEVICE_DTYPES:
        for b in sizes:
            if ("dense", dtype, b) in best and ("comera", dtype, b) in best:
                out[f"speedup_vs_dense_b{b}_{dev}_{dtype}"] = \
                    best["dense", dtype, b]["step_s"] / best["comera", dtype, b]["step_s"]
            for mode in MODES:
                if ("dense", mode, dtype, b) in same and ("comera", mode, dtype, b) in same:
                    out[f"speedup_vs_dense_{mode.replace('-', '_')}_b{b}_{dev}_{dtype}"] = \
                        same["dense", mode, dtype, b]["step_s"] / same["comera", mode, dtype, b]["step_s"]
        if ("galore", dtype, b_lo) in best and ("comera", dtype, b_lo) in best:
            suffix = "" if dtype == "fp32" else f"_{dtype}"
            out[f"speedup_vs_galore_b{b_lo}_{dev}{suffix}"] = \
                best["galore", dtype, b_lo]["step_s"] / best["comera", dtype, b_lo]["step_s"]
    for peer in ("galore", "dense"):
        if (peer, "fp32", b_lo) in best and ("comera", "fp32", b_lo) in best:
            out[f"memory_ratio_{peer}_over_comera_b{b_lo}_{dev}"] = \
                best[peer, "fp32", b_lo]["peak_MiB"] / best["comera", "fp32", b_lo]["peak_MiB"]
    return out


def _rows(args, device: torch.device, steps: int, sizes: list[int], wanted: tuple[str, ...] | None,
          counting: bool, kernels: dict[str, Any], peaks: dict[str, Any]) -> list[dict[str, Any]]:
    """``run_device``'s measured rows, one per contender, mode, dtype and batch size; with ``--profile`` the
    kernel time of each row's step at the largest batch goes into ``kernels`` by row, with
    ``--peak-allocations`` what each eager row at the smallest batch holds at its peak into ``peaks``."""
    b_lo = min(sizes)
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes or DEVICE_DTYPES:
        autocast = DEVICE_DTYPES[dtype_name]
        for name in args.contenders or ("dense", "comera", "galore"):
            for mode in modes(name, device, wanted):
                base = _baseline(device)  # what earlier contenders left: not this one's memory
                c = make_contender(name, smoke=args.smoke, device=device, capturable=mode.endswith("graph"),
                                   recompute=args.recompute, recompute_factors=args.recompute_factors)
                c.autocast = autocast
                if mode.startswith("compiled"):
                    compile_loss(c, args.compile_backend)
                for b in sizes if name != "galore" else [b_lo]:
                    batch = random_batch(c.model, b, smoke=args.smoke)
                    row: dict[str, Any] = {"contender": name, "mode": mode, "dtype": dtype_name, "batch": b,
                                           "params": sum(q.numel() for q in c.model.parameters())}
                    if counting and mode.startswith("compiled"):
                        row |= _kernels_row(c, batch)
                    if args.profile and b == max(sizes):
                        kernels[f"{name} {mode} {dtype_name} b{b}"] = _kernel_time_row(c, batch, row)
                    try:
                        m = measure(c, mode, batch, steps)
                    except RuntimeError as e:  # a failed capture is a result: recorded, not fatal
                        row["error"] = f"{type(e).__name__}: {e}"[:400]
                        print(f"six-encoder: {name} {mode} {dtype_name} b{b} failed: {row['error']}", flush=True)
                    else:
                        row.update(step_s=m["median_s"], step_min_s=m["min_s"],
                                   tokens_per_s=b * batch["input_ids"].shape[1] / m["median_s"],
                                   peak_MiB=(m["peak_bytes"] - base) / 2**20,
                                   workspace_MiB=m["workspace_bytes"] / 2**20)
                        if args.peak_allocations and mode == "eager" and b == b_lo:  # after the timed steps
                            peaks[f"{name} {mode} {dtype_name} b{b}"] = peak_allocations(
                                functools.partial(c.train_step, batch), device)
                    rows.append(row)
                del c
                gc.collect()  # module reference cycles would keep the last contender's tensors
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _kernel_time_row(c: Contender, batch: dict[str, Tensor], row: dict[str, Any]) -> dict[str, Any]:
    """``kernel_time`` of one step of ``c``, also as the row's ``device_ms``; or why it could not. Stepped,
    never replayed (a replay hides its kernels from the profiler), before ``measure`` warms up: a graph
    mode's row gets the kernels its graph captures (the eager step's, or the compiled loss's)."""
    try:
        c.train_step(batch)  # a compiled step's first call compiles (and a failed compile raises here)
        k = kernel_time(lambda: c.train_step(batch), batch["input_ids"].device)
    except RuntimeError as e:  # recorded, not fatal to the timings (measure records the row's own failure)
        return {"error": str(e)[:200]}
    row["device_ms"] = k["device_ms"]
    return k


def _kernels_row(c: Contender, batch: dict[str, Tensor]) -> dict[str, Any]:
    """``graph_kernels`` (generated, extern) of a compiled step, or why they could not be counted: one
    step to compile (outside the profiler), then the counted one, both eager (a CUDA graph's replay would
    hide its kernels), before ``measure`` warms up and times its own."""
    try:
        c.train_step(batch)
        k = graph_kernels(lambda: c.train_step(batch))
    except RuntimeError as e:  # a count that cannot be made is recorded, not fatal to the timings
        return {"graph_kernels_error": str(e)[:200]}
    return {"graph_kernels": k["kernels"], "generated_kernels": sum(k["generated"].values()),
            "extern_kernels": sum(k["extern"].values())}


def run_device(args, device: torch.device, steps: int, sizes: list[int], argv: list[str]) -> int:
    """Every contender, mode, dtype and batch size on ``device`` (GaLore at the smallest batch only,
    where the paper compares it); one JSON result with the rows and ``metrics_of`` them. ``argv``: the
    benchmark's arguments, recorded as its command."""
    load_start = os.getloadavg()
    wanted = tuple(args.modes) if args.modes else None
    # inductor's compiled rows also count their graphs' kernels (on the CPU its C++ kernels must be
    # compiled to record themselves)
    counting = args.compile_backend == "inductor" and any(m.startswith("compiled") for m in wanted or ())
    kernels: dict[str, Any] = {}
    peaks: dict[str, Any] = {}
    with kernel_profile() if counting else contextlib.nullcontext():
        rows = _rows(args, device, steps, sizes, wanted, counting, kernels, peaks)
    dev = device.type
    # with every contender recomputing its blocks in backward the metrics are another comparison: named apart
    suffix = "_recompute_factors" if args.recompute_factors else "_recompute" if args.recompute else ""
    config = {"device": torch.cuda.get_device_name(device) if dev == "cuda" else dev, "steps": steps,
              "batch_sizes": sizes, "smoke": args.smoke, "seq_len": SMOKE_SEQ_LEN if args.smoke else SEQ_LEN,
              "adamw": ADAMW, "bf16": "torch.autocast over fp32 master weights",
              "modes": "eager; graph = whole step in one CUDA graph (bench/graphed.py); compiled = loss through "
                       f"torch.compile(backend={args.compile_backend!r}); metrics: best mode each",
              "modes_run": sorted({r["mode"] for r in rows}),
              "target": {k + suffix: v for k, v in (
                  (f"speedup_vs_dense_b32_{dev}_fp32", 2.0), (f"speedup_vs_dense_b32_{dev}_bf16", 1.5),
                  (f"speedup_vs_galore_b1_{dev}", 2.0), (f"memory_ratio_galore_over_comera_b1_{dev}", 9.0))},
              "recompute": args.recompute or args.recompute_factors, "recompute_factors": args.recompute_factors,
              # --profile: per row at the largest batch, its step's kernels' time by kind
              "kernel_time": kernels,
              # --peak-allocations: per eager row at the smallest batch, the blocks live at its step's peak by
              # the line that allocated them (bench.peak_allocations; CUDA's allocator history, the CPU's profiler)
              "peak_allocations": peaks,
              # cuBLAS sizes its per-stream workspaces from these when it makes them (unset: torch's
              # default, 65 MiB per stream on the H200); they apply to every contender of the run alike
              "cublas_workspace_env": {k: os.environ.get(k) for k in CUBLAS_WORKSPACE_ENV},
              # which products go to cuBLASLt, whose workspace is its own (gpu_check's -nolt step)
              "cublaslt_env": {k: os.environ.get(k) for k in CUBLASLT_ENV},
              # CoMERA's grouped factors padded to a middle rank that is a multiple of this (COMERA_RANK_ALIGN)
              "rank_align": dispatch.aligned_rank(1),
              # CoMERA's TT FFN: fused, its (T, F) middle remade in backward (auto; one block on a GPU), or off
              "ffn_rows": dispatch.ffn_setting(),
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    metrics = {k + suffix: v for k, v in metrics_of(rows, sizes, dev).items()}
    write_result(args.json, "six-encoder", metrics, rows, config, argv=argv)
    return 0

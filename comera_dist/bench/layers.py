"""Layer benchmark: TTLinear vs nn.Linear and the pair TTM lookup vs the per-core chain (fwd+bwd).

``python -m comera_dist.bench layers --json PATH``. Contenders run side by side in one process,
interleaved rep by rep (A, B, A, B, ...) so that load from other processes hits both alike; a
speedup is the median of the per-rep time ratios. FLOPs are counted by
``torch.utils.flop_counter.FlopCounterMode`` on one real forward+backward; memory is the bytes of
the distinct tensors autograd saves for backward (``saved_tensors_hooks``), parameters and
inputs excluded: the activation memory a training step holds between forward and backward.

The allocator matters on CPU: glibc returns big blocks to the OS, so every fresh 50 MB output
page-faults again. ``--malloc-tune`` keeps them (``mallopt``, what jemalloc/tcmalloc do by default);
the JSON records which setting each number used.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from comera_dist.bench.common import base_parser, counts, write_result
from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.tensor import contract

PAPER_EMB = {"row_modes": [16, 20, 10, 10], "col_modes": [4, 4, 8, 6], "max_rank": 32}


def paired(fn_a: Callable[[], Any], fn_b: Callable[[], Any], reps: int, warmup: int = 2) -> dict[str, float]:
    """Interleaved timing of two contenders; returns their median times and the median ratio a/b."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb = [], []
    for _ in range(reps):
        for fn, acc in ((fn_a, ta), (fn_b, tb)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return {"a_median_s": statistics.median(ta), "b_median_s": statistics.median(tb),
            "a_min_s": min(ta), "b_min_s": min(tb),
            "ratio_median": statistics.median(a / b for a, b in zip(ta, tb))}


def fwd_bwd_cost(fn: Callable[[], torch.Tensor], grad: torch.Tensor, exclude: list[torch.Tensor]) -> dict[str, int]:
    """FLOPs of forward and backward, and saved-activation bytes, of one real step."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    with FlopCounterMode(display=False) as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    with FlopCounterMode(display=False) as bwd:
        y.backward(grad)
    return {"fwd_flops": fwd.get_total_flops(), "bwd_flops": bwd.get_total_flops(),
            "saved_bytes": sum(b for k, b in seen.items() if k not in skip)}


def bench_linear(n_in: int, n_out: int, tokens: int, rank: int, reps: int) -> dict[str, Any]:
    """TTLinear (auto order) vs nn.Linear, fp32 forward+backward with input gradient."""
    torch.manual_seed(0)
    tt, dense = TTLinear(n_in, n_out, max_rank=rank), nn.Linear(n_in, n_out)
    x = torch.randn(tokens, n_in, requires_grad=True)  # (T, N_in)
    g = torch.randn(tokens, n_out)  # (T, N_out) upstream gradient

    def step(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).backward(g)
        return run

    t = paired(step(tt), step(dense), reps)
    c_tt = fwd_bwd_cost(lambda: tt(x), g, [x, *tt.parameters()])
    c_d = fwd_bwd_cost(lambda: dense(x), g, [x, *dense.parameters()])
    flops_tt, flops_d = c_tt["fwd_flops"] + c_tt["bwd_flops"], c_d["fwd_flops"] + c_d["bwd_flops"]
    return {
        "case": f"tt_linear {n_in}x{n_out} r={rank} T={tokens}", "order": tt.chosen_order(tokens),
        "contender_s": t["a_median_s"], "baseline_s": t["b_median_s"], "speedup": 1 / t["ratio_median"],
        "contender_gflop": flops_tt / 1e9, "baseline_gflop": flops_d / 1e9, "flop_ratio": flops_d / flops_tt,
        "contender_gflops_per_s": flops_tt / t["a_median_s"] / 1e9, "baseline_gflops_per_s": flops_d / t["b_median_s"] / 1e9,
        "contender_saved_mb": c_tt["saved_bytes"] / 2**20, "baseline_saved_mb": c_d["saved_bytes"] / 2**20,
    }


def bench_lookup(tokens: int, reps: int, ids_kind: str) -> dict[str, Any]:
    """TTEmbedding forward (pair halves + dedup, via dispatch) vs the per-core chain, fwd+bwd."""
    torch.manual_seed(0)
    emb = TTEmbedding(30522, 768, **PAPER_EMB)
    if ids_kind == "uniform":
        ids = torch.randint(0, 30522, (tokens,))
    else:  # Zipf(1.1)-like ranks, as in natural text: many repeats that dedup skips
        p = 1.0 / torch.arange(1, 30523, dtype=torch.float64) ** 1.1
        ids = torch.multinomial(p / p.sum(), tokens, replacement=True)
    g = torch.randn(tokens, 768)

    def opt() -> torch.Tensor:
        return emb(ids)

    def naive() -> torch.Tensor:
        return contract.ttm_lookup_naive(ids, emb.core_list(), emb.masked_gates())

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            emb.zero_grad(set_to_none=True)
            fn().backward(g)
        return run

    t = paired(step(opt), step(naive), reps)
    c_o = fwd_bwd_cost(opt, g, list(emb.parameters()))
    c_n = fwd_bwd_cost(naive, g, list(emb.parameters()))
    fo, fn_ = c_o["fwd_flops"] + c_o["bwd_flops"], c_n["fwd_flops"] + c_n["bwd_flops"]
    return {
        "case": f"ttm_lookup 30522x768 T={tokens} ids={ids_kind} unique={int(torch.unique(ids).numel())}",
        "order": "pairs+dedup",
        "contender_s": t["a_median_s"], "baseline_s": t["b_median_s"], "speedup": 1 / t["ratio_median"],
        "contender_gflop": fo / 1e9, "baseline_gflop": fn_ / 1e9, "flop_ratio": fn_ / fo,
        "contender_gflops_per_s": fo / t["a_median_s"] / 1e9, "baseline_gflops_per_s": fn_ / t["b_median_s"] / 1e9,
        "contender_saved_mb": c_o["saved_bytes"] / 2**20, "baseline_saved_mb": c_n["saved_bytes"] / 2**20,
    }


def malloc_tune() -> bool:
    """Keep large freed blocks in the heap (glibc ``mallopt``); False where unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def main(argv: list[str]) -> int:
    p = base_parser("layers", __doc__.splitlines()[0])
    p.add_argument("--malloc-tune", action="store_true",
                   help="also measure with glibc keeping freed blocks (no page faults on fresh outputs)")
    args = p.parse_args(argv)
    reps, tokens = counts(p, args, steps=7, batch=4096)
    load_start = os.getloadavg()  # the machine is shared: record how busy it was
    rows: list[dict[str, Any]] = []
    settings = [("default", None)] + ([("malloc_tuned", malloc_tune)] if args.malloc_tune else [])
    metrics: dict[str, Any] = {}
    for label, setup in settings:
        if setup is not None and not setup():
            print(f"{label}: mallopt unavailable, skipped")
            continue
        lin = bench_linear(768, 3072, tokens, 30, reps)
        small = bench_linear(768, 768, tokens, 30, reps)
        look = bench_lookup(tokens, reps, "uniform")
        zipf = bench_lookup(tokens, reps, "zipf")
        for r in (lin, small, look, zipf):
            r["allocator"] = label
            rows.append(r)
        sfx = "" if label == "default" else f"_{label}"
        metrics.update({
            f"tt_linear_speedup_vs_dense{sfx}": lin["speedup"],
            f"tt_linear_flop_ratio_vs_dense{sfx}": lin["flop_ratio"],
            f"tt_linear_gflop{sfx}": lin["contender_gflop"], f"dense_linear_gflop{sfx}": lin["baseline_gflop"],
            f"tt_linear_saved_mb{sfx}": lin["contender_saved_mb"], f"dense_linear_saved_mb{sfx}": lin["baseline_saved_mb"],
            f"tt_linear_768x768_speedup_vs_dense{sfx}": small["speedup"],
            f"ttm_lookup_speedup_vs_naive{sfx}": look["speedup"],
            f"ttm_lookup_memory_ratio_vs_naive{sfx}": look["baseline_saved_mb"] / look["contender_saved_mb"],
            f"ttm_lookup_gflop{sfx}": look["contender_gflop"], f"ttm_naive_gflop{sfx}": look["baseline_gflop"],
            f"ttm_lookup_saved_mb{sfx}": look["contender_saved_mb"], f"ttm_naive_saved_mb{sfx}": look["baseline_saved_mb"],
            f"ttm_lookup_zipf_speedup_vs_naive{sfx}": zipf["speedup"],
        })
    config = {"tokens": tokens, "reps": reps, "dtype": "float32", "rank": 30, "embedding": PAPER_EMB,
              "timing": "interleaved pairs, speedup = median of per-rep ratios",
              "memory": "bytes autograd saves for backward, parameters and inputs excluded",
              "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    write_result(args.json, "layers", metrics, rows, config, argv=argv)
    return 0

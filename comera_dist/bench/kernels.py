"""``python -m comera_dist.bench kernels``: fused Triton kernels vs the unfused torch path vs dense.

Two ops at the paper's shapes (six-encoder, r = 30; the 30522 x 768 TTM word embedding), 4,096 to
32,768 tokens, fp32 and bf16, forward and forward+backward:

- TT linear ``(x L) R + b``: ``fused`` (``comera::tt_linear``), ``torch`` (two matmuls, the
  reference) and ``dense`` (``F.linear`` with the full weight). L and R are built once from TT
  cores outside the timed region: that build costs the same at any batch size and both TT paths
  share it.
- TTM lookup, timed from the cores (the pair contraction is part of every step): ``fused``
  (pair contraction + ``comera::ttm_lookup``), ``pairs`` (pair contraction + the torch reference),
  ``naive`` (the per-core chain, the paper's baseline) and ``dense`` (``F.embedding`` on a full table).

Each row reports model FLOP/s and bytes/s (the op's algorithmic FLOPs and minimum traffic divided
by the measured time) and the fraction of the roofline ``max(flops/peak, bytes/bandwidth)`` it
reaches. The peaks are measured in the same run (a large matmul per dtype, a large copy), never
assumed. Without CUDA it refuses (exit 2) unless ``--allow-cpu``, which runs tiny shapes through
the Triton interpreter as a smoke test; its timings mean nothing.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from comera_dist.bench.common import base_parser, counts, time_fn, write_result
from comera_dist.tensor import contract
from comera_dist.tensor.factorize import tt_ranks
from comera_dist.tensor.tt import tt_init
from comera_dist.tensor.ttm import ttm_init

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (name, in_modes, out_modes): the six-encoder's TT layers (comera-method.md section 6).
PAPER_LINEAR = [("768x768", [12, 8, 8], [8, 8, 12]), ("768x3072", [12, 8, 8], [12, 16, 16]),
                ("3072x768", [16, 16, 12], [8, 8, 12])]
PAPER_EMBEDDING = ("30522x768", 30522, [16, 20, 10, 10], [4, 4, 8, 6])
TINY_LINEAR = [("24x40", [4, 6], [5, 8])]
TINY_EMBEDDING = ("60x24", 60, [8, 8], [4, 6])


def measure_peaks(device: torch.device, dtypes: list[torch.dtype], *, big: bool) -> dict[str, float]:
    """Peak matmul FLOP/s per dtype and copy bandwidth, measured now on ``device``."""
    n = 8192 if big else 256
    peaks: dict[str, float] = {}
    for dtype in dtypes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = time_fn(lambda a=a, b=b: a @ b, warmup=2, reps=5)["min_s"]
        peaks[f"peak_flops_per_s_{_short(dtype)}"] = 2 * n**3 / t
    src = torch.empty(((1 << 30) if big else (1 << 24)) // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=2, reps=5)["min_s"]
    peaks["peak_bytes_per_s"] = 2 * src.numel() * 4 / t  # one read + one write
    return peaks


def bench_tt_linear(name: str, in_modes: list[int], out_modes: list[int], tokens: int, dtype: torch.dtype,
                    device: torch.device, reps: int) -> list[dict[str, Any]]:
    """Rows for one layer shape: fused / torch / dense, fwd and fwd+bwd."""
    from comera_dist.kernels import ops

    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    ranks = tt_ranks(in_modes + out_modes, 30)
    d = len(in_modes)
    gen = torch.Generator().manual_seed(0)
    cores = tt_init(in_modes, out_modes, ranks, (1.0 / (n_in + n_out)) ** 0.5, generator=gen)
    L = contract.contract_left(cores[:d], None).to(device, dtype)  # (N_in, r)
    R = contract.contract_right(cores[d:], None).to(device, dtype)  # (r, N_out)
    rank = R.shape[0]
    W = (L.float() @ R.float()).T.contiguous().to(dtype)  # (N_out, N_in) the same weight, dense
    bias = torch.zeros(n_out, device=device, dtype=dtype)
    x = torch.randn(tokens, n_in, device=device, dtype=dtype)  # (T, N_in)
    es = x.element_size()
    tt_flops, dense_flops = 2 * tokens * rank * (n_in + n_out), 2 * tokens * n_in * n_out
    act_bytes = es * tokens * (n_in + n_out)
    contenders: dict[str, tuple[Callable[..., Tensor], list[Tensor], int, int]] = {
        "fused": (ops.tt_linear, [x, L, R, bias], tt_flops, es * (n_in + n_out) * rank),
        "torch": (contract.tt_linear_lr, [x, L, R, bias], tt_flops, es * (n_in + n_out) * rank),
        "dense": (lambda x_, w_, b_: F.linear(x_, w_, b_), [x, W, bias], dense_flops, es * n_in * n_out),
    }
    rows = []
    for impl, (fn, args, flops, param_bytes) in contenders.items():
        # fwd reads X, writes Y; bwd also reads dY and X, writes dX: 3 flops-multiples, 2.5x traffic.
        for pass_, mult, traffic in (("fwd", 1, act_bytes + param_bytes),
                                     ("fwd+bwd", 3, act_bytes + es * tokens * (n_out + 2 * n_in) + 3 * param_bytes)):
            t = _time_pass(fn, args, backward=pass_ != "fwd", reps=reps)
            rows.append(_row("tt_linear", name, tokens, dtype, pass_, impl, t, mult * flops, traffic))
    return rows


def bench_lookup(name: str, vocab: int, row_modes: list[int], col_modes: list[int], tokens: int,
                 dtype: torch.dtype, device: torch.device, reps: int) -> list[dict[str, Any]]:
    """Rows for the TTM embedding: fused / pairs / naive / dense, fwd and fwd+bwd, from the cores."""
    from comera_dist.kernels import ops

    ranks = tt_ranks([m * n for m, n in zip(row_modes, col_modes)], 32)
    gen = torch.Generator().manual_seed(0)
    cores = [c.to(device, dtype) for c in ttm_init(row_modes, col_modes, ranks, 1.0, generator=gen)]
    ids = zipf_ids(tokens, vocab, gen).to(device)  # (T,)
    n_out = math.prod(col_modes)
    table = torch.randn(vocab, n_out, device=device, dtype=dtype)  # (V, N) for the dense contender
    A, B = contract.ttm_pair_contract(cores, None)
    N1, rank = A.shape[1], A.shape[2]
    N2 = B.shape[2]
    uniq = int(torch.unique(ids).numel())
    es = A.element_size()
    flops = 2 * uniq * N1 * rank * N2  # one (N1 x r)(r x N2) per distinct id
    traffic = es * (tokens * n_out + uniq * rank * (N1 + N2)) + 8 * tokens

    def fused(ids_, *cs):
        return ops.ttm_lookup(ids_, *contract.ttm_pair_contract(list(cs), None))

    def pairs(ids_, *cs):
        return contract.ttm_lookup_pairs(ids_, *contract.ttm_pair_contract(list(cs), None))

    contenders = {"fused": (fused, [ids, *cores]), "pairs": (pairs, [ids, *cores]),
                  "naive": (lambda ids_, *cs: contract.ttm_lookup_naive(ids_, list(cs), None), [ids, *cores]),
                  "dense": (lambda ids_, t_: F.embedding(ids_, t_), [ids, table])}
    rows = []
    for impl, (fn, args) in contenders.items():
        for pass_, mult, extra in (("fwd", 1, 0), ("fwd+bwd", 3, es * (tokens * n_out + uniq * rank * (N1 + N2)))):
            t = _time_pass(fn, args, backward=pass_ != "fwd", reps=reps)
            rows.append(_row("ttm_lookup", name, tokens, dtype, pass_, impl, t, mult * flops, traffic + extra,
                             unique_ids=uniq))
    return rows


def zipf_ids(tokens: int, vocab: int, gen: torch.Generator) -> Tensor:
    """Token ids with a Zipf(1) frequency law over a shuffled vocabulary, like natural text."""
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)  # (V,)
    ranks = torch.multinomial(p, tokens, replacement=True, generator=gen)  # (T,)
    return torch.randperm(vocab, generator=gen)[ranks]  # (T,)


def _time_pass(fn: Callable[..., Tensor], args: list[Tensor], *, backward: bool, reps: int) -> float:
    if not backward:
        with torch.no_grad():
            return time_fn(lambda: fn(*args), warmup=3, reps=reps)["median_s"]
    leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    probe = fn(*leaves)
    grad = torch.randn_like(probe)

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves).backward(grad)

    return time_fn(step, warmup=3, reps=reps)["median_s"]


def _row(op: str, shape: str, tokens: int, dtype: torch.dtype, pass_: str, impl: str, seconds: float,
         flops: int, traffic: int, unique_ids: int | None = None) -> dict[str, Any]:
    return {"op": op, "shape": shape, "tokens": tokens, "unique_ids": unique_ids, "dtype": _short(dtype),
            "pass": pass_, "impl": impl, "ms": seconds * 1e3, "tflop_per_s": flops / seconds / 1e12,
            "gb_per_s": traffic / seconds / 1e9, "model_flops": flops, "model_bytes": traffic}


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def add_roofline(rows: list[dict[str, Any]], peaks: dict[str, float]) -> None:
    """``roofline_frac`` = the roofline time of the row's model work / its measured time."""
    for r in rows:
        ideal = max(r["model_flops"] / peaks[f"peak_flops_per_s_{r['dtype']}"], r["model_bytes"] / peaks["peak_bytes_per_s"])
        r["roofline_frac"] = ideal / (r["ms"] / 1e3)


def speedups(rows: list[dict[str, Any]], op: str, fast: str, slow: str, pass_: str) -> list[float]:
    """``time(slow) / time(fast)`` for every (shape, tokens, dtype) case of ``op`` and ``pass_``."""
    times = {(r["shape"], r["tokens"], r["dtype"], r["impl"]): r["ms"] for r in rows
             if r["op"] == op and r["pass"] == pass_}
    return [times[(*k[:3], slow)] / t for k, t in times.items() if k[3] == fast]


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str]) -> int:
    p = base_parser("kernels", __doc__.splitlines()[0])
    p.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run tiny shapes in the Triton interpreter (a smoke test, not a benchmark)")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts (default 4096 8192 16384 32768)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default: float32 bfloat16")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    # --batch-size, when given, is the only token count (below); batch=1 stands in for --tokens' default
    reps, _ = counts(p, args, steps=20 if on_gpu else 1, batch=1)
    if not on_gpu:
        if not args.allow_cpu:
            print("kernels benchmark: no CUDA device; the fused Triton kernels are benchmarked on a GPU. "
                  "Pass --allow-cpu for a tiny smoke run in the Triton interpreter.", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import below
        from comera_dist.kernels.launch import INTERPRET
        if not INTERPRET:
            print("kernels benchmark: --allow-cpu needs TRITON_INTERPRET=1 before triton is imported",
                  file=sys.stderr)
            return 2
    device = torch.device("cuda" if on_gpu else "cpu")
    tokens = [args.batch_size] if args.batch_size is not None else args.tokens or (
        [4096, 8192, 16384, 32768] if on_gpu else [48])
    dtypes = [DTYPES[d] for d in (args.dtypes or (["float32", "bfloat16"] if on_gpu else ["float32"]))]
    linear, embedding = (PAPER_LINEAR, PAPER_EMBEDDING) if on_gpu else (TINY_LINEAR, TINY_EMBEDDING)

    peaks = measure_peaks(device, dtypes, big=on_gpu)
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for t in tokens:
            for name, in_modes, out_modes in linear:
                rows += bench_tt_linear(name, in_modes, out_modes, t, dtype, device, reps)
            rows += bench_lookup(*embedding, t, dtype, device, reps)
    add_roofline(rows, peaks)

    lin, lin_fwd = (speedups(rows, "tt_linear", "fused", "torch", s) for s in ("fwd+bwd", "fwd"))
    look, look_fwd = (speedups(rows, "ttm_lookup", "fused", "naive", s) for s in ("fwd+bwd", "fwd"))
    metrics = {
        "fused_tt_linear_speedup_vs_torch": _geomean(lin),
        "fused_tt_linear_speedup_vs_torch_fwd": _geomean(lin_fwd),
        "fused_tt_linear_speedup_vs_torch_min": min(lin),
        "fused_tt_linear_speedup_vs_dense": _geomean(speedups(rows, "tt_linear", "fused", "dense", "fwd+bwd")),
        "fused_lookup_speedup_vs_naive": _geomean(look),
        "fused_lookup_speedup_vs_naive_fwd": _geomean(look_fwd),
        "fused_lookup_speedup_vs_naive_min": min(look),
        "fused_lookup_speedup_vs_pairs": _geomean(speedups(rows, "ttm_lookup", "fused", "pairs", "fwd+bwd")),
        **peaks,
    }
    config = {"device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter; timings meaningless)",
              "tokens": tokens, "dtypes": [_short(d) for d in dtypes], "reps": reps, "rank": 30,
              "speedups": "geometric means over shapes x tokens x dtypes of fwd+bwd time ratios unless suffixed",
              "targets_h100": {"fused_tt_linear_speedup_vs_torch": 1.5, "fused_lookup_speedup_vs_naive": 5.0},
              "ids": "Zipf(1) over a shuffled vocabulary"}
    write_result(args.json, "kernels", metrics, rows, config, argv=argv)
    return 0

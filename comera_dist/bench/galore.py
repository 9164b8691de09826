"""``python -m comera_dist.bench galore``: six-encoder at batch 1, dense+AdamW vs dense+GaLoreAdamW vs CoMERA.

Each contender runs in its own fresh interpreter (``memory-probe``), one after the other, in
this one run: the first step is measured for tensor memory (parameters + gradients +
optimizer state + peak saved activations), then ``--steps`` steps are timed, and the process's
peak RSS above its post-import baseline is read from the kernel; one more step gives the peak of
the tensors alive at once (``memory_probe.step_peak_bytes``, temporaries and gradients included).
``--recompute`` runs every contender with ``model.activation_checkpointing``: the saved-tensor
accounting cannot see the blocks recomputed in backward, so its memory ratios are then the peaks'.
``--recompute-factors`` does that too, and each recomputed block also remakes its TT factors
(``model.recompute_factors``; GaLore and dense have none, so they run as with ``--recompute``).

GaLore (``galore_torch.GaLoreAdamW``) uses its recommended settings: rank 128,
``update_proj_gap`` 200, scale 0.25, ``proj_type`` std, on every 2-D weight with both sides
above the rank (``six_encoder.galore_optimizer``). Its first step computes the projections
(one SVD per matrix, repeated every 200 steps); the metric uses the steady-state step and the
table also shows the step time with that SVD amortized over 200 steps.
"""

from __future__ import annotations

import os
from typing import Any

from comera_dist.bench.common import base_parser, counts, workload_options, write_result
from comera_dist.bench.memory_probe import run_probe
from comera_dist.bench.six_encoder import GALORE
from comera_dist.metrics.progress import terminal_progress

ORDER = ("dense", "galore", "comera")


def main(argv: list[str]) -> int:
    p = base_parser("galore", "six-encoder batch 1: dense AdamW vs GaLoreAdamW vs CoMERA, time and memory")
    workload_options(p, threads_help="torch.set_num_threads in each worker")
    p.add_argument("--recompute", action="store_true",
                   help="every contender recomputes each block's activations in backward "
                        "(model.activation_checkpointing); metrics end in _recompute, memory ratios from the peak")
    p.add_argument("--recompute-factors", action="store_true",
                   help="as --recompute, and CoMERA's recomputed blocks also remake their TT factors L/R "
                        "(model.recompute_factors); metrics end in _recompute_factors")
    args = p.parse_args(argv)
    recompute = args.recompute or args.recompute_factors
    steps, batch = counts(p, args, steps=5, batch=1)
    load_start = os.getloadavg()
    results = {name: run_probe(workload="six-encoder", contender=name, batch_size=batch, steps=steps,
                               smoke=args.smoke, threads=args.threads, profile=True, recompute=recompute,
                               recompute_factors=args.recompute_factors and name == "comera")
               for name in terminal_progress(ORDER, desc="galore", unit="contender")}
    rows: list[dict[str, Any]] = []
    gap = GALORE["update_proj_gap"]
    for name in ORDER:
        r, tm = results[name], results[name]["tensor_memory"]
        amortized = r["step_s"] + max(r["first_step_s"] - r["step_s"], 0.0) / gap if name == "galore" else r["step_s"]
        rows.append({"contender": name, "batch": batch, "step_s": r["step_s"], "step_s_svd_amortized": amortized,
                     "first_step_s": r["first_step_s"], "params_MiB": tm["params_bytes"] / 2**20,
                     "grads_MiB": tm["grads_bytes"] / 2**20, "optimizer_MiB": tm["optimizer_bytes"] / 2**20,
                     "activations_MiB": tm["activations_bytes"] / 2**20, "tensor_MiB": tm["total_bytes"] / 2**20,
                     "peak_MiB": r["step_peak_bytes"] / 2**20,
                     "rss_above_baseline_MiB": r["rss_peak_above_baseline_bytes"] / 2**20,
                     "recompute_factors": r["recompute_factors"]})  # as the probe ran it
    by = {r["contender"]: r for r in rows}
    b = batch
    metrics = {
        f"speedup_vs_galore_b{b}": by["galore"]["step_s"] / by["comera"]["step_s"],
        f"speedup_vs_galore_amortized_b{b}": by["galore"]["step_s_svd_amortized"] / by["comera"]["step_s"],
        f"speedup_vs_dense_b{b}": by["dense"]["step_s"] / by["comera"]["step_s"],
        f"peak_ratio_galore_over_comera_b{b}": by["galore"]["peak_MiB"] / by["comera"]["peak_MiB"],
        f"peak_ratio_dense_over_comera_b{b}": by["dense"]["peak_MiB"] / by["comera"]["peak_MiB"],
        f"rss_ratio_galore_over_comera_b{b}": by["galore"]["rss_above_baseline_MiB"] / by["comera"]["rss_above_baseline_MiB"],
    }
    target = {"speedup_vs_galore_b1": 6.0}
    if recompute:
        # the saved-tensor accounting cannot see a block recomputed in backward: only the peak compares
        suffix = "_recompute_factors" if args.recompute_factors else "_recompute"
        metrics = {f"{k}{suffix}": v for k, v in metrics.items()}
        target = {f"speedup_vs_galore_b1{suffix}": 6.0, f"peak_ratio_galore_over_comera_b1{suffix}": 10.0}
    else:
        metrics |= {f"memory_ratio_galore_over_comera_b{b}": by["galore"]["tensor_MiB"] / by["comera"]["tensor_MiB"],
                    f"memory_ratio_dense_over_comera_b{b}": by["dense"]["tensor_MiB"] / by["comera"]["tensor_MiB"]}
        target["memory_ratio_galore_over_comera_b1"] = 10.0
    config = {"steps": steps, "batch_size": batch, "smoke": args.smoke, "galore": results["galore"]["extra"],
              "threads": results["comera"]["threads"], "profile": {n: results[n]["profile"] for n in ORDER}, "process_per_contender": True,
              "target": target, "recompute": recompute, "recompute_factors": args.recompute_factors,
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    write_result(args.json, "galore", metrics, rows, config, argv=argv)
    return 0

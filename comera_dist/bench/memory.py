"""``python -m comera_dist.bench memory``: dense vs CoMERA six-encoder at batch 32, memory split by role.

Each contender runs in its own fresh interpreter (``memory-probe``): one measured step gives
parameters, gradients, optimizer state and the peak of saved activations (tensor bytes, see
``memory_probe``), and the process's peak RSS above its post-import baseline.
"""

from __future__ import annotations

import os
from typing import Any

from comera_dist.bench.common import base_parser, counts, workload_options, write_result
from comera_dist.bench.memory_probe import run_probe

ROLES = ("params", "grads", "optimizer", "activations", "total")


def main(argv: list[str]) -> int:
    p = base_parser("memory", "six-encoder memory by role (params, grads, optimizer, activations), dense vs CoMERA")
    workload_options(p, threads_help="torch.set_num_threads in each worker")
    args = p.parse_args(argv)
    steps, batch = counts(p, args, steps=1, batch=32)
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    threads = None
    for name in ("dense", "comera"):
        r = run_probe(workload="six-encoder", contender=name, batch_size=batch, steps=steps, smoke=args.smoke,
                      threads=args.threads)
        tm, threads = r["tensor_memory"], r["threads"]
        rows.append({"contender": name, "batch": batch,
                     **{f"{role}_MiB": tm[f"{role}_bytes"] / 2**20 for role in ROLES},
                     "rss_above_baseline_MiB": r["rss_peak_above_baseline_bytes"] / 2**20, "step_s": r["step_s"]})
    by = {r["contender"]: r for r in rows}
    metrics = {f"{role}_ratio_dense_over_comera_b{batch}": by["dense"][f"{role}_MiB"] / by["comera"][f"{role}_MiB"]
               for role in ROLES}
    metrics[f"rss_ratio_dense_over_comera_b{batch}"] = (by["dense"]["rss_above_baseline_MiB"]
                                                        / by["comera"]["rss_above_baseline_MiB"])
    for name in ("dense", "comera"):
        metrics[f"{name}_activations_MiB_b{batch}"] = by[name]["activations_MiB"]
    config = {"steps": steps, "batch_size": batch, "smoke": args.smoke, "process_per_contender": True, "threads": threads,
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    write_result(args.json, "memory", metrics, rows, config, argv=argv)
    return 0

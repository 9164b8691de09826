"""``python -m comera_dist.bench prune-payoff``: does physical pruning pay off in step time as in FLOPs?

Two identical CoMERA six-encoders (same seed) get the same dead ranks: on every interior bond
a random ``1 - keep`` fraction of the gates is set to 0 (below ``tau``), standing in for the
ranks rank adaptation switches off (which ranks die does not change the cost). One model keeps
computing with the masked full-size cores; the other is physically pruned with
``compression.pruning.make_plan`` + ``apply_plan`` (AdamW moments sliced along). The two are
then timed alternately, step by step, so that load drift on a shared machine hits both alike.

FLOPs of one training step (forward + backward) are counted by ``FlopCounterMode`` on each
model, never modelled: ``step_time_ratio_over_flop_ratio = (t_after / t_before) / (F_after /
F_before)``; 1.0 means time falls exactly with FLOPs (target: within 20%).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from comera_dist.bench.common import base_parser, counts, workload_options, write_result
from comera_dist.bench.six_encoder import Contender, make_contender, random_batch, top_ops
from comera_dist.compression.accounting import compression_report
from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.compression.walk import tensorized_modules


def kill_ranks(c: Contender, keep: float | tuple[float, float], seed: int = 0) -> None:
    """Set a random ``1 - keep`` fraction of every bond's gates to 0 (at least one rank survives).

    ``keep``: one fraction for every bond, or a ``(low, high)`` range from which each bond of each
    layer draws its own (the layers of a shape class then end with different ranks, as training
    leaves them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in tensorized_modules(c.model):
            for gate in layer.gates:
                n = gate.numel()
                share = keep if isinstance(keep, float) else \
                    keep[0] + (keep[1] - keep[0]) * float(torch.rand((), generator=gen))
                dead = torch.randperm(n, generator=gen)[: n - max(1, round(share * n))]  # (n_dead,)
                gate[dead] = 0.0


def step_flops(c: Contender, batch: dict[str, torch.Tensor]) -> int:
    """FLOPs of forward + backward of one step, counted by ``FlopCounterMode``."""
    with FlopCounterMode(display=False) as counter:
        c.loss(batch).backward()
    c.optimizer.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def physical_tt_flops(model: torch.nn.Module) -> int:
    """Per-token forward FLOPs of the TT layers at their physical (allocated) ranks."""
    return sum(int(layer.flops_per_token(active=False)) for _, layer in tensorized_modules(model))


def main(argv: list[str]) -> int:
    p = base_parser("prune-payoff", "CoMERA step time before/after physical pruning vs the FLOP ratio")
    workload_options(p)
    p.add_argument("--keep", type=float, default=0.5, help="fraction of each bond's ranks that survives")
    args = p.parse_args(argv)
    steps, batch_size = counts(p, args, steps=3, batch=32)
    if not 0 < args.keep <= 1:
        p.error(f"--keep must be in (0, 1], got {args.keep}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    masked, pruned = (make_contender("comera", smoke=args.smoke) for _ in range(2))
    for c in (masked, pruned):
        kill_ranks(c, args.keep)
    batch = random_batch(masked.model, batch_size, smoke=args.smoke)
    masked.step(batch)  # AdamW state exists before the prune, as in training
    pruned.step(batch)
    plan = make_plan(pruned.model)
    apply_plan(pruned.model, plan, pruned.optimizer)
    flops = {"masked": step_flops(masked, batch), "pruned": step_flops(pruned, batch)}
    reports = {"masked": compression_report(masked.model), "pruned": compression_report(pruned.model)}
    times: dict[str, list[float]] = {"masked": [], "pruned": []}
    for c in (masked, pruned):  # warm-up after the prune (new shapes)
        c.step(batch)
    for _ in range(steps):
        for name, c in (("masked", masked), ("pruned", pruned)):
            t0 = time.perf_counter()
            c.step(batch)
            times[name].append(time.perf_counter() - t0)
    models = {"masked": masked.model, "pruned": pruned.model}
    profiles = {name: top_ops(lambda c=c: c.step(batch)) for name, c in (("masked", masked), ("pruned", pruned))}
    rows: list[dict[str, Any]] = []
    for name in ("masked", "pruned"):
        rows.append({"model": name, "batch": batch_size, "step_s": statistics.median(times[name]),
                     "step_min_s": min(times[name]), "step_gflop": flops[name] / 1e9,
                     "physical_tt_params": reports[name]["physical_size"],
                     "tt_flops_per_token": physical_tt_flops(models[name])})
    time_ratio = rows[1]["step_s"] / rows[0]["step_s"]
    flop_ratio = flops["pruned"] / flops["masked"]
    metrics = {"step_time_ratio_over_flop_ratio": time_ratio / flop_ratio, "step_time_ratio": time_ratio,
               "flop_ratio": flop_ratio,
               "tt_flop_ratio": rows[1]["tt_flops_per_token"] / rows[0]["tt_flops_per_token"]}
    config = {"steps": steps, "batch_size": batch_size, "keep": args.keep, "smoke": args.smoke,
              "bonds_pruned": sum(len(b) for b in plan.kept.values()), "threads": torch.get_num_threads(),
              "profile": profiles, "target": {"step_time_ratio_over_flop_ratio": [0.8, 1.2]},
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    write_result(args.json, "prune-payoff", metrics, rows, config, argv=argv)
    return 0

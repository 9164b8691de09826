"""``python -m comera_dist.bench six-encoder``: the paper's six-encoder, dense vs CoMERA, per batch size.

The workload (also used by ``galore``, ``memory``, ``prune-payoff`` and the ``memory-probe``
worker): the six-encoder classifier of CoMERA section 6 (d=768, 12 heads, FFN 3072, vocab 30522,
sequence length 128), built by ``models.build_model`` from ``presets.six_encoder_paper`` and the
paper's modes (``PAPER_MODES``, TT rank 30, TTM rank 32) exactly as ``configs/six-encoder.yaml``
sets them. One training step = forward + backward + optimizer step on a random batch of token
ids and labels:

- ``dense``: the untensorized model, ``torch.optim.AdamW``;
- ``comera``: the tensorized model, AdamW over the per-role groups of
  ``compression.groups.param_groups``, the loss through ``RankController.objective`` (task loss
  + gamma * rank penalty in the early stage), exactly what the engine back-propagates;
- ``galore``: the dense model with ``galore_torch.GaLoreAdamW`` (see ``galore.py``).

``--smoke`` swaps in a tiny model of the same architecture (CI). Peak memory is the measured
tensor memory of one step (``memory_probe.measure_step``): parameters + gradients + optimizer
state + peak saved activations.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from comera_dist.bench.common import (
    base_parser,
    device_option,
    require_device,
    workload_options,
    write_result,
)
from comera_dist.bench.memory_probe import measure_step
from comera_dist.compression.accounting import model_size
from comera_dist.compression.config import ControllerConfig, LrConfig, TensorizeConfig
from comera_dist.compression.controller import RankController
from comera_dist.compression.groups import param_groups
from comera_dist.compression.penalty import rank_penalty
from comera_dist.kernels import dispatch
from comera_dist.metrics.progress import terminal_progress
from comera_dist.models import build_model
from comera_dist.models.config import ModelConfig
from comera_dist.models.presets import (
    PAPER_EMBEDDING_MAX_RANK,
    PAPER_MAX_RANK,
    PAPER_MODES,
    six_encoder_paper,
)

CONTENDERS = ("dense", "galore", "comera")
MODES = ("eager", "graph", "compiled", "compiled-graph")
"""Step modes of the device comparison (``six_encoder_device``)."""
SEQ_LEN = 128
SMOKE_SEQ_LEN = 16
GALORE = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
"""galore-torch's recommended settings (its README and the paper's pretraining runs)."""
ADAMW = {"fused": True}
"""Both AdamW contenders use the fused implementation (one kernel for all parameters, no
per-parameter host reads of the step count; torch has it for CPU and CUDA)."""


def model_config(*, smoke: bool) -> ModelConfig:
    """The paper's six-encoder (128 positions), or a tiny one of the same architecture."""
    if smoke:
        return ModelConfig(arch="six_encoder_cls", vocab_size=200, hidden_size=48, num_layers=2, num_heads=4,
                           intermediate_size=96, max_positions=SMOKE_SEQ_LEN, num_labels=3)
    return six_encoder_paper(max_positions=SEQ_LEN)


def tensorize_config(*, smoke: bool) -> TensorizeConfig:
    """The paper's tensorization (``configs/six-encoder.yaml``), or automatic modes at rank 4."""
    if smoke:
        return TensorizeConfig(max_rank=4, embedding_max_rank=4)
    return TensorizeConfig(modes=PAPER_MODES, max_rank=PAPER_MAX_RANK, embedding_max_rank=PAPER_EMBEDDING_MAX_RANK)


def random_batch(model: nn.Module, batch_size: int, *, smoke: bool, seed: int = 0) -> dict[str, Tensor]:
    """input_ids (B, T) uniform over the vocabulary, labels (B,), on the model's device."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    seq = SMOKE_SEQ_LEN if smoke else SEQ_LEN
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=gen)  # (B, T)
    labels = torch.randint(0, cfg.num_labels, (batch_size,), generator=gen)  # (B,)
    device = next(model.parameters()).device
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


@dataclass(kw_only=True)
class Contender:
    """A model, its optimizer and the loss the step back-propagates."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[dict[str, Tensor]], Tensor]
    extra: dict[str, Any] = field(default_factory=dict)
    autocast: torch.dtype | None = None
    """``torch.bfloat16``: forward under autocast (bf16 rows of ``--device``); None: plain fp32."""

    def train_step(self, batch: dict[str, Tensor]) -> Tensor:
        """forward + backward + optimizer step; returns the loss, still on the device (no host sync).

        With ``autocast`` set, the forward (and the loss) run under ``torch.autocast`` in that
        dtype over fp32 master weights (mixed precision, as DeepSpeed's bf16 mode trains).
        """
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def step(self, batch: dict[str, Tensor]) -> float:
        """``train_step`` and the loss read back to the host (one sync, after the step)."""
        return float(self.train_step(batch))


def make_contender(name: str, *, smoke: bool, seed: int = 0, device: str | torch.device = "cpu",
                   capturable: bool = False, recompute: bool = False, recompute_factors: bool = False) -> Contender:
    """Build ``dense``, ``galore`` or ``comera`` freshly (same seed, same architecture) on ``device``.

    ``capturable``: the AdamW keeps its step counts on the device, so the whole step can be captured
    in a CUDA graph (``bench.graphed``); GaLore's optimizer cannot be captured. ``recompute``: the
    model recomputes each block's activations in backward (``model.activation_checkpointing``);
    ``recompute_factors`` too, each block also remaking its TT factors there (``model.recompute_factors``)."""
    if name not in CONTENDERS:
        raise ValueError(f"contender must be one of {list(CONTENDERS)}, got {name!r}")
    if capturable and name == "galore":
        raise ValueError("the galore contender cannot be captured (its projections are host-side work)")
    adamw = dict(ADAMW, capturable=True) if capturable else ADAMW
    torch.manual_seed(seed)
    cfg = replace(model_config(smoke=smoke), activation_checkpointing=recompute or recompute_factors,
                  recompute_factors=recompute_factors)
    lr = LrConfig()
    if name == "comera":
        model = build_model(cfg, tensorize_config(smoke=smoke)).to(device)
        opt = torch.optim.AdamW(param_groups(model, lr), weight_decay=lr.weight_decay, **adamw)
        controller = RankController(ControllerConfig())
        # The controller's host inputs (global loss and size) are read once per step, outside the
        # step, as the engine does; the benchmark stays in the early stage, which does not use them.
        host = {"loss": 1.0, "size": model_size(model)}

        def comera_loss(batch: dict[str, Tensor]) -> Tensor:
            out = model(**batch)
            # early stage: task + gamma * R; the model's forward gives R from the masks it already
            # made (the same value as rank_penalty(model), with fewer ops)
            penalty = out.get("rank_penalty")
            return controller.objective(out["loss"], rank_penalty(model) if penalty is None else penalty,
                                        global_loss=host["loss"], global_size=host["size"])

        return Contender(name=name, model=model, optimizer=opt, loss=comera_loss)
    model = build_model(cfg, None).to(device)
    extra: dict[str, Any] = {}
    if name == "dense":
        opt = torch.optim.AdamW(model.parameters(), lr=lr.dense, weight_decay=lr.weight_decay, **adamw)
    else:
        opt, extra = galore_optimizer(model, smoke=smoke, lr=lr.dense)
    return Contender(name=name, model=model, optimizer=opt, loss=lambda batch: model(**batch)["loss"], extra=extra)


def galore_optimizer(model: nn.Module, *, smoke: bool, lr: float) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """GaLoreAdamW at the recommended settings on every 2-D weight whose smaller side exceeds the rank.

    Matrices with a side <= rank (the 128 x 768 position table, the 2 x 768 token types, the
    3 x 768 classifier) gain nothing from a rank-128 projection and stay in plain AdamW groups,
    as in GaLore's own scripts. The 30522 x 768 word table is projected too.
    """
    from galore_torch import GaLoreAdamW

    settings = dict(GALORE, rank=8) if smoke else dict(GALORE)
    low_rank, regular = [], []
    for p in model.parameters():
        (low_rank if p.dim() == 2 and min(p.shape) > settings["rank"] else regular).append(p)
    groups = [{"params": regular}, {"params": low_rank, **settings}]
    extra = {"galore": settings, "galore_params": sum(p.numel() for p in low_rank),
             "adamw_params": sum(p.numel() for p in regular)}
    return GaLoreAdamW(groups, lr=lr, weight_decay=0.0), extra


def time_steps(step: Callable[[dict[str, Tensor]], Tensor], batch: dict[str, Tensor], steps: int) -> dict[str, float]:
    """Median and min wall time of ``steps`` calls of ``step(batch)`` (after the caller's warm-up).

    On a GPU the device is synchronized before each start and after each step, so a time covers
    the step's kernels, not only their launches; the loss stays on the device (no extra sync).
    """
    on_cuda = batch["input_ids"].is_cuda
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def top_ops(fn: Callable[[], Any], n: int = 8) -> list[dict[str, Any]]:
    """Run ``fn()`` once under ``torch.profiler``; the ``n`` ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:n]]


def main(argv: list[str]) -> int:
    p = base_parser("six-encoder", "six-encoder step time and memory, dense vs CoMERA, batch 1/8/32")
    workload_options(p, threads_help="torch.set_num_threads (default: torch's)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--device", type=device_option, default=None,
                   help="run the device comparison (dense, CoMERA, GaLore; fp32 and bf16) on this device, "
                        "e.g. cuda; metrics carry the device type. Default: cuda when a GPU is visible, "
                        "otherwise the CPU dense-vs-CoMERA run")
    device_only = p.add_argument_group("device comparison only (--device)")
    device_only.add_argument("--modes", nargs="+", choices=MODES,
                             help="step modes to run (default: eager, and graph on CUDA). graph: the whole step "
                                  "in one CUDA graph; compiled: the loss through torch.compile(fullgraph=True); "
                                  "compiled-graph: both. GaLore runs eager only; graphs need CUDA")
    device_only.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), help="default: both")
    device_only.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="default: all three")
    device_only.add_argument("--recompute", action="store_true",
                             help="every contender recomputes each block's activations in backward "
                                  "(model.activation_checkpointing); metrics end in _recompute")
    device_only.add_argument("--recompute-factors", action="store_true",
                             help="as --recompute, and each recomputed block also remakes its TT factors L/R "
                                  "(model.recompute_factors); metrics end in _recompute_factors")
    device_only.add_argument("--profile", action="store_true",
                             help="also time each kernel of one step of every row at the largest batch "
                                  "(bench.kernel_time): the row's device_ms, the kinds in config.kernel_time")
    device_only.add_argument("--peak-allocations", action="store_true",
                             help="also record one more step of every eager row at the smallest batch with CUDA's "
                                  "allocator history: the blocks live at its peak by the line that allocated them "
                                  "(on the CPU torch.profiler's allocations, by call site; config.peak_allocations; "
                                  "bench.peak_allocations)")
    device_only.add_argument("--compile-backend", default="inductor",
                             help="torch.compile backend of the compiled modes (default inductor; aot_eager "
                                  "traces forward and backward without code generation)")
    args = p.parse_args(argv)
    if args.device is None and torch.cuda.is_available():
        args.device = "cuda"  # on a GPU machine the benchmark is the GPU comparison (launch/gpu_check.sh)
    if args.device is None and (args.modes or args.dtypes or args.contenders or args.recompute
                                or args.recompute_factors or args.profile or args.peak_allocations):
        p.error("--modes, --dtypes, --contenders, --recompute, --recompute-factors, --profile and --peak-allocations "
                "belong to the device comparison: add --device (e.g. --device cpu)")
    steps = (10 if args.device else 2) if args.steps is None else args.steps
    sizes = args.batch_sizes if args.batch_size is None else [args.batch_size]
    if steps < 1 or any(b < 1 for b in sizes):
        p.error(f"--steps and batch sizes must be >= 1, got steps={steps}, sizes={sizes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device is not None:
        from comera_dist.bench.six_encoder_device import run_device

        return run_device(args, require_device(p, args.device), steps, sizes, argv)
    load_start = os.getloadavg()
    contenders = {n: make_contender(n, smoke=args.smoke) for n in ("dense", "comera")}
    rows: list[dict[str, Any]] = []
    cases = [(b, name) for b in sizes for name in contenders]
    for b, name in terminal_progress(cases, desc="six-encoder", unit="case"):
        c = contenders[name]
        batch = random_batch(c.model, b, smoke=args.smoke)
        mem = measure_step(c.model, c.optimizer, lambda c=c, batch=batch: c.loss(batch))  # also the warm-up
        t = time_steps(c.train_step, batch, steps)
        rows.append({"contender": name, "batch": b, "step_s": t["median_s"], "step_min_s": t["min_s"],
                     "tokens_per_s": b * batch["input_ids"].shape[1] / t["median_s"],
                     "peak_tensor_MiB": mem.total_bytes / 2**20, "activations_MiB": mem.activations_bytes / 2**20,
                     "params": sum(q.numel() for q in c.model.parameters())})
    b_top = max(sizes)
    profiles = {name: top_ops(lambda c=c: c.step(random_batch(c.model, b_top, smoke=args.smoke)))
                for name, c in contenders.items()}
    metrics: dict[str, float] = {}
    for b in sizes:
        by = {r["contender"]: r for r in rows if r["batch"] == b}
        metrics[f"speedup_vs_dense_b{b}"] = by["dense"]["step_s"] / by["comera"]["step_s"]
        metrics[f"memory_ratio_dense_over_comera_b{b}"] = by["dense"]["peak_tensor_MiB"] / by["comera"]["peak_tensor_MiB"]
    config = {"steps": steps, "batch_sizes": sizes, "smoke": args.smoke, "seq_len": SMOKE_SEQ_LEN if args.smoke else SEQ_LEN,
              "target": {"speedup_vs_dense_b32": 5.0}, "profile_batch": b_top, "profile": profiles,
              "threads": torch.get_num_threads(), "rank_align": dispatch.aligned_rank(1),
              "ffn_rows": dispatch.ffn_setting(),  # CoMERA's fused TT FFN (dispatch.ffn_rows)
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    write_result(args.json, "six-encoder", metrics, rows, config, argv=argv)
    return 0

"""The ``train:`` and ``deepspeed:`` config sections, batch arithmetic, and the generated DeepSpeed JSON.

The DeepSpeed JSON is never written by hand: ``to_deepspeed_dict`` derives it from the
typed ``DeepSpeedSection`` (gpt-neox style), and ``solve_batch_sizes`` is the one place
that reconciles ``train_batch_size = micro_batch_size_per_gpu x gradient_accumulation_steps
x world_size``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """How long to train, when to evaluate and checkpoint, where to write, how to resume."""

    steps: int = 100
    """Optimizer steps to train in total (>= 1)."""
    eval_every: int = 0
    """Optimizer steps between validation passes; 0 evaluates only at step 0 of a fresh run and at the end (>= 0)."""
    eval_batches: int = 8
    """Size of each validation pass, in micro-batches: the first ``eval_batches * micro_batch_size_per_gpu``
    validation blocks, shared among the ranks, so the validation loss does not depend on the world size (>= 1;
    at least one block per rank). Set ``micro_batch_size_per_gpu`` for that: one derived from
    ``train_batch_size`` shrinks as the world grows, and the pass with it."""
    checkpoint_every: int = 0
    """Optimizer steps between checkpoints; 0 checkpoints only at the end (>= 0)."""
    keep_checkpoints: int = 2
    """Newest complete checkpoints kept on disk; older ones are deleted only after a newer one is
    published and verified against its manifest (>= 1)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this, whatever ``keep_checkpoints``
    says (0 = off, >= 0)."""
    output_dir: str = "runs/default"
    """Run directory: checkpoints under ``<output_dir>/checkpoints``, the run's tokenizer, the report and its plots
    beside them (the logs go to each rank's stderr: the launcher's or Slurm's output file)."""
    seed: int = 0
    """Seed of torch, python and numpy RNGs (the same on every rank; data sharding uses the rank)."""
    resume: str = "auto"
    """``auto``: the newest checkpoint under the output dir that verifies against its manifest, if any
    (corrupt ones are skipped and logged); ``none``: start fresh; anything else: a path, either one checkpoint
    directory (a published tag), which must verify, or a run directory or its ``checkpoints/``, whose newest
    checkpoint that verifies is taken. Any world size or ZeRO stage."""
    max_nonfinite_steps: int = 3
    """K: the run stops (with a checkpoint of the last good state) after K consecutive steps whose
    global loss is not finite; each such step is skipped and counted (>= 1)."""
    log_every: int = 10
    """Optimizer steps between metric logs (>= 1)."""
    process_group_timeout_s: float = 60.0
    """Collective timeout: a dead peer fails the job after this long instead of hanging (> 0)."""
    data_build_timeout_s: float = 3600.0
    """How long the other ranks wait while each node's first rank builds the data (corpus, tokenizer, packed
    blocks) and rank 0 prepares the run's tokenizer: a first build of a large corpus takes minutes (> 0)."""
    compile: bool = False
    """Wrap the model forward in ``torch.compile`` (re-traced after a prune; static shapes). ZeRO 0-2
    only: ZeRO-3's per-module gathering hooks break the graph (``config.check_cross_sections``)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """``torch.compile`` mode when ``compile`` is on. ``reduce-overhead`` replays the compiled forward
    and backward as CUDA graphs (CUDA-graph trees) on a GPU: the launch-bound CoMERA step's fix; a
    prune re-compiles and so re-captures. Inductor's modes: another ``COMERA_COMPILE_BACKEND`` ignores it."""
    compile_optimizer: bool = False
    """Also ``torch.compile`` DeepSpeed's ZeRO 1-2 optimizer step (gradient norms, inf/NaN checks, unscale and
    clip, AdamW, the copy back), which runs eagerly outside the compiled model: about 170 host ops per step
    on the six-encoder MLM in bf16 become 9 compiled graphs, split at its host reads. The same
    updates (bit-identical with ``aot_eager``). Needs ``compile``; re-compiled after a prune. Off by default:
    on an H200 it gained no clear speed (``trainer-rate-graphs-opt-cuda-h200`` in ``docs/benchmarks.md``)."""

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("eval_every", 0), ("eval_batches", 1), ("checkpoint_every", 0),
                          ("keep_checkpoints", 1), ("keep_every", 0), ("max_nonfinite_steps", 1), ("log_every", 1)):
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"train.{name} must be >= {low}, got {value}")
        for name in ("process_group_timeout_s", "data_build_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"train.{name} must be > 0, got {getattr(self, name)}")
        if not self.output_dir:
            raise ValueError("train.output_dir must be a non-empty path, got ''")
        if not self.resume:
            raise ValueError("train.resume must be 'auto', 'none' or a checkpoint path, got ''")
        # YAML and --set are not a shell: ~/runs would be a directory named "~" in the working directory
        self.output_dir = os.path.expanduser(self.output_dir)
        if self.resume not in ("auto", "none"):
            self.resume = os.path.expanduser(self.resume)


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Learning-rate schedule: linear warmup, then a decay to the end of training."""

    kind: Literal["constant", "warmup_decay", "warmup_cosine"] = "warmup_decay"
    """``constant``: no scheduler; ``warmup_decay``: DeepSpeed ``WarmupDecayLR`` (linear decay to 0);
    ``warmup_cosine``: DeepSpeed ``WarmupCosineLR`` (cosine decay to ``min_ratio`` x lr)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from ``warmup_min_ratio`` x lr to the group's lr (>= 0)."""
    warmup_min_ratio: float = 0.0
    """Start of the warmup as a fraction of each group's lr, in [0, 1]."""
    min_ratio: float = 0.0
    """End of the cosine decay as a fraction of each group's lr, in [0, 1] (``warmup_cosine`` only)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("warmup_min_ratio", "min_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"scheduler.{name} must be in [0, 1], got {value}")


@dataclass(kw_only=True, slots=True)
class DeepSpeedSection:
    """The typed DeepSpeed settings; ``to_deepspeed_dict`` turns them into DeepSpeed's JSON."""

    zero_stage: int = 0
    """ZeRO stage: 0 (data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)."""
    train_batch_size: int | None = None
    """Global batch (sequences per optimizer step over all ranks); ``None``: derived."""
    micro_batch_size_per_gpu: int | None = None
    """Sequences per rank per forward/backward; ``None``: derived."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches accumulated per optimizer step; ``None``: derived (1 if nothing else fixes it)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Training precision of the working weights; the optimizer keeps fp32 master weights under bf16.
    fp16 is not offered: its loss scaling could not be tested (DeepSpeed's CPU accelerator refuses
    fp16 on CPUs without fp16 support, such as CI's), and the ``DynamicLossScaler`` it pickles into
    every ZeRO checkpoint is refused by the ``weights_only`` resume gate (``checkpoint.verify_weights_only``).
    bf16 needs ``zero_stage`` >= 1 (see ``__post_init__``)."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (>= 0)."""
    bf16_overflow_check: bool = True
    """bf16 at ZeRO 1-2: DeepSpeed checks every gradient for inf/NaN before each optimizer step, so a step
    whose gradients are not finite is skipped (weights, moments and LR untouched) instead of applied.
    The check costs about 13 device ops per parameter tensor per step (about 30% of the aten ops of a
    six-encoder bf16 step at ZeRO 1, most of it kernel launches on a GPU). ``false`` drops it: a
    non-finite loss still skips its step (found before any backward: with gradient accumulation, by a
    forward-only probe of every micro-batch, one extra forward each, which can cost more than the
    check saves; the global loss is then read on the host before each backward, a device sync the
    checked step does not have), but non-finite gradients under a finite loss are applied, and the run then stops
    with exit 3 and no new checkpoint (resume from the last one). fp32 needs no such
    check: DeepSpeed finds non-finite gradients from the gradient norm it computes anyway. ZeRO-3
    skips a step with non-finite bf16 gradients either way."""
    contiguous_gradients: bool = True
    """ZeRO 1-2: DeepSpeed copies every gradient into one contiguous partition buffer as the backward
    produces it (its default; against memory fragmentation with large tensors). ``false`` leaves the
    gradients where autograd put them and flattens the partition at the step: one six-encoder bf16
    step at ZeRO 1 on one CPU rank goes from 7,598 to 6,447 aten ops (the per-tensor copy and bucket
    work), which matters on a launch-bound GPU; CoMERA's tensors are small, so fragmentation is not
    the concern it is for dense models. Training is the same either way (tested on 2 ranks at ZeRO 1
    and 2). On an H200, with ``bf16_overflow_check=false``, no faster trainer step
    (``trainer-rate-lean-cuda-h200``). Only ZeRO 1-2 (``zero_stage`` 1 or 2) take ``false``."""
    pack_vectors: bool = True
    """ZeRO 0-2: train the model's 1-D and 2-D parameters as one flat parameter per AdamW group
    (``engine.packing``): every layer's flat ``core``, every layer's ``gate``, and the dense role's (the TT
    layers' biases, the LayerNorms, the position and token-type tables, the MLM head's transform).
    DeepSpeed's per-tensor work then runs once per role instead of once per tensor (six-encoder MLM:
    143 -> 3 parameter tensors). The same numbers train the same way, and state dicts
    and exports keep the per-module keys. ZeRO-3 never packs (it gathers each module's own parameters
    around its forward). ``false``: every parameter its own tensor, as built."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW ``(beta1, beta2)``, each in [0, 1)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (> 0)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The learning-rate schedule."""
    stage3_param_persistence_threshold: int = 100_000
    """ZeRO-3: parameters with fewer elements stay unpartitioned after their first use (>= 0;
    0 partitions everything, which tests use to exercise the partitioned path)."""
    zero3_init: Literal["convert", "construct"] = "convert"
    """How ZeRO-3 partitions the model with ``deepspeed.zero.Init``: ``convert`` an already built
    model (always correct), or ``construct`` it inside the context (no rank ever holds the full
    model; needs every parameter initialised in its own module's constructor, see
    ``engine.build.construct_model``)."""
    comms_logger: bool = False
    """Enable DeepSpeed's communication logger (bytes and latency of every collective)."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"deepspeed.precision must be 'fp32' or 'bf16', got {self.precision!r}"
                             + (" (fp16 is not supported: use bf16)" if self.precision == "fp16" else ""))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.precision == "bf16" and self.zero_stage == 0:
            raise ValueError(
                "deepspeed.precision=bf16 needs deepspeed.zero_stage >= 1 (got 0): at stage 0 DeepSpeed trains "
                "bf16 through its FP16_Optimizer wrapper, whose flat fp32 masters and moments map to no "
                "parameter, so checkpoints and the prune rebuild could not read them; stage 1 on one GPU "
                "partitions nothing and keeps a per-parameter mapping")
        if not self.contiguous_gradients and self.zero_stage not in (1, 2):
            raise ValueError(f"deepspeed.contiguous_gradients=false is a ZeRO 1-2 setting, got zero_stage "
                             f"{self.zero_stage}")
        for name in ("train_batch_size", "micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"deepspeed.{name} must be >= 1 or null, got {value}")
        if self.gradient_clipping < 0:
            raise ValueError(f"deepspeed.gradient_clipping must be >= 0, got {self.gradient_clipping}")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"deepspeed.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if not self.adam_eps > 0:
            raise ValueError(f"deepspeed.adam_eps must be > 0, got {self.adam_eps}")
        if self.stage3_param_persistence_threshold < 0:
            raise ValueError("deepspeed.stage3_param_persistence_threshold must be >= 0, "
                             f"got {self.stage3_param_persistence_threshold}")


@dataclass(frozen=True, slots=True)
class BatchSizes:
    """The solved batch arithmetic: ``global_batch = micro x accumulation x world_size``."""

    global_batch: int
    micro_batch: int
    accumulation: int
    world_size: int


def solve_batch_sizes(section: DeepSpeedSection, world_size: int) -> BatchSizes:
    """Fill in the unset batch sizes from the set ones and check ``global = micro x accum x world``.

    Any two of the three determine the third; one alone takes ``accum = 1`` (or ``micro``
    from ``global / world``); none is an error. Raises ``ValueError`` naming the keys.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    g, m, a = section.train_batch_size, section.micro_batch_size_per_gpu, section.gradient_accumulation_steps
    if g is None and m is None:
        raise ValueError("deepspeed: set train_batch_size or micro_batch_size_per_gpu (both are null)")
    if g is None:
        a = a or 1
        g = m * a * world_size
    elif m is None:
        a = a or 1
        if g % (a * world_size):
            raise ValueError(f"deepspeed.train_batch_size={g} is not divisible by gradient_accumulation_steps"
                             f" x world_size = {a} x {world_size}")
        m = g // (a * world_size)
    elif a is None:
        if g % (m * world_size):
            raise ValueError(f"deepspeed.train_batch_size={g} is not divisible by micro_batch_size_per_gpu"
                             f" x world_size = {m} x {world_size}")
        a = g // (m * world_size)
    if m * a * world_size != g:
        raise ValueError(f"deepspeed batch arithmetic: micro_batch_size_per_gpu x gradient_accumulation_steps x"
                         f" world_size = {m} x {a} x {world_size} = {m * a * world_size}"
                         f" != train_batch_size = {g}")
    return BatchSizes(global_batch=g, micro_batch=m, accumulation=a, world_size=world_size)


def to_deepspeed_dict(section: DeepSpeedSection, world_size: int, *, total_steps: int,
                      group_lrs: list[float], weight_decay: float = 0.0) -> dict[str, Any]:
    """The DeepSpeed JSON for ``section`` on ``world_size`` ranks training ``total_steps`` steps.

    ``group_lrs`` are the learning rates of the parameter groups, in the order they are passed
    to ``deepspeed.initialize``. The optimizer is DeepSpeed's AdamW with ``torch_adam`` (no JIT
    op build), fused (torch's one-kernel AdamW per parameter group, on CUDA and CPU alike, as
    ``bench six-encoder`` steps), and an explicit ``weight_decay``; per-role lrs ride in the parameter
    groups and the schedulers act relative to each group's own lr.
    """
    if not group_lrs or not all(lr > 0 for lr in group_lrs):
        raise ValueError(f"group_lrs must be a non-empty list of positive lrs, got {group_lrs}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    base_lr = group_lrs[0]
    sizes = solve_batch_sizes(section, world_size)
    ds: dict[str, Any] = {
        "train_batch_size": sizes.global_batch,
        "train_micro_batch_size_per_gpu": sizes.micro_batch,
        "gradient_accumulation_steps": sizes.accumulation,
        "gradient_clipping": section.gradient_clipping,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on when it has no dataloader of its own, as here) synchronizes the
        # device at each forward's start, from a module pre-hook that train.compile puts inside the
        # compiled region (a graph break on CUDA), and again at each step's end. The trainer times its
        # steps itself (tokens_per_second), so the timer only costs.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": base_lr, "betas": list(section.adam_betas), "eps": section.adam_eps,
                       "weight_decay": weight_decay, "torch_adam": True, "adam_w_mode": True,
                       # torch's default for this path is foreach on CUDA (about ten launches and their
                       # host work per group each step) and one tensor at a time on the CPU (17 ms per
                       # 3M-element flat partition on one core, 1.7 ms fused)
                       "fused": True},
        },
        "zero_optimization": {"stage": section.zero_stage},
    }
    if section.zero_stage in (1, 2):
        ds["zero_optimization"]["contiguous_gradients"] = section.contiguous_gradients
    if section.zero_stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = section.stage3_param_persistence_threshold
    if section.precision == "bf16":
        # the overflow check is what lets DeepSpeed skip a non-finite step (TrainSession.zero_skips_nonfinite)
        ds["bf16"] = {"enabled": True, "check_grad_overflow": section.bf16_overflow_check}
    sched = section.scheduler
    if sched.kind == "warmup_cosine":
        # WarmupCosineLR scales each param group's own lr, so per-role lrs survive.
        ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total_steps, "warmup_num_steps": max(1, sched.warmup_steps),  # DeepSpeed rejects 0
            "warmup_min_ratio": sched.warmup_min_ratio, "cos_min_ratio": sched.min_ratio,
            "warmup_type": "linear"}}
    elif sched.kind == "warmup_decay":
        # WarmupDecayLR takes absolute lrs: one per parameter group.
        ds["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "total_num_steps": total_steps, "warmup_num_steps": max(1, sched.warmup_steps),  # DeepSpeed rejects 0
            "warmup_min_lr": [sched.warmup_min_ratio * lr for lr in group_lrs],
            "warmup_max_lr": list(group_lrs), "warmup_type": "linear"}}
    if section.comms_logger:
        ds["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    return ds

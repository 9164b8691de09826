"""``TrainSession``: one DeepSpeed engine training a (tensorized) model with rank control, pruning and resume.

The session owns the engine and everything that must change with it: the rank controller,
the ZeRO-aware penalty hook, the pruning history (which fixes the current shapes), and the
checkpoint format. The training loop (``engine/trainer.py``) only calls its methods.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed.comm as dist
import numpy as np
import torch
from torch import Tensor, nn

from comera_dist.compression.accounting import SizeCounter, compression_report, model_size
from comera_dist.compression.controller import RankController
from comera_dist.compression.penalty import rank_penalty
from comera_dist.compression.pruning import PruningPlan, prune_due
from comera_dist.compression.walk import tensorized_modules
from comera_dist.engine import elastic
from comera_dist.engine import resume as resume_mod
from comera_dist.engine.build import Built, construct_model, destroy, initialize
from comera_dist.engine.config import solve_batch_sizes
from comera_dist.engine.device import (
    accelerator_device,
    batches_to_device,
    collective_stack,
    collective_tensor,
    to_device,
)
from comera_dist.engine.hooks import PenaltyHook, gate_refs, gathered
from comera_dist.engine.packing import attached, packed_of
from comera_dist.engine.prune import (
    gather_full_state,
    load_full_state,
    model_at_shapes,
    prune_full_state,
    restore_optimizer_state,
)
from comera_dist.engine.token_stats import label_token_sums
from comera_dist.models.gpt import GPT

log = logging.getLogger(__name__)
Batch = Mapping[str, Tensor]


class NonFiniteGradientsApplied(RuntimeError):
    """Non-finite gradients under finite losses were applied: nothing checked them before the update
    (bf16 at ZeRO 1-2 with ``deepspeed.bf16_overflow_check=false``). The weights are corrupt."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one optimizer step did; losses are global (averaged over ranks and micro-batches)."""

    loss: float
    """The objective back-propagated (task loss and penalty combined by the controller)."""
    task_loss: float
    """The task loss L."""
    penalty: float
    """The rank penalty R (0 for a dense model)."""
    lam: float
    """Late-stage lambda (1: size was optimised, 0: the task loss); 0 in the early stage. Each micro-batch
    decides its own from its global loss; with gradient accumulation this is the step's last micro-batch's
    (the controller's ``lam_switches`` counts every micro-batch's)."""
    stage: str
    """``early`` or ``late``."""
    skipped_nonfinite: bool
    """The global loss or the gradients were not finite: no optimizer update, no LR step."""
    lr: float
    """Learning rate of the first parameter group (cores when tensorized) after the step."""
    grad_norm: float
    """Global gradient norm before clipping (nan when skipped or not computed)."""


@dataclass(frozen=True, slots=True)
class _AfterStep:
    """An applied step's values, read back together (``TrainSession._after_step``)."""

    losses: list[float]
    """Each micro-batch's global task loss."""
    lams: list[int]
    """Each micro-batch's lambda (late stage only; empty early)."""
    objective: float
    penalty: float
    grad_norm: float


def _poison_unless_finite(global_loss: Tensor, dtype: torch.dtype) -> Tensor:
    """0-d ``dtype``: 1 when ``global_loss`` is finite, else NaN (multiplied into the objective, it turns every
    gradient NaN: ``torch.where`` on the objective would zero them instead)."""
    return torch.where(torch.isfinite(global_loss), 1.0, float("nan")).to(dtype)


def seed_everything(seed: int) -> None:
    """The same seed for torch, python and numpy on every rank."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainSession:
    """A DeepSpeed engine plus the CoMERA state around it. Build with :meth:`create`."""

    def __init__(self, cfg, factory: Callable[[], nn.Module], built: Built, *, world_size: int) -> None:
        self.cfg = cfg
        self.factory = factory
        self.world_size = world_size
        self.batch = solve_batch_sizes(cfg.deepspeed, world_size)
        self.controller = RankController(cfg.comera.controller)
        self.plans: list[PruningPlan] = []
        self.steps_done = 0
        self.nonfinite_total = 0
        self._use(built)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, cfg, model_factory: Callable[[], nn.Module], *, world_size: int) -> TrainSession:
        """Seed, build the model (partitioned at birth under ZeRO-3) and the engine. Collective."""
        seed_everything(cfg.train.seed)
        model = construct_model(model_factory, cfg.deepspeed, world_size=world_size)
        return cls(cfg, model_factory, cls._initialize(cfg, model, world_size), world_size=world_size)

    @staticmethod
    def _initialize(cfg, model: nn.Module, world_size: int) -> Built:
        return initialize(model, cfg.comera, cfg.deepspeed, world_size=world_size, total_steps=cfg.train.steps)

    def _use(self, built: Built) -> None:
        self.built = built
        self.engine = built.engine
        self.penalty = PenaltyHook(self.engine.module)
        self._size_counter = SizeCounter(self.engine.module) if self.penalty.active else None  # this module's shapes
        # DeepSpeed put the module on its accelerator's device; batches follow it (engine/device.py).
        self.device = accelerator_device()

    def to_device(self, batch: Batch) -> dict[str, Tensor]:
        """``batch`` on the engine's device: every batch path (train, probe, evaluation) goes through here."""
        return to_device(batch, self.device)

    @property
    def module(self) -> nn.Module:
        """The model inside the engine (replaced after every prune)."""
        return self.engine.module

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (``train_step`` takes a list of this many)."""
        return self.batch.accumulation

    @property
    def micro_batch_size(self) -> int:
        return self.batch.micro_batch

    # ------------------------------------------------------------------ training
    def _global_mean_on_device(self, *values: Tensor) -> Tensor:
        """The mean over ranks of each 0-d device tensor, (n,) float64 on the device: one all-reduce, no read."""
        t = collective_stack(values)  # (n,) on the accelerator: NCCL refuses host tensors
        dist.all_reduce(t)
        return t / self.world_size

    def _global_mean(self, *values: Tensor) -> list[float]:
        """:meth:`_global_mean_on_device`, then one host read for all of them."""
        return self._global_mean_on_device(*values).tolist()

    @property
    def penalty_in_loss(self) -> bool:
        """Whether R enters the loss directly (ZeRO 0-2) instead of the proxy-and-inject path (ZeRO 3).

        At ZeRO 0-2 every gate is a whole, replicated module parameter, so ``rank_penalty(module)``
        is differentiable in the graph: autograd adds ``c * dR/dg`` to the gates' gradients in the
        same backward, with DeepSpeed's accumulation and loss scaling, and no per-gate full-gradient
        get/set (each a host sync in DeepSpeed's inf check) is needed. ZeRO-3 partitions the gates
        outside their layer's forward, hence ``hooks.PenaltyHook``. Both give the same update
        (tests/distributed/test_engine_equivalence.py, every stage against the loss-side reference).
        """
        return self.cfg.deepspeed.zero_stage < 3

    @property
    def zero_skips_nonfinite(self) -> bool:
        """Whether DeepSpeed's ZeRO optimizer (stages 1-3) skips a step whose gradients are not finite.

        It does for fp32, for bf16 with ``bf16.check_grad_overflow`` (the generated config sets it
        unless ``deepspeed.bf16_overflow_check`` is false), and at ZeRO-3 whatever that flag says
        (measured with DeepSpeed 0.19.8: a bf16 step with NaN gradients and the flag off was skipped,
        ``tests/distributed/test_engine_prune_resume.py``). On a non-finite gradient it applies
        nothing, leaves the LR schedule and the moments alone and clears the gradients. A non-finite
        micro-batch after the first then needs no undo: the session back-propagates NaN for the rest
        of the step and lets the optimizer skip it. Elsewhere (ZeRO 0: a plain optimizer, no such
        check; bf16 without the check) a forward-only probe of every micro-batch decides first, which
        costs one extra forward per micro-batch when accumulating; at ZeRO 0 the session checks the
        gradients itself before the update (``checks_gradients``).
        """
        ds = self.cfg.deepspeed
        checked = ds.precision != "bf16" or ds.bf16_overflow_check
        return ds.zero_stage == 3 or (ds.zero_stage >= 1 and checked)

    @property
    def bf16_unchecked(self) -> bool:
        """bf16 at ZeRO 1-2 without DeepSpeed's overflow check: nothing skips a step whose gradients
        alone are non-finite (see ``deepspeed.bf16_overflow_check``)."""
        return self.cfg.deepspeed.zero_stage >= 1 and not self.zero_skips_nonfinite

    @property
    def checks_gradients(self) -> bool:
        """Whether the session checks the gradients before the update itself: ZeRO 0, where DeepSpeed hands
        them to a plain optimizer that applies whatever it gets (and reports no gradient norm). Without
        this a NaN gradient under a finite loss would corrupt the weights silently, and every later step
        would be skipped as a "non-finite loss", hiding the cause."""
        return self.cfg.deepspeed.zero_stage == 0

    def _forward(self, batch: Batch) -> tuple[Tensor, Tensor | None]:
        """The task loss and, where the model's forward gives it (``rank_penalty``: R from the masks the
        forward made anyway, models/), R in the same graph; None otherwise."""
        out = self.engine(**batch)
        return out["loss"], out.get("rank_penalty")

    def _forward_loss(self, batch: Batch) -> Tensor:
        return self._forward(batch)[0]

    def _penalty(self, from_forward: Tensor | None) -> Tensor:
        """R in the graph of the module's gates (ZeRO 0-2): the forward's own, else ``rank_penalty`` with
        packed gates attached to autograd (``engine.packing``: between forwards they are detached views)."""
        if from_forward is not None:
            return from_forward
        with attached(self.module, ("gates",)):
            return rank_penalty(self.module)

    def _all_finite(self, micro_batches: Sequence[Batch]) -> bool:
        """Forward-only probe of every micro-batch, one all-reduce.

        The probe must draw the same dropout masks as the real pass: the host RNG and, on an
        accelerator, the device's RNG (dropout on CUDA draws from the CUDA generator) are forked
        around it, so the real pass starts from the very states the probe started from.
        """
        devices = [self.device] if self.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type), torch.no_grad():
            # each loss copied as it comes: under CUDA-graph trees (train.compile_mode=reduce-overhead) a no-grad
            # replay frees the previous replay's outputs, so the first loss would be gone by the second forward
            losses = [self._forward_loss(b).detach().clone() for b in micro_batches]
        return all(math.isfinite(v) for v in self._global_mean(*losses))

    def _gradients_finite(self) -> bool:
        """Whether every rank's accumulated gradients are finite: one all-reduce, one host read.

        Each rank folds its gradients into one 0-d norm on the device (a foreach kernel, no read per
        tensor), non-finite when any entry is (or when the norm overflows, which ZeRO's own check counts
        as an overflow too). At the boundary DeepSpeed has already averaged the gradients over ranks, so
        the ranks agree anyway; the all-reduce makes the decision collective by construction.
        """
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return True
        norm = torch.nn.utils.get_total_norm(grads)  # 0-d, on the device
        return math.isfinite(self._global_mean(norm)[0])

    def _discard_gradients(self) -> None:
        """End the step's accumulation without an update (ZeRO 0): what a ZeRO optimizer does on overflow.

        ``engine.step()`` would apply the gradients, so it is not called at the boundary: the gradients
        are cleared and DeepSpeed's micro-step count moves on as ``step()`` would move it, so the next
        step's micro-batches keep their place in the accumulation (its boundary is ``micro_steps + 1``
        being a multiple of the accumulation). Nothing else moves: no optimizer step, no LR step.
        """
        self.engine.zero_grad()
        self.engine.micro_steps += 1

    def size(self) -> int:
        """The model size S (surviving core parameters), identical on every rank."""
        refs = [r.param for r in gate_refs(self.module)]
        if not refs:
            return 0
        with gathered(refs):
            return model_size(self.module)

    def _size_tensor(self) -> Tensor:
        """S as a 0-d device tensor, without a host read per gate (``size()`` reads every gate back:
        one sync each on a GPU), in a fixed handful of ops (``SizeCounter``, built once per engine)."""
        if self._size_counter is None:
            return torch.zeros((), dtype=torch.int64, device=self.device)
        with gathered([r.param for r in self.penalty.gates]):
            return self._size_counter()

    def train_step(self, micro_batches: Sequence[Batch] | Batch) -> StepOutput:
        """One optimizer step over this rank's ``accumulation`` micro-batches. Collective.

        Nothing between the first forward and the optimizer step reads the device back where DeepSpeed
        checks the gradients (``zero_skips_nonfinite``, the default): the global loss and S are
        all-reduced on the device, lambda is decided there (``RankController.objective_on_device``), and
        a non-finite global loss turns the gradients to NaN, so ZeRO's check skips the whole step (no
        update, no LR step, moments untouched). One host read after the step brings back the losses,
        lambdas, objective, R and the gradient norm (``_after_step``). Non-finite gradients under finite
        losses are skipped and counted the same way. Elsewhere (ZeRO 0, unchecked bf16) the global loss
        is read before each backward, and a non-finite one skips the step before any backward (or, after
        the first micro-batch, the finite-probe has ruled it out); at ZeRO 0 the gradients are checked
        before the update too (``_gradients_finite``: one more read) and non-finite ones skip the step;
        ``NonFiniteGradientsApplied`` is raised after an applied step whose gradients were not finite
        (``bf16_unchecked``). The stage is decided from the step number and the step before's loss
        (``RankController.begin_step``); a skipped step leaves the rank controller as it found it.
        """
        if isinstance(micro_batches, Mapping):
            micro_batches = [micro_batches]
        if len(micro_batches) != self.accumulation:
            raise ValueError(f"train_step: got {len(micro_batches)} micro-batches, the config accumulates "
                             f"{self.accumulation} (deepspeed.gradient_accumulation_steps)")
        self.engine.train()
        packing = packed_of(self.module)
        if packing is not None:  # S and a compiled forward read the resting views: they must show the flat parameter
            packing.refresh()
        micro_batches = [self.to_device(b) for b in micro_batches]  # once, for the probe and the real pass
        if len(micro_batches) > 1 and not self.zero_skips_nonfinite and not self._all_finite(micro_batches):
            return self._skipped()
        controller_before = self.controller.state_dict()  # a skipped step leaves the controller as it was
        if self.penalty.active:  # S comes back to the host only on the step that switches stage
            self.controller.begin_step(self.steps_done + 1, lambda: round(self._global_mean(self._size_tensor())[0]))
        # S (0-d, on the device) only where lambda needs it: the late stage
        size = [self._size_tensor()] if self.penalty.active and self.controller.stage == "late" else []
        # ZeRO-3's proxy path: the gates' fp32 masters and R, once for the step (they change only in its update)
        gate_values = self.penalty.gates_fp32() if self.penalty.active and not self.penalty_in_loss else None
        r_step = self.penalty.value(gate_values) if gate_values is not None else None
        global_losses, objectives, lams, coef, r_value = [], [], [], None, None
        for i, batch in enumerate(micro_batches):
            task, forward_penalty = self._forward(batch)
            global_loss, *global_size = self._global_mean_on_device(task, *size)  # 0-d float64 each
            if not self.zero_skips_nonfinite and not math.isfinite(float(global_loss)):
                if i == 0:  # nothing was back-propagated yet: the engine is untouched
                    self.controller.load_state_dict(controller_before)
                    return self._skipped()
                # Earlier micro-batches already put their gradients into the engine and nothing would skip
                # the update. The probe replays the same RNG, so only a non-deterministic forward gets
                # here: stop with the cause, not corrupt state.
                raise RuntimeError(f"micro-batch {i} gave a non-finite loss in the real pass although the "
                                   "finite-probe found every micro-batch finite (a non-deterministic "
                                   "forward?); the step's accumulation cannot be undone")
            proxy = None
            if self.penalty.active:
                if self.penalty_in_loss:
                    penalty = self._penalty(forward_penalty)  # 0-d, in the graph of the module's whole gates
                else:
                    penalty = proxy = self.penalty.proxy(r_step)  # 0-d leaf holding R
                objective, lam = self.controller.objective_on_device(task, penalty, global_loss=global_loss,
                                                                     global_size=global_size[0] if global_size else None)
                lams += [lam] if lam is not None else []
                r_value = penalty.detach()  # read back once, after the step
            else:
                objective = task
            # x1, or xNaN when the global loss is not finite: every gradient of the step turns NaN and ZeRO's
            # check at the boundary skips the update (earlier micro-batches' gradients are cleared with it)
            objective = objective * _poison_unless_finite(global_loss, objective.dtype)
            self.engine.backward(objective)
            if proxy is not None:  # d objective / d R, scaled like the task gradients (ZeRO-3 only), on the device
                coef = proxy.grad if coef is None else coef + proxy.grad
            global_losses.append(global_loss)
            objectives.append(objective.detach())  # averaged over ranks once, after the step
            if self.engine.is_gradient_accumulation_boundary() and coef is not None:
                self.penalty.inject(coef, gate_values)
            if self.checks_gradients and self.engine.is_gradient_accumulation_boundary() \
                    and not self._gradients_finite():  # a plain optimizer would apply them
                self._discard_gradients()
                self.controller.load_state_dict(controller_before)
                return self._skipped()
            self.engine.step()
        if not self.engine.was_step_applied():  # a non-finite loss or non-finite gradients: DeepSpeed skipped
            self.controller.load_state_dict(controller_before)
            return self._skipped()
        self.steps_done += 1
        after = self._after_step(global_losses, lams, objectives, r_value)
        if not all(math.isfinite(v) for v in after.losses):  # the NaN gradients did not stop DeepSpeed
            raise RuntimeError("a micro-batch of this step had a non-finite loss, but DeepSpeed applied the "
                               "step instead of skipping it; the weights may be corrupt")
        task_loss = sum(after.losses) / len(after.losses)
        if self.penalty.active:
            self.controller.end_step(task_loss, after.lams)
        if self.bf16_unchecked and not 0 <= after.grad_norm < math.inf:  # DeepSpeed: inf, NaN or its -1 sentinel
            raise NonFiniteGradientsApplied(
                f"step {self.steps_done}: the gradients were not finite (gradient norm {after.grad_norm}) "
                "although every loss was, and the step was applied: with deepspeed.bf16_overflow_check=false "
                "nothing checks bf16 gradients before the update. The weights are corrupt; resume from the "
                "last checkpoint, with the check on to skip such steps")
        return StepOutput(loss=after.objective, task_loss=task_loss, penalty=after.penalty,
                          lam=float(after.lams[-1]) if after.lams else 0.0, stage=self.controller.stage,
                          skipped_nonfinite=False, lr=float(self.engine.get_lr()[0]), grad_norm=after.grad_norm)

    def _after_step(self, global_losses: Sequence[Tensor], lams: Sequence[Tensor], objectives: Sequence[Tensor],
                    r_value: Tensor | None) -> _AfterStep:
        """The step just taken's values in one host read: every micro-batch's global loss and lambda, the
        global mean objective, R and the gradient norm.

        Nothing between the first forward and the optimizer step waits for the device (where DeepSpeed
        checks the gradients): the values stay queued until here, then one all-reduce averages the
        objectives over ranks, and DeepSpeed's grad norm (a device tensor at some stages, a number or
        None at others) comes back in the same read.
        """
        mean = collective_stack(objectives).mean().reshape(1)  # (1,) this rank's mean over micro-batches
        dist.all_reduce(mean)
        norm = self.engine.get_global_grad_norm()
        rest = [t for t in (r_value, norm) if isinstance(t, Tensor)]
        values = torch.cat([mean, collective_stack([*global_losses, *lams, *rest])]).tolist()
        n, k = len(global_losses), len(lams)
        losses, lam_values, rest_values = values[1:1 + n], [int(v) for v in values[1 + n:1 + n + k]], values[1 + n + k:]
        penalty = rest_values[0] if r_value is not None else 0.0
        if isinstance(norm, Tensor):
            grad_norm = rest_values[-1]
        else:
            grad_norm = float("nan") if norm is None else float(norm)
        return _AfterStep(losses=losses, lams=lam_values, objective=values[0] / self.world_size,
                          penalty=penalty, grad_norm=grad_norm)

    def _skipped(self) -> StepOutput:
        self.steps_done += 1
        self.nonfinite_total += 1
        return StepOutput(loss=float("nan"), task_loss=float("nan"), penalty=float("nan"), lam=0.0,
                          stage=self.controller.stage, skipped_nonfinite=True,
                          lr=float(self.engine.get_lr()[0]), grad_norm=float("nan"))

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> tuple[float, float]:
        """Global (loss, accuracy) over the label tokens of ``batches``. Collective.

        Every rank must pass the same number of batches. Accuracy is the fraction of label
        tokens (MLM: masked positions; causal: next tokens) predicted by the arg-max logit.
        """
        self.engine.eval()
        sums = label_token_sums(self.engine, batches_to_device(batches, self.device),
                                causal=isinstance(self.module, GPT))
        self.engine.train()
        total = collective_tensor(sums)  # (3,) on the accelerator
        dist.all_reduce(total)
        loss_sum, correct, count = total.tolist()
        if count == 0:
            return float("nan"), float("nan")
        return loss_sum / count, correct / count

    # ------------------------------------------------------------------ compression state
    def compression_report(self) -> dict[str, Any]:
        """``compression.compression_report`` of the model (ZeRO-3 aware: core shapes from the layers'
        ``core_shapes()``, other parameters' from ``ds_shape``)."""
        with gathered([r.param for r in gate_refs(self.module)]):
            return compression_report(self.module)

    def gates_finite(self) -> bool:
        """Whether every rank gate is finite (collective at ZeRO-3, where the gates are gathered). NaN gates read
        as dead ranks (NaN is not above tau): a non-finite state, not a collapse of the ranks."""
        params = [r.param for r in gate_refs(self.module)]
        with gathered(params):
            return all(bool(torch.isfinite(p.detach()).all()) for p in params)

    def ranks(self) -> dict[str, list[int]]:
        """Surviving ranks per tensorized layer and bond."""
        with gathered([r.param for r in gate_refs(self.module)]):
            return {name: [int(r) for r in layer.ranks()] for name, layer in tensorized_modules(self.module)}

    def bond_dims(self) -> dict[str, list[int]]:
        """Physical bond sizes per tensorized layer (what pruning shrinks)."""
        return {name: layer.bond_dims() for name, layer in tensorized_modules(self.module)}

    def maybe_prune(self, step: int) -> bool:
        """At a scheduled step, slice dead ranks out and rebuild the engine; True if shapes changed.

        Collective. The surviving AdamW moments, step count and LR-schedule position carry over.
        """
        p = self.cfg.comera.pruning
        if not prune_due(p, step) or not self.penalty.active:  # every `every` steps counted from start_step
            return False
        state = gather_full_state(self.engine)
        # The gathered state lives on the engine's device; so must the model it is sliced with
        # (apply_plan indexes the moments with index tensors made on the gates' device).
        model = model_at_shapes(self.factory, self.plans).to(self.device)
        load_full_state(model, state)
        plan = prune_full_state(model, state, p.min_rank, working_dtype=self.penalty.working_dtype)
        if plan is None:
            return False
        self.plans.append(plan)
        self._rebuild(model, state)
        return True

    def _rebuild(self, model: nn.Module, state) -> None:
        position = elastic.schedule_position(self.engine)
        self._replace_engine(model)
        restore_optimizer_state(self.engine, state, set_master=self.cfg.deepspeed.precision != "fp32")
        elastic.restore_schedule(self.engine, position)

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_root(self) -> Path:
        return Path(self.cfg.train.output_dir) / "checkpoints"

    def save(self, step: int, client_state: Mapping[str, Any] | None = None, *, retain: bool = True,
             side_files: Mapping[str, str] | None = None, meta_fields: Mapping[str, Any] | None = None,
             before_publish=None) -> Path | None:
        """Checkpoint at ``step`` (collective); see ``engine.resume.save``."""
        return resume_mod.save(self, step, client_state, retain=retain, side_files=side_files,
                               meta_fields=meta_fields, before_publish=before_publish)

    def resume(self, spec: str) -> dict[str, Any] | None:
        """Load ``auto`` | ``none`` | a checkpoint path (collective); see ``engine.resume.resume``."""
        return resume_mod.resume(self, spec)

    def close(self) -> None:
        """Destroy the engine once the job is done (every rank, before the process group goes): DeepSpeed
        keeps global references to it (its backward hooks; at ZeRO-3 its module, ``build.destroy``), so
        without this the engine, its optimizer and the process groups they hold live until the interpreter
        is torn down."""
        if self.engine is not None:
            destroy(self.engine)
            self.engine = None

    def _replace_engine(self, model: nn.Module) -> None:
        """Destroy the engine and build a fresh one around ``model`` for this job's world size and stage."""
        old = self.engine
        self.engine = None
        destroy(old)
        self._use(self._initialize(self.cfg, model, self.world_size))

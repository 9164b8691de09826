"""The two-stage multi-objective rank controller (method doc section 3), as explicit state.

Early stage (weighted sum):   loss = L + gamma * R
Late stage (achievement scalarization toward the target point (L*, S*)):

    lambda = 1[ (L - L*)/L  <  (S - S*)/S ]
    loss   = 0.1*L + 0.01*R + lambda*R + (1 - lambda)*L

``S* = target_ratio * S(at the switch)``. lambda is re-decided on every call from the
GLOBAL task loss and size the engine passes (all-reduced over ranks, so every rank takes
the same branch). With ``target_loss = 0`` the task gap is 1, larger than any size gap,
so lambda stays 0: set ``target_loss`` to a reachable loss to make the late stage trade.

Two ways to drive it, the same math:
- with host numbers: ``advance(step, global_loss, global_size)`` (may switch stage) then
  ``objective(...)``, per optimizer step (the references and benchmarks);
- without a host read inside the step (``TrainSession``): ``begin_step(step, read_size)`` decides
  the stage from the step number and the global task loss of the step before (``state.last_loss``;
  S is read only on the step that switches), ``objective_on_device(...)`` decides lambda on the
  device from the all-reduced 0-d L and S, and ``end_step(loss, lambdas)`` records the values read
  back once after the step. A ``late_stage_loss`` switch therefore comes one step after the loss
  crossed it; a ``late_stage_step`` switch and lambda are exactly those of ``advance``/``objective``.

The state rides in the checkpoint's client_state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor

from comera_dist.compression.config import ControllerConfig


@dataclass(kw_only=True, slots=True)
class ControllerState:
    """Everything the controller remembers between steps (checkpointed)."""

    stage: Literal["early", "late"] = "early"
    """Current stage."""
    step: int = 0
    """Last step passed to ``advance``."""
    switch_step: int | None = None
    """Step at which the late stage began (``None`` while early)."""
    size_at_switch: int | None = None
    """Global model size S when the late stage began."""
    target_size: float | None = None
    """S* = target_ratio * size_at_switch."""
    lam: int | None = None
    """The last late-stage lambda (0: optimise the task loss, 1: optimise size)."""
    lam_switches: int = 0
    """How many times lambda changed value in the late stage (a health metric)."""
    last_loss: float | None = None
    """The global task loss of the last applied step (``end_step``): what a ``late_stage_loss`` switch
    at the next ``begin_step`` compares. Absent from checkpoints written before it existed (None)."""


class RanksCollapsed(RuntimeError):
    """Every gate of every TT layer is at or below tau: the model size S is 0, and training cannot recover
    (``message``: a subclass's own account of a model that cannot train on)."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or
            "every rank of every TT layer is dead (each gate at or below comera.controller.tau: model size S = 0). "
            "The compressed layers now output only their biases, and a dead gate gets no gradient, so no rank can "
            "come back. The rank penalty pushed every gate under tau: lower comera.controller.gamma or "
            "comera.lr.gates, then resume from a checkpoint written before the collapse, or start over")


class InputEmbeddingDead(RanksCollapsed):
    """A bond of the TT embedding has no rank alive: the embedding maps every token to zero, so the model no longer
    sees its input (and, through a tied head, predicts nothing: the loss sits at ln(vocab size)). A dead gate gets
    no gradient, so the bond cannot come back."""

    def __init__(self, layer: str, ranks: list[int]) -> None:
        super().__init__(
            f"{layer} has a bond with no rank alive (ranks {ranks}): the embedding maps every token to zero, so "
            "the model no longer sees its input, and a dead gate gets no gradient, so no rank can come back. Set "
            "comera.controller.embedding_tau below comera.controller.tau, or lower comera.controller.gamma or "
            "comera.lr.gates, then resume from a checkpoint written before this, or start over")


_OPTIONAL_STATE = frozenset({"last_loss"})
"""State keys a checkpoint may lack (added later; their defaults apply)."""


class RankController:
    """Turns (task loss, rank penalty) into the scalar loss to back-propagate."""

    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.state = ControllerState()

    @property
    def stage(self) -> str:
        return self.state.stage

    @property
    def lam(self) -> int | None:
        return self.state.lam

    def advance(self, step: int, global_loss: float, global_size: int) -> bool:
        """Record ``step`` and enter the late stage when the schedule says so.

        Switches at ``step >= late_stage_step`` or when ``global_loss <= late_stage_loss``
        (whichever is configured and comes first). Returns True on the step that switches
        (the engine re-captures graphs then).
        """
        _check_global(global_loss, global_size)
        due = self._due(step, global_loss)
        self.state.step = step
        if due:
            self._switch(step, global_size)
        return due

    def begin_step(self, step: int, read_size: Callable[[], int]) -> bool:
        """``advance`` for a step whose loss is not on the host yet: the switch is decided from ``step``
        and ``state.last_loss`` (the step before's, from ``end_step``; None before the first), and
        ``read_size()`` (a host read of the global S) is called only on the step that switches."""
        due = self._due(step, self.state.last_loss)
        self.state.step = step
        if due:
            size = read_size()
            _check_size(size)
            self._switch(step, size)
        return due

    def _due(self, step: int, global_loss: float | None) -> bool:
        if self.state.stage == "late":
            return False
        by_step = self.cfg.late_stage_step is not None and step >= self.cfg.late_stage_step
        by_loss = (self.cfg.late_stage_loss is not None and global_loss is not None
                   and global_loss <= self.cfg.late_stage_loss)
        return by_step or by_loss

    def _switch(self, step: int, global_size: int) -> None:
        self.state.stage = "late"
        self.state.switch_step = step
        self.state.size_at_switch = int(global_size)
        self.state.target_size = self.cfg.target_ratio * global_size

    def stage_kept(self) -> str | None:
        """Why a loaded late stage outlives this controller's schedule: the state switched at a step where this
        config's ``late_stage_step`` (later, or none) would not have, and a stage is state, not undone by a
        resume. None when the schedule agrees, while early, or with a ``late_stage_loss`` (which could have
        switched it)."""
        s, c = self.state, self.cfg
        if s.stage != "late" or c.late_stage_loss is not None:
            return None
        if c.late_stage_step is not None and c.late_stage_step <= (s.switch_step or 0):
            return None
        when = "sets none" if c.late_stage_step is None else f"is {c.late_stage_step}"
        return (f"the checkpoint's controller entered the late stage at step {s.switch_step} and stays there: "
                f"this config's comera.controller.late_stage_step {when}, but a resume does not undo a stage "
                "(start over with --resume none, or from a checkpoint written before the switch)")

    def retarget(self) -> tuple[float, float] | None:
        """S* again from this controller's ``target_ratio`` and the state's S at the switch: a resume whose config
        has another ratio than the run that switched. ``(old, new)`` when S* moved; None when it did not (the early
        stage, or the same ratio)."""
        s = self.state
        if s.stage != "late" or s.size_at_switch is None:
            return None
        new = self.cfg.target_ratio * s.size_at_switch
        if new == s.target_size:
            return None
        old, s.target_size = s.target_size, new
        return old, new

    def decide_lambda(self, global_loss: float, global_size: int) -> int:
        """lambda = 1[(L - L*)/L < (S - S*)/S]; only meaningful in the late stage."""
        _check_global(global_loss, global_size)
        if self.state.target_size is None:
            raise RuntimeError("RankController.decide_lambda: the late stage has not begun (call advance)")
        task_gap = (global_loss - self.cfg.target_loss) / global_loss
        size_gap = (global_size - self.state.target_size) / global_size
        return int(task_gap < size_gap)

    def objective(self, task_loss: Tensor, penalty: Tensor, *, global_loss: float, global_size: int) -> Tensor:
        """The loss to back-propagate.

        task_loss: this rank's 0-d task loss L (with graph); penalty: the 0-d rank penalty R;
        global_loss / global_size: L and S all-reduced over ranks (plain numbers), which
        decide lambda in the late stage. The combination is computed in fp32 (or wider) whatever
        the dtype of the losses: a bf16 task loss (DeepSpeed bf16) is not rounded again with the penalty.
        """
        task_loss, penalty = _at_least_fp32(task_loss), _at_least_fp32(penalty)
        if self.state.stage == "early":
            return task_loss + self.cfg.gamma * penalty
        lam = self.decide_lambda(global_loss, global_size)
        self._record_lambda(lam)
        return self._late(task_loss, penalty, penalty if lam else task_loss)

    def objective_on_device(self, task_loss: Tensor, penalty: Tensor, *, global_loss: Tensor,
                            global_size: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``objective`` without a host read: (the loss to back-propagate, lambda as a 0-d bool tensor, or
        None in the early stage).

        global_loss / global_size: 0-d float64 device tensors, the all-reduced mean L and S (S may be None
        in the early stage, which does not use it). Lambda is decided on the device by the same float64
        arithmetic as ``decide_lambda`` on the host (S rounded half to even, as ``round``), so both give
        the same lambda for the same L and S. The state's ``lam`` and ``lam_switches`` wait for ``end_step``.
        """
        task_loss, penalty = _at_least_fp32(task_loss), _at_least_fp32(penalty)
        if self.state.stage == "early":
            return task_loss + self.cfg.gamma * penalty, None
        if self.state.target_size is None or global_size is None:
            raise RuntimeError("RankController.objective_on_device: the late stage needs its target size and S")
        size = torch.round(global_size)
        lam = (global_loss - self.cfg.target_loss) / global_loss < (size - self.state.target_size) / size
        return self._late(task_loss, penalty, torch.where(lam, penalty, task_loss)), lam

    def _late(self, task_loss: Tensor, penalty: Tensor, chosen: Tensor) -> Tensor:
        """The late-stage objective, ``chosen`` being lambda*R + (1 - lambda)*L with lambda in {0, 1}."""
        return self.cfg.late_task_weight * task_loss + self.cfg.late_rank_weight * penalty + chosen

    def end_step(self, global_loss: float, lams: Sequence[int]) -> None:
        """Record an applied step, read back once after it: its global task loss (what a loss-triggered
        switch at the next ``begin_step`` compares) and the lambdas its micro-batches decided, in order."""
        self.state.last_loss = float(global_loss)
        for lam in lams:
            self._record_lambda(int(lam))

    def _record_lambda(self, lam: int) -> None:
        if self.state.lam is not None and lam != self.state.lam:
            self.state.lam_switches += 1
        self.state.lam = lam

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (JSON/pickle-safe) for the checkpoint's client_state."""
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; unknown or missing keys are errors (``last_loss`` may be missing:
        a checkpoint from before it existed)."""
        names = {f.name for f in fields(ControllerState)}
        unknown, missing = set(state) - names, names - set(state) - _OPTIONAL_STATE
        if unknown or missing:
            raise ValueError(f"RankController.load_state_dict: unknown keys {sorted(unknown)}, "
                             f"missing keys {sorted(missing)}")
        new = ControllerState(**state)
        if new.stage not in ("early", "late"):
            raise ValueError(f"RankController.load_state_dict: stage must be 'early' or 'late', got {new.stage!r}")
        if new.stage == "late" and new.target_size is None:
            raise ValueError("RankController.load_state_dict: late stage without target_size")
        self.state = new


def _at_least_fp32(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32)) if isinstance(t, Tensor) else t


def _check_global(global_loss: float, global_size: int) -> None:
    if not (math.isfinite(global_loss) and global_loss > 0):
        raise ValueError(f"RankController: global_loss must be finite and > 0, got {global_loss}")
    _check_size(global_size)


def _check_size(global_size: float) -> None:
    if global_size == 0:
        raise RanksCollapsed()
    if not global_size > 0:
        raise ValueError(f"RankController: global_size must be > 0, got {global_size}")

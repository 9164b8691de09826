"""Fault injection for tests: make the training loss non-finite at chosen steps.

Set ``COMERA_FAULT_NONFINITE_STEPS`` to a comma-separated list of optimizer steps and/or
inclusive ranges (``"3,5-7"``), and optionally ``COMERA_FAULT_RANKS`` (default: all ranks,
e.g. ``"0"``) to poison the loss on only some ranks. The loss is multiplied by NaN in a
forward hook on the model, so the real skip/count/stop path of the engine is exercised. With
``COMERA_FAULT_NONFINITE_KIND=grad`` the loss stays finite and its gradient becomes NaN instead
(non-finite gradients under a finite loss). Never set these in production: they exist so the
non-finite handling can be tested.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

ENV_STEPS = "COMERA_FAULT_NONFINITE_STEPS"
ENV_RANKS = "COMERA_FAULT_RANKS"
ENV_KIND = "COMERA_FAULT_NONFINITE_KIND"
KINDS = ("loss", "grad")


def parse_steps(spec: str) -> set[int]:
    """``"3,5-7"`` -> ``{3, 5, 6, 7}``; bad syntax raises ``ValueError`` naming the variable."""
    steps: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{ENV_STEPS}={spec!r}: {part!r} is not a step or a range a-b") from None
        if first < 1 or last < first:
            raise ValueError(f"{ENV_STEPS}={spec!r}: bad range {part!r} (steps start at 1)")
        steps.update(range(first, last + 1))
    return steps


class NonFiniteInjector:
    """Poisons the model's training loss with NaN at the configured steps (a no-op when unset)."""

    def __init__(self, rank: int, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.steps = parse_steps(env.get(ENV_STEPS, ""))
        ranks = env.get(ENV_RANKS, "")
        try:
            only = {int(r) for r in ranks.split(",") if r.strip()}
        except ValueError:
            raise ValueError(f"{ENV_RANKS}={ranks!r} is not a comma-separated list of ranks") from None
        self.enabled_here = bool(self.steps) and (not only or rank in only)
        self.kind = env.get(ENV_KIND, "loss")
        if self.kind not in KINDS:
            raise ValueError(f"{ENV_KIND}={self.kind!r}: must be one of {', '.join(KINDS)}")
        self.armed = False

    def attach(self, model: nn.Module) -> None:
        """Register the forward hook on ``model`` (call again after a rebuild gives a new model)."""
        if self.enabled_here:
            model.register_forward_hook(self._hook)

    def arm(self, step: int, training: bool = True) -> None:
        """Arm the hook for the coming forward pass when ``step`` is a poisoned training step."""
        self.armed = training and self.enabled_here and step in self.steps

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.armed and isinstance(output, dict) and output.get("loss") is not None:
            output = dict(output)
            if self.kind == "grad":
                if output["loss"].requires_grad:  # a no-grad forward (the session's finite-loss probe) has none
                    output["loss"].register_hook(lambda g: g * float("nan"))  # the value stays finite
            else:
                output["loss"] = output["loss"] * float("nan")
        return output

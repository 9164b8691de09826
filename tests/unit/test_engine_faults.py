"""``engine.faults.NonFiniteInjector`` in ``grad`` mode: a finite loss whose gradient is NaN, also when the
session probes the loss in a no-grad forward first (ZeRO 0 or unchecked bf16 with accumulation)."""

from __future__ import annotations

import math

import torch
from torch import nn

from comera_dist.engine.faults import ENV_KIND, ENV_STEPS, NonFiniteInjector


class LossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.w * x).sum()}


def test_grad_faults_poison_the_gradient_and_let_a_no_grad_probe_pass():
    model = LossModel()
    faults = NonFiniteInjector(rank=0, environ={ENV_STEPS: "2", ENV_KIND: "grad"})
    faults.attach(model)
    faults.arm(2)
    with torch.no_grad():  # the probe: a finite loss, and no hook to register on it
        assert math.isfinite(float(model(torch.ones(3))["loss"]))
    loss = model(torch.ones(3))["loss"]
    assert math.isfinite(float(loss))
    loss.backward()
    assert torch.isnan(model.w.grad).all()

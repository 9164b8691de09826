"""engine.hooks.PenaltyHook outside ZeRO-3: the injection is ZeRO-3's path and refuses whole gates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_dist.engine.hooks import PenaltyHook
from comera_dist.layers.linear import TTLinear


def test_inject_refuses_gates_that_zero3_does_not_partition():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(TTLinear(12, 16, num_cores=4, max_rank=4, generator=g))
    hook = PenaltyHook(model)
    gates = hook.gates_fp32()  # whole parameters: one by one, no collective
    assert [tuple(v.shape) for v in gates] == [(12,)]  # 3 bonds of rank 4
    assert float(hook.value(gates)) > 0
    with pytest.raises(ValueError, match=r"not ZeRO-3 partitioned parameters; at ZeRO 0-2 the rank penalty "
                                         r"enters the loss"):
        hook.inject(torch.tensor(1.0), gates)


def test_the_penalty_hook_thresholds_on_the_working_dtype():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(TTLinear(12, 16, num_cores=4, max_rank=4, generator=g)).to(torch.bfloat16)
    assert PenaltyHook(model).working_dtype == torch.bfloat16

"""``engine.prune``'s state handling without an engine: ``load_full_state``'s guards and the settings
``prune_full_state`` hands the plan (the 2-rank prune and rebuild: tests/distributed/test_engine_prune_resume.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_dist.engine.prune import FullState, load_full_state, prune_full_state
from comera_dist.layers import TTLinear


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = TTLinear(64, 64, in_modes=[8, 8], out_modes=[8, 8], ranks=[1, 4, 4, 4, 1], generator=g)
        self.head = nn.Linear(4, 3)


def _state(net: nn.Module) -> FullState:
    return FullState(params={n: p.detach().clone() for n, p in net.named_parameters(remove_duplicate=False)},
                     buffers={n: b.clone() for n, b in net.named_buffers()}, moments={}, step=0)


def test_load_full_state_copies_a_matching_state():
    src, dst = _Net(), _Net()
    with torch.no_grad():
        src.head.weight.add_(1.0)
    load_full_state(dst, _state(src))
    assert all(torch.equal(a, b) for a, b in zip(dst.parameters(), src.parameters(), strict=True))


def test_load_full_state_refuses_a_state_missing_or_adding_names():
    state = _state(_Net())
    del state.params["head.bias"]
    state.params["head.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"model/state mismatch: missing \['head.bias'\], unexpected \['head.extra'\]"):
        load_full_state(_Net(), state)


def test_load_full_state_refuses_a_shape_other_than_the_models():
    state = _state(_Net())
    state.params["head.weight"] = torch.zeros(3, 5)
    dst = _Net()
    before = dst.head.weight.detach().clone()
    with pytest.raises(ValueError, match=r"head.weight: model shape \(3, 4\) != state shape \(3, 5\)"):
        load_full_state(dst, state)
    assert torch.equal(dst.head.weight, before)


def _with_gates(bond0: list[float], tau: float = 0.5) -> _Net:
    net = _Net()
    with torch.no_grad():
        net.proj.tau.fill_(tau)
        net.proj.gates[0].copy_(torch.tensor(bond0))
    return net


def test_prune_full_state_judges_the_masters_as_their_working_copy():
    """0.5001 is above tau 0.5 in fp32 but rounds to 0.5 in bf16: the bf16 forward has that rank dead."""
    gates = [1.0, 0.5001, 1.0, 1.0]
    net = _with_gates(gates)
    assert prune_full_state(net, _state(net), 1) is None  # fp32: all four alive
    net = _with_gates(gates)
    plan = prune_full_state(net, _state(net), 1, working_dtype=torch.bfloat16)
    assert plan is not None and plan.kept == {"proj": {0: [0, 2, 3]}}
    assert net.proj.bond_dims() == [3, 4, 4]


def test_prune_full_state_keeps_min_rank_of_the_largest_gates():
    net = _with_gates([0.1, 0.3, 0.2, 0.9])  # one alive
    plan = prune_full_state(net, _state(net), 2)
    assert plan.kept == {"proj": {0: [1, 3]}} and net.proj.bond_dims() == [2, 4, 4]

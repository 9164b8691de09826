"""rank_penalty: R = sum m(g) / #(g > tau) over all gates, on real TT layers; pure and differentiable."""

import pytest
import torch
from torch import nn

from comera_dist.compression.penalty import penalty_from_gates, rank_penalty
from comera_dist.layers.linear import TTLinear


def _model(tau_b: float = 1e-2) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    return nn.Sequential(
        TTLinear(16, 24, num_cores=4, max_rank=4, generator=g),
        nn.LayerNorm(24),
        TTLinear(24, 16, num_cores=6, max_rank=3, tau=tau_b, generator=g),
    )


def test_penalty_is_one_at_init():
    assert rank_penalty(_model()).item() == pytest.approx(1.0)


def test_penalty_matches_hand_formula_and_gradient():
    model = _model(tau_b=0.2)
    a, b = model[0], model[2]
    with torch.no_grad():
        a.gates[0].copy_(torch.tensor([0.5, 0.005, 2.0, -1.0]))  # 2 alive (tau 0.01)
        b.gates[1].copy_(torch.tensor([0.15, 0.3, 0.1]))  # 1 alive (tau 0.2 for this layer)
    before = [g.detach().clone() for g in (*a.gates, *b.gates)]
    R = rank_penalty(model)
    # alive entries: a: 0.5, 2.0 + the other two gates of a (4 + 4 ones); b: 0.3 + the 3 other gates of b
    sizes_b = [int(g.numel()) for g in b.gates]
    alive = 2 + 8 + 1 + (sum(sizes_b) - sizes_b[1])
    total = 0.5 + 2.0 + 8 + 0.3 + (sum(sizes_b) - sizes_b[1])
    assert R.item() == pytest.approx(total / alive)
    R.backward()
    assert torch.equal(a.gate.grad.split(a.bond_dims())[0], torch.tensor([1.0, 0.0, 1.0, 0.0]) / alive)
    assert torch.equal(b.gate.grad.split(b.bond_dims())[1], torch.tensor([0.0, 1.0, 0.0]) / alive)
    assert torch.equal(b.gate.grad.split(b.bond_dims())[0], torch.ones(sizes_b[0]) / alive)
    assert all(g.grad is None for g in a.cores)  # R depends on gates only
    # pure: the stored gates are untouched and a second call gives the same value
    assert all(torch.equal(x, y.detach()) for x, y in zip(before, (*a.gates, *b.gates)))
    assert rank_penalty(model).item() == R.item()


def test_gathered_gate_list_gives_the_same_value():
    model = _model(tau_b=0.2)
    with torch.no_grad():
        model[2].gates[0].mul_(0.1)  # all of this bond falls below its tau 0.2 (ones * 0.1)
    gates = [*model[0].gates, *model[2].gates]
    taus = [model[0].tau] * 3 + [model[2].tau] * 5
    assert penalty_from_gates(gates, taus).item() == pytest.approx(rank_penalty(model).item())
    assert penalty_from_gates(gates, taus).item() == pytest.approx(1.0)  # the dead bond is left out


def test_all_gates_dead_gives_zero_not_nan():
    R = penalty_from_gates([torch.zeros(3, requires_grad=True)], 1e-2)
    assert R.item() == 0.0 and R.requires_grad


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="has no tensorized layer"):
        rank_penalty(nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"tau for gates\[0\] must be > 0, got 0.0"):
        penalty_from_gates([torch.ones(3)], 0.0)
    with pytest.raises(ValueError, match=r"gates\[1\] must be 1-D, got shape \(2, 2\)"):
        penalty_from_gates([torch.ones(3), torch.ones(2, 2)], 1e-2)
    with pytest.raises(ValueError, match="2 gate vectors but 1 taus"):
        penalty_from_gates([torch.ones(3), torch.ones(2)], [1e-2])
    with pytest.raises(ValueError, match="1 gate vectors but 2 taus"):  # not cut short by a zip
        penalty_from_gates([torch.ones(3)], [1e-2, 0.2])


def test_penalty_costs_a_fixed_handful_of_ops_whatever_the_gate_lengths():
    """A prune leaves every layer's gate vector its own length: R stays one concatenated threshold."""
    from comera_dist.bench.ops import OpCounter

    g = torch.Generator().manual_seed(0)
    gates = [torch.rand(n, generator=g, requires_grad=True) for n in range(3, 23)]  # 20 distinct lengths
    taus = [torch.tensor(0.2 + 0.01 * i) for i in range(len(gates))]
    with OpCounter() as ops:
        R = penalty_from_gates(gates, taus)
    assert sum(ops.ops.values()) - ops.views <= 16 and not ops.syncs, ops.ops  # was ~6 per distinct length
    alive = [x > t for x, t in zip(gates, taus)]
    want = sum((x * a).sum() for x, a in zip(gates, alive)) / sum(a.sum() for a in alive)
    torch.testing.assert_close(R, want)
    got_g = torch.autograd.grad(R, gates)
    want_g = torch.autograd.grad(want, gates)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b)


def test_an_integer_threshold_applies_to_every_gate():
    """tau given as a Python int (1) is one threshold for all gate vectors, like a float."""
    gates = [torch.tensor([0.5, 2.0, 1.0]), torch.tensor([3.0, 0.9])]  # alive (> 1): 2.0 and 3.0
    assert penalty_from_gates(gates, 1).item() == pytest.approx((2.0 + 3.0) / 2)


def test_bf16_gates_are_counted_exactly_past_bf16_integer_precision():
    """bf16 holds integers exactly only up to 256: the sum and the count of 1001 alive bf16 gates are
    kept in fp32 or wider, so R of all-ones gates is exactly 1 (a bf16 count would read 1000)."""
    gates = [torch.ones(600, dtype=torch.bfloat16), torch.ones(401, dtype=torch.bfloat16)]
    R = penalty_from_gates(gates, 1e-2)
    assert R.dtype == torch.float32 and R.item() == 1.0
    gates[1][:] = 0.5  # total 600 + 200.5 over 1001 alive
    assert penalty_from_gates(gates, 1e-2).item() == pytest.approx(800.5 / 1001, rel=1e-6)

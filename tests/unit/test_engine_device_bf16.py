"""bf16 numerics of the TT layers and the rank state, on CPU.

* The batch-independent builds (L, R, TTM halves) are computed in fp32: from bf16 cores they
  equal the exact (fp64) product rounded once to bf16, within one bf16 ulp.
* TT linear (every contraction order) and TT embedding under ``torch.autocast('cpu', bf16)`` and
  as ``.bfloat16()`` modules (DeepSpeed's bf16 cast) match the fp64 reference within a bound
  derived from the plain bf16 path's own error (a dense bf16 matmul/lookup of the same weight).
* Gates near tau: the forward mask, the active ranks (S), the penalty's surviving set (R) and the
  pruning plan agree when the fp32 master rounds to a bf16 working gate on the other side of tau.
"""

from __future__ import annotations

import copy

import pytest
import torch

from comera_dist.compression.config import ControllerConfig
from comera_dist.compression.controller import RankController
from comera_dist.compression.penalty import penalty_from_gates
from comera_dist.compression.pruning import make_plan
from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.layers.base import gate_alive
from comera_dist.tensor import contract
from comera_dist.tensor.tt import chain

BF16 = torch.bfloat16


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach()
    return float((y.detach().double() - ref).abs().max() / ref.abs().max())


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - 7)


def _random_gates(layer: torch.nn.Module) -> None:
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)


def test_builds_from_bf16_cores_are_rounded_once():
    torch.manual_seed(0)
    cores = [torch.randn(r0, n, r1).to(BF16) for r0, n, r1 in ((1, 4, 8), (8, 4, 8), (8, 4, 8))]
    masks = [torch.rand(8).to(BF16) + 0.5 for _ in range(3)]
    exact = chain([c.double() for c in cores], [m.double() for m in masks])
    got = chain(cores, masks)
    assert got.dtype == BF16
    assert bool(((got.double() - exact).abs() <= _ulp_bf16(exact)).all())
    L = contract.contract_left(cores, masks)
    assert torch.equal(L, got.reshape(L.shape))
    ttm = [torch.randn(1, 4, 3, 6).to(BF16), torch.randn(6, 5, 4, 6).to(BF16), torch.randn(6, 3, 2, 1).to(BF16)]
    A, B = contract.ttm_pair_contract(ttm, None)
    A_ref, B_ref = contract.ttm_pair_contract([c.double() for c in ttm], None)
    for t, ref in ((A, A_ref), (B, B_ref)):
        assert t.dtype == BF16 and bool(((t.double() - ref).abs() <= _ulp_bf16(ref)).all())


def test_builds_under_autocast_stay_fp32():
    cores = [torch.randn(1, 4, 8), torch.randn(8, 4, 1)]
    with torch.autocast("cpu", BF16):
        z = chain(cores, None)
    assert z.dtype == torch.float32
    torch.testing.assert_close(z.double(), chain([c.double() for c in cores], None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["lr", "sequential", "dense"])
def test_tt_linear_bf16_within_the_plain_bf16_error(order):
    torch.manual_seed(0)
    layer = TTLinear(64, 96, num_cores=6, max_rank=8)
    _random_gates(layer)
    x = torch.randn(256, 64)
    ref = copy.deepcopy(layer).double()
    ref.order = order
    y_ref = ref(x.double())
    W = ref.to_dense().detach()
    plain = _rel((x.to(BF16) @ W.to(BF16)).double() + ref.bias.detach().to(BF16).double(), y_ref)
    # Each bf16 rounding of an operand costs about the plain path's error. Autocast rounds x, L/R (or
    # W) and the rank-r intermediate; the module cast also rounds each of the D stored cores.
    auto = copy.deepcopy(layer)
    auto.order = order
    with torch.autocast("cpu", BF16):
        y_auto = auto(x)
    assert y_auto.dtype == BF16
    assert _rel(y_auto, y_ref) <= 3 * plain
    cast = copy.deepcopy(layer).bfloat16()
    cast.order = order
    y_cast = cast(x.to(BF16))
    assert y_cast.dtype == BF16
    assert _rel(y_cast, y_ref) <= (2 + layer.num_cores) * plain
    y_cast.float().sum().backward()  # DeepSpeed's bf16 module trains: gradients reach every core in bf16
    assert cast.core.grad is not None and cast.core.grad.dtype == BF16 and torch.isfinite(cast.core.grad).all()


def test_tt_embedding_bf16_within_the_plain_bf16_error():
    torch.manual_seed(0)
    emb = TTEmbedding(100, 48, num_cores=4, max_rank=8)
    _random_gates(emb)
    ids = torch.randint(0, 100, (64,))
    ref = copy.deepcopy(emb).double()
    y_ref = ref(ids)
    plain = _rel(ref.to_dense().detach().to(BF16)[ids].double(), y_ref)
    with torch.autocast("cpu", BF16):
        y_auto = emb(ids)
    assert _rel(y_auto, y_ref) <= 3 * plain
    y_cast = copy.deepcopy(emb).bfloat16()(ids)
    assert y_cast.dtype == BF16 and _rel(y_cast, y_ref) <= (2 + emb.num_cores) * plain


def test_tau_stays_fp32_under_a_module_cast():
    layer = TTLinear(16, 16, num_cores=4, max_rank=4, tau=0.97).bfloat16()
    assert layer.tau.dtype == torch.float32 and float(layer.tau) == pytest.approx(0.97)
    assert layer.gates[0].dtype == BF16


def test_gates_near_tau_agree_between_masters_and_working_copy():
    """fp32 masters on both sides of where bf16 rounding crosses tau = 0.97 (bf16 spacing there: 2^-8)."""
    tau = 0.97
    master = TTLinear(16, 16, num_cores=4, max_rank=4, tau=tau)
    values = torch.tensor([0.9702, 0.9699, 0.9725, 1.0])  # bf16: 0.96875 (dead), dead, 0.97265625, alive
    with torch.no_grad():
        for g in master.gates:
            g.copy_(values[: g.numel()])
    working = copy.deepcopy(master).bfloat16()  # what DeepSpeed bf16 computes with
    truth = [gate_alive(g.detach(), working.tau) for g in working.gates]
    assert [t[:3].tolist() for t in truth] == [[False, False, True]] * len(truth)
    # the fp32 master alone would count 0.9702 as alive: the case is real
    assert bool(master.gates[0][0] > tau)
    # forward mask, ranks (S), penalty set (R), plan: all the working copy's
    masks = working.masked_gates()
    assert [(m != 0).tolist() for m in masks] == [t.tolist() for t in truth]
    assert working.ranks() == [int(t.sum()) for t in truth]
    gates = [g.detach().float() for g in master.gates]
    R = penalty_from_gates(gates, [tau] * len(gates), working_dtype=BF16)
    alive = torch.cat([g[t] for g, t in zip(gates, truth)])
    assert float(R) == pytest.approx(float(alive.sum() / alive.numel()))
    plan = make_plan(master, working_dtype=BF16)
    name = next(iter(plan.kept)) if plan.kept else None
    assert name is not None
    assert all(plan.kept[name][k] == torch.nonzero(truth[k]).flatten().tolist() for k in plan.kept[name])
    assert make_plan(master).kept != plan.kept  # without the working dtype the plan keeps 0.9702


def test_controller_objective_is_fp32_for_a_bf16_task_loss():
    c = RankController(ControllerConfig(gamma=0.01, tau=0.01))
    task = torch.tensor(6.123, dtype=BF16, requires_grad=True)
    out = c.objective(task, torch.tensor(0.5), global_loss=6.1, global_size=100)
    assert out.dtype == torch.float32
    out.backward()
    assert task.grad is not None and task.grad.dtype == BF16

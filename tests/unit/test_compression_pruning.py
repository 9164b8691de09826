"""Physical pruning: plan, real shrink, unchanged output, sliced AdamW state, rebuild from the plan."""

import copy
import json

import pytest
import torch
from torch import nn

from comera_dist.compression.accounting import compression_report
from comera_dist.compression.config import LrConfig, PruningConfig
from comera_dist.compression.groups import param_groups
from comera_dist.compression.pruning import (
    PruningPlan,
    apply_plan,
    bond_dims,
    make_plan,
    plan_to_bond_dims,
    prune_due,
)
from comera_dist.layers.embedding import TTEmbedding
from comera_dist.layers.linear import TTLinear


class Net(nn.Module):
    """TTM embedding (3 cores) -> TT (4 cores) -> LayerNorm -> TT (6 cores), plus a TT side branch."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = TTEmbedding(20, 12, num_cores=3, max_rank=4, generator=g)
        self.up = TTLinear(12, 16, num_cores=4, max_rank=4, generator=g)
        self.norm = nn.LayerNorm(16)
        self.down = TTLinear(16, 12, num_cores=6, max_rank=3, generator=g)
        self.side = TTLinear(12, 12, num_cores=4, max_rank=3, generator=g)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # (B, T, 12)
        return self.down(torch.relu(self.norm(self.up(h)))) + self.side(h)  # (B, T, 12)


IDS = torch.arange(20).reshape(4, 5)


def _gated_net() -> Net:
    """Random gate values in (0.5, 1.5) with some ranks dead; bond 1 of `side` entirely dead."""
    net = Net(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in (net.emb, net.up, net.down, net.side):
            for gate in layer.gates:
                gate.copy_(0.5 + torch.rand(gate.shape, generator=g))
        net.emb.gates[0][[0, 2]] = torch.tensor([0.004, -0.3])  # below tau (incl. negative)
        net.up.gates[1][[1]] = 0.01  # exactly tau: dead (m(g) = g * [g > tau])
        net.up.gates[2][[0, 3]] = 0.0
        net.down.gates[3][[1]] = -0.5
        net.side.gates[1].copy_(torch.tensor([0.002, 0.009, -0.001]))  # whole bond dead
    return net


def _train(net: Net, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        net(IDS).square().mean().backward()
        opt.step()


def test_make_plan_keeps_gates_above_tau_with_min_rank_floor():
    net = _gated_net()
    plan = make_plan(net, min_rank=2)
    assert plan.kept == {
        "emb": {0: [1, 3]},
        "up": {1: [0, 2, 3], 2: [1, 2]},
        "down": {3: [0, 2]},
        "side": {1: [0, 1]},  # all dead: the 2 largest gates (0.002, 0.009) survive
    }
    assert plan.bond_dims == {"emb": [4, 4], "up": [4, 4, 4], "down": [3, 3, 3, 3, 3], "side": [3, 3, 3]}
    assert make_plan(net).kept["side"] == {1: [1]}  # min_rank 1: the single largest
    # a floor above every bond's size (4 at most) keeps each whole, `side`'s dead bond too, not a top-k past its end
    assert make_plan(net, min_rank=5).is_empty()
    assert make_plan(Net(seed=0)).is_empty()
    with pytest.raises(ValueError, match="min_rank must be >= 1, got 0"):
        make_plan(net, min_rank=0)


def test_apply_plan_shrinks_shapes_and_keeps_the_output():
    net = _gated_net()
    masked = net(IDS)  # (4, 5, 12) the masked model
    size = compression_report(net)["size"]
    plan = make_plan(net)
    apply_plan(net, plan)
    assert bond_dims(net) == plan.bond_dims_after() == {"emb": [2, 4], "up": [4, 3, 2], "down": [3, 3, 3, 2, 3],
                                                            "side": [3, 1, 3]}
    assert [(c.shape[0], c.shape[-1]) for c in net.up.cores] == [(1, 4), (4, 3), (3, 2), (2, 1)]
    assert net.emb.cores[0].shape[-1] == 2 and net.emb.cores[1].shape[0] == 2
    assert net.side.cores[1].shape[-1] == 1 and net.side.cores[2].shape[0] == 1
    assert net.down.cores[3].shape[-1] == 2 and net.down.cores[4].shape[0] == 2
    pruned = net(IDS)
    rel = ((pruned - masked).norm() / masked.norm()).item()
    assert rel <= 1e-6, rel
    rep = compression_report(net)
    assert rep["size"] == size
    for name in ("emb", "up", "down"):  # nothing dead is stored any more
        assert rep["layers"][name]["physical_params"] == rep["layers"][name]["active_params"], name
    # except the min_rank floor: `side` keeps one dead rank on its dead bond
    assert (rep["layers"]["side"]["ranks"], rep["layers"]["side"]["bond_dims"]) == ([3, 0, 3], [3, 1, 3])


def test_adamw_state_is_sliced_and_training_continues_identically():
    net = _gated_net()
    opt = torch.optim.AdamW(param_groups(net, LrConfig(cores=1e-2, gates=1e-2, dense=1e-2, weight_decay=0.01)))
    _train(net, opt, steps=2)
    # the masked twin: same parameters and optimizer state, never pruned
    twin = copy.deepcopy(net)
    twin_opt = torch.optim.AdamW(param_groups(twin, LrConfig(cores=1e-2, gates=1e-2, dense=1e-2, weight_decay=0.01)))
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict would share tensors
    plan = make_plan(net)
    apply_plan(net, plan, opt)

    # the optimizer now holds exactly the model's (new) parameters
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in net.parameters()} and len(held) == len(list(net.parameters()))
    assert all(p in opt.state for p in held)
    # moments equal the kept slices of the twin's moments, computed here independently
    idx = {name: {b: torch.tensor(k) for b, k in bonds.items()} for name, bonds in plan.kept.items()}
    checked = 0
    for name, bonds in idx.items():
        layer, twin_layer = getattr(net, name), getattr(twin, name)
        for key in ("exp_avg", "exp_avg_sq"):  # the flat core's moments, core by core
            got = layer.split_cores(opt.state[layer.core][key])
            for j, want in enumerate(twin_layer.split_cores(twin_opt.state[twin_layer.core][key])):
                if j - 1 in bonds:
                    want = want.index_select(0, bonds[j - 1])
                if j in bonds:
                    want = want.index_select(want.dim() - 1, bonds[j])
                assert torch.equal(got[j], want), (name, j, key)
                checked += 1
        assert torch.equal(opt.state[layer.core]["step"], twin_opt.state[twin_layer.core]["step"])
        for key in ("exp_avg", "exp_avg_sq"):  # the gate vector's moments, bond by bond
            got = opt.state[layer.gate][key].split(layer.bond_dims())
            for b, full in enumerate(twin_opt.state[twin_layer.gate][key].split(twin_layer.bond_dims())):
                assert torch.equal(got[b], full[bonds[b]] if b in bonds else full), (name, b, key)
    assert checked == 2 * (3 + 4 + 6 + 4)

    # one more AdamW step on each: the pruned parameters equal the kept slices of the masked ones
    _train(net, opt, steps=1)
    _train(twin, twin_opt, steps=1)
    for name, bonds in idx.items():
        for j, (core, twin_core) in enumerate(zip(getattr(net, name).cores, getattr(twin, name).cores)):
            want = twin_core.detach()
            if j - 1 in bonds:
                want = want.index_select(0, bonds[j - 1])
            if j in bonds:
                want = want.index_select(want.dim() - 1, bonds[j])
            torch.testing.assert_close(core.detach(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net(IDS), twin(IDS), rtol=1e-5, atol=1e-6)


def test_fresh_model_built_from_the_plan_loads_the_pruned_state_dict():
    net = _gated_net()
    plan = make_plan(net)
    apply_plan(net, plan)
    state = net.state_dict()

    with pytest.raises(ValueError, match=r"state_dict\['emb.bond_sizes'\] is \[2, 4\] but this TTEmbedding has bond sizes \[4, 4\]"):
        Net(seed=5).load_state_dict(state)  # unpruned shapes are refused, by name

    fresh = Net(seed=5)
    apply_plan(fresh, PruningPlan.from_json(plan.to_json()))
    fresh.load_state_dict(state)
    assert torch.equal(fresh(IDS), net(IDS))

    # or layer by layer, from the modes and the plan's ranks alone
    ranks = [1, *plan.bond_dims_after()["up"], 1]
    up = TTLinear(12, 16, in_modes=net.up.in_modes, out_modes=net.up.out_modes, ranks=ranks)
    up.load_state_dict(net.up.state_dict())
    x = torch.randn(3, 12)
    assert torch.equal(up(x), net.up(x))


def test_plan_json_round_trip():
    plan = make_plan(_gated_net())
    text = plan.to_json()
    assert json.loads(text)["kept"]["up"] == {"1": [0, 2, 3], "2": [1, 2]}
    assert PruningPlan.from_json(text) == plan


def test_bad_plans_are_clear_errors():
    net = _gated_net()
    dims = bond_dims(net)
    with pytest.raises(ValueError, match=r"layers the model does not have: \['nope'\]"):
        apply_plan(net, PruningPlan(kept={"nope": {0: [0]}}, bond_dims={"nope": [4]}))
    with pytest.raises(ValueError, match=r"layer 'up' bond 3: bond out of range, the layer has 3 interior bonds"):
        PruningPlan(kept={"up": {3: [0]}}, bond_dims=dims)
    with pytest.raises(ValueError, match=r"layer 'up' bond 0: kept indices \[0, 4\] out of range for bond size 4"):
        PruningPlan(kept={"up": {0: [0, 4]}}, bond_dims=dims)
    with pytest.raises(ValueError, match=r"ascending and unique, got \[2, 1\]"):
        PruningPlan(kept={"up": {0: [2, 1]}}, bond_dims=dims)
    with pytest.raises(ValueError, match=r"ascending and unique, got \[1, 1\]"):  # would duplicate a rank
        PruningPlan(kept={"up": {0: [1, 1]}}, bond_dims=dims)
    with pytest.raises(ValueError, match=r"bond 0: kept indices are empty"):
        PruningPlan(kept={"up": {0: []}}, bond_dims=dims)
    with pytest.raises(ValueError, match=r"expected keys \['bond_dims', 'kept'\], got \['kept'\]"):
        PruningPlan.from_json('{"kept": {}}')
    plan = make_plan(net)
    apply_plan(net, plan)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"layer 'emb' has bond sizes \[2, 4\], the plan was made for \[4, 4\]"):
        apply_plan(net, plan)  # applying the same plan twice
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # nothing was touched


def test_resize_from_checkpointed_bond_dims():
    net = _gated_net()
    apply_plan(net, make_plan(net))
    dims = bond_dims(net)  # what the engine stores beside the checkpoint
    fresh = Net(seed=7)
    apply_plan(fresh, plan_to_bond_dims(fresh, json.loads(json.dumps(dims))))
    fresh.load_state_dict(net.state_dict())
    assert bond_dims(fresh) == dims and torch.equal(fresh(IDS), net(IDS))
    with pytest.raises(ValueError, match=r"layer 'up' bond 0 size 5 outside \[1, 4\]"):
        plan_to_bond_dims(Net(seed=7), {"up": [5, 4, 4]})
    with pytest.raises(ValueError, match=r"layer 'up' has 3 bonds, dims gives \[4\]"):
        plan_to_bond_dims(Net(seed=7), {"up": [4]})
    with pytest.raises(ValueError, match=r"layers the model does not have: \['nope'\]"):
        plan_to_bond_dims(Net(seed=7), {"nope": [1]})


@pytest.mark.parametrize(
    ("every", "start", "due_steps"),
    [(0, 0, []), (3, 0, [3, 6, 9]), (4, 5, [5, 9]), (1, 8, [8, 9, 10])],
)
def test_prune_due_schedule(every, start, due_steps):
    cfg = PruningConfig(every=every, start_step=start)
    assert [s for s in range(11) if prune_due(cfg, s)] == due_steps


def test_a_pruned_optimizer_drops_the_old_parameters_and_checkpoints():
    """After a prune the optimizer state holds only the new Parameters: the old ones' full-size moments
    are released, and ``optimizer.state_dict()`` (the checkpoint) still works and reloads."""
    net = _gated_net()
    opt = torch.optim.AdamW(param_groups(net, LrConfig(cores=1e-2, gates=1e-2, dense=1e-2)))
    _train(net, opt, steps=1)
    old = {id(net.up.core), id(net.up.gate), id(net.emb.core), id(net.side.gate)}
    apply_plan(net, make_plan(net), opt)
    assert {id(p) for p in opt.state} == {id(p) for p in net.parameters()}
    assert not old & {id(p) for p in opt.state}
    state = opt.state_dict()
    assert len(state["state"]) == len(list(net.parameters())) == 13
    again = torch.optim.AdamW(param_groups(net, LrConfig(cores=1e-2, gates=1e-2, dense=1e-2)))
    again.load_state_dict(state)
    assert torch.equal(again.state[net.up.core]["exp_avg"], opt.state[net.up.core]["exp_avg"])


def test_plan_to_bond_dims_of_the_current_sizes_removes_nothing():
    """Resuming an unpruned checkpoint: the plan is empty (no rebuild), and a size 0 is refused by range."""
    net = Net(seed=7)
    assert plan_to_bond_dims(net, bond_dims(net)).is_empty()
    plan = plan_to_bond_dims(net, {"up": [4, 2, 4], "down": [3, 3, 3, 3, 3]})
    assert plan.kept == {"up": {1: [0, 1]}}
    with pytest.raises(ValueError, match=r"layer 'up' bond 1 size 0 outside \[1, 4\]"):
        plan_to_bond_dims(net, {"up": [4, 0, 4]})


def test_a_prune_that_gives_other_shapes_than_the_plan_is_an_error(monkeypatch):
    """apply_plan checks the layer's ``prune_`` against the plan's slices before it touches the optimizer."""
    net = _gated_net()
    real = net.up.prune_

    def drops_one_more(index):  # a broken layer: keeps one index fewer on every bond
        real({b: i[:-1] for b, i in index.items()})

    monkeypatch.setattr(net.up, "prune_", drops_one_more)
    with pytest.raises(RuntimeError, match=r"apply_plan: prune_ produced shape \(\d+,\), expected \(\d+,\)"):
        apply_plan(net, make_plan(net))

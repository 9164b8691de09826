"""param_groups: roles by identity with the layers' ``core`` and ``gate`` parameters, never by name."""

import torch
from torch import nn

from comera_dist.compression.config import LrConfig
from comera_dist.compression.groups import param_groups
from comera_dist.layers.linear import TTLinear


class Misnamed(nn.Module):
    """A model whose names would fool name-based grouping."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        tt = TTLinear(8, 8, num_cores=4, max_rank=2, generator=g)
        # Registered first, so named_parameters() reports the flat cores as "layernorm_bias" and the
        # gate vector as "dense_gate_weight"; both are the same objects as tt.core / tt.gate.
        self.layernorm_bias = tt.core
        self.dense_gate_weight = tt.gate
        self.layernorm = tt  # a TT layer under a norm-like module name
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)


def _by_name(groups):
    return {g["name"]: g for g in groups}


def test_groups_by_role_with_documented_lrs():
    model = Misnamed()
    names = {id(p): n for n, p in model.named_parameters()}
    assert names[id(model.layernorm.core)] == "layernorm_bias"  # the trap is really set
    assert names[id(model.layernorm.gate)] == "dense_gate_weight"
    lr = LrConfig(weight_decay=0.1)
    groups = _by_name(param_groups(model, lr))
    assert list(groups) == ["cores", "gates", "dense"]
    ids = {k: {id(p) for p in g["params"]} for k, g in groups.items()}
    assert ids["cores"] == {id(model.layernorm.core)}
    assert ids["gates"] == {id(model.layernorm.gate)}
    dense = [model.layernorm.bias, model.norm.weight, model.norm.bias, model.head.weight, model.head.bias]
    assert ids["dense"] == {id(p) for p in dense}
    # every trainable parameter exactly once, the frozen one nowhere
    flat = [id(p) for g in groups.values() for p in g["params"]]
    assert len(flat) == len(set(flat)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert id(model.frozen) not in flat
    assert [(g["lr"], g["weight_decay"]) for g in groups.values()] == [(1e-4, 0.1), (1e-3, 0.0), (5e-5, 0.1)]


def test_defaults_and_usable_by_adamw():
    model = Misnamed()
    groups = param_groups(model, LrConfig())
    assert [(g["name"], g["lr"]) for g in groups] == [("cores", 1e-4), ("gates", 1e-3), ("dense", 5e-5)]
    opt = torch.optim.AdamW(groups)
    before = model.layernorm.gates[0].detach().clone()
    model.layernorm(torch.randn(5, 8)).square().sum().backward()
    opt.step()
    # Adam's first step moves each entry by ~lr: the gate group really runs at 1e-3
    step = (model.layernorm.gates[0].detach() - before).abs()
    assert torch.allclose(step, torch.full_like(step, 1e-3), rtol=1e-3)


def test_model_without_tt_layers_is_all_dense():
    groups = param_groups(nn.Linear(4, 4), LrConfig())
    assert [g["name"] for g in groups] == ["dense"] and len(groups[0]["params"]) == 2

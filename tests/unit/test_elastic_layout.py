"""``elastic.upgrade_layout``: consolidated states of older parameter layouts into the flat one, and the
bond-size check of ``prune.load_full_state`` that the flat layout needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_dist.engine.elastic import full_state, upgrade_layout
from comera_dist.engine.prune import load_full_state
from comera_dist.layers import TTEmbedding, TTLinear


class _Net(nn.Module):
    def __init__(self, ranks: list[int]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = TTEmbedding(30, 8, num_cores=3, max_rank=3, generator=g)
        self.proj = TTLinear(64, 64, in_modes=[8, 8], out_modes=[8, 8], ranks=ranks, generator=g)


def _payload(net: nn.Module) -> dict:
    """The consolidated state of ``net`` as this version writes it (random moments)."""
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    moments = {n: {k: torch.randn(p.shape) for k in ("exp_avg", "exp_avg_sq")} for n, p in params.items()}
    return {"params": params, "buffers": {n: b.clone() for n, b in net.named_buffers()}, "moments": moments,
            "step": 3, "client": {}}


def _older(payload: dict, net: nn.Module, layout: int) -> dict:
    """``payload`` as layout 1 (one parameter per core and per bond) or 2 (per core) wrote it: the
    pieces' shapes come from the layers, and the ``bond_sizes`` buffer did not exist."""
    params, moments = dict(payload["params"]), dict(payload["moments"])
    buffers = {n: b for n, b in payload["buffers"].items() if not n.endswith("bond_sizes")}
    for name, layer in (("emb", net.emb), ("proj", net.proj)):
        cut = {"core": (layer.split_cores, "cores")}
        if layout == 1:
            cut["gate"] = (lambda t, lay=layer: t.split(lay.bond_dims()), "gates")
        for leaf, (split, old) in cut.items():
            flat, state = params.pop(f"{name}.{leaf}"), moments.pop(f"{name}.{leaf}")
            for k, piece in enumerate(split(flat)):
                params[f"{name}.{old}.{k}"] = piece.clone()
                moments[f"{name}.{old}.{k}"] = {m: split(v)[k].clone() for m, v in state.items()}
    return {**payload, "params": params, "moments": moments, "buffers": buffers}


@pytest.mark.parametrize("layout", [1, 2])
def test_older_layouts_become_the_flat_one_with_their_bond_sizes(layout):
    net = _Net([1, 2, 4, 4, 1])
    net.emb.prune_({0: torch.tensor([0, 2])})
    new = _payload(net)
    old = _older(new, net, layout)
    assert "proj.cores.3" in old["params"] and ("proj.gates.0" in old["params"]) == (layout == 1)
    got = upgrade_layout(old)
    assert sorted(got["params"]) == sorted(new["params"]) and sorted(got["buffers"]) == sorted(new["buffers"])
    for name, t in new["params"].items():
        assert torch.equal(got["params"][name], t), name
        for k, m in new["moments"][name].items():
            assert torch.equal(got["moments"][name][k], m), (name, k)
    assert got["buffers"]["proj.bond_sizes"].tolist() == [2, 4, 4]
    assert got["buffers"]["emb.bond_sizes"].tolist() == net.emb.bond_dims() == [2, 3]
    fresh = _Net([1, 2, 4, 4, 1])
    fresh.emb.prune_({0: torch.tensor([0, 1])})
    load_full_state(fresh, full_state(got, torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), net.parameters(), strict=True))


def test_a_state_of_other_bond_sizes_is_refused_even_at_equal_element_counts():
    """Ranks [2, 4, 4] and [4, 4, 2] of mirror-image modes hold the same 240 core entries."""
    src = _Net([1, 2, 4, 4, 1])
    dst = _Net([1, 4, 4, 2, 1])
    assert src.proj.core.shape == dst.proj.core.shape
    with pytest.raises(ValueError, match=r"proj: the state's bond sizes \[2, 4, 4\] differ from the model's \[4, 4, 2\]"):
        load_full_state(dst, full_state(_payload(src), torch.device("cpu")))
    legacy = upgrade_layout(_older(_payload(src), src, 1))  # the pieces' shapes survive the upgrade as bond sizes
    with pytest.raises(ValueError, match=r"proj: the state's bond sizes \[2, 4, 4\] differ"):
        load_full_state(dst, full_state(legacy, torch.device("cpu")))


def test_an_infinite_weight_is_reported_as_nonfinite():
    from comera_dist.engine.elastic import nonfinite_entries

    payload = {"params": {"u": torch.tensor([1.0, float("inf")]), "w": torch.tensor([float("-inf")])},
               "moments": {}}
    assert nonfinite_entries(payload) == ["u", "w"]

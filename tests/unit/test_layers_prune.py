"""Physical pruning (``prune_``), rebuilding from ``tensor_shapes()`` and state_dict shape checks."""

import re

import pytest
import torch

from comera_dist.layers import TTEmbedding, TTLinear


def _kill(layer, dead):
    """Push chosen gate entries below tau; returns the kept indices per bond."""
    with torch.no_grad():
        for k, idx in dead.items():
            layer.gates[k][idx] = 0.004
    return {k: (g.detach() > layer.tau).nonzero().squeeze(1) for k, g in enumerate(layer.gates)}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("order", ["lr", "sequential", "dense"])
def test_tt_linear_prune_keeps_the_output_and_shrinks(order):
    torch.manual_seed(0)
    layer = TTLinear(768, 768, order=order)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.2, 2.0)  # continuous gate values: pruning must keep them (or fold them)
    kept = _kill(layer, {0: [0, 5], 2: list(range(0, 30, 3)), 4: [11]})
    x = torch.randn(64, 768)
    y_masked = layer(x)
    active = layer.param_count(active=True)
    layer.prune_(kept)
    assert layer.bond_dims() == [10, 30, 20, 30, 11] == layer.ranks()
    assert layer.param_count(active=False) == active == sum(c.numel() for c in layer.cores)
    assert _rel(layer(x), y_masked) < 1e-6
    # A fresh model built from the shapes loads the pruned state_dict and computes the same.
    fresh = TTLinear(768, 768, **layer.tensor_shapes(), order=order)
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    # The pruned parameters are trainable leaves.
    layer(x).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


def test_tt_embedding_prune_keeps_the_output():
    torch.manual_seed(0)
    emb = TTEmbedding(1000, 48, num_cores=4, max_rank=12, padding_idx=0)
    with torch.no_grad():
        for g in emb.gates:
            g.uniform_(0.2, 2.0)
    kept = _kill(emb, {0: [1, 2, 3], 1: [0], 2: list(range(6))})
    ids = torch.randint(0, 1000, (5, 9))
    y = emb(ids)
    emb.prune_(kept)
    assert emb.bond_dims() == [9, 11, 6]
    assert _rel(emb(ids), y) < 1e-6
    fresh = TTEmbedding(1000, 48, **emb.tensor_shapes(), padding_idx=0)
    fresh.load_state_dict(emb.state_dict())
    torch.testing.assert_close(fresh(ids), emb(ids), rtol=0, atol=0)


def test_loading_a_pruned_state_into_the_wrong_shapes_names_key_and_shapes():
    layer = TTLinear(24, 30, num_cores=4, max_rank=4)
    pruned = TTLinear(24, 30, num_cores=4, max_rank=4)
    pruned.prune_({1: torch.tensor([0, 2])})
    with pytest.raises(ValueError, match=r"state_dict\['bond_sizes'\] is \[4, 2, 4\] but this TTLinear has bond sizes "
                                         r"\[4, 4, 4\].*ranks=\[1, 4, 2, 4, 1\]"):
        layer.load_state_dict(pruned.state_dict())
    # Equal element counts are not equal shapes: ranks [2, 4, 4] and [4, 4, 2] of mirror-image modes both
    # hold 240 core and 10 gate entries; the flat core alone would load, scrambled.
    a = TTLinear(64, 64, in_modes=[8, 8], out_modes=[8, 8], ranks=[1, 2, 4, 4, 1])
    b = TTLinear(64, 64, in_modes=[8, 8], out_modes=[8, 8], ranks=[1, 4, 4, 2, 1])
    assert a.core.shape == b.core.shape and a.gate.shape == b.gate.shape
    with pytest.raises(ValueError, match=r"state_dict\['bond_sizes'\] is \[2, 4, 4\] but this TTLinear has bond sizes \[4, 4, 2\]"):
        b.load_state_dict(a.state_dict())
    # Without the record (a hand-made state), a wrong element count is still named with the layer's shapes.
    bad = {k: v for k, v in pruned.state_dict().items() if k != "bond_sizes"}
    shapes = re.escape(str(layer.core_shapes()))
    with pytest.raises(ValueError, match=rf"state_dict\['core'\] has shape \({pruned.core.numel()},\) but this "
                                         rf"TTLinear expects \({layer.core.numel()},\) \(core shapes {shapes}\)"):
        layer.load_state_dict(bad)
    outer = torch.nn.Sequential(TTEmbedding(30, 8, num_cores=2, max_rank=4))
    bad = outer.state_dict()
    bad["0.gate"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"state_dict\['0.gate'\] has shape \(3,\) but this TTEmbedding expects \(4,\)"):
        outer.load_state_dict(bad)


def test_a_state_dict_with_one_parameter_per_core_and_per_bond_still_loads():
    """Checkpoints written before the flat layout hold ``cores.k`` per core and ``gates.k`` per bond:
    they load, in order, and a piece of the wrong shape is an error naming it."""
    src = TTLinear(24, 30, num_cores=4, max_rank=4)
    src.prune_({1: torch.tensor([0, 2])})
    with torch.no_grad():
        src.gate.copy_(torch.randn(src.gate.shape))
    old = {k: v for k, v in src.state_dict().items() if k not in ("gate", "core")}
    old.update({f"gates.{k}": g.clone() for k, g in enumerate(src.gates)})  # (4,), (2,), (4,)
    old.update({f"cores.{k}": c.clone() for k, c in enumerate(src.cores)})  # (1, 6, 4), (4, 4, 2), ...
    dst = TTLinear(24, 30, num_cores=4, max_rank=4)
    dst.prune_({1: torch.tensor([0, 1])})
    dst.load_state_dict(dict(old))
    assert torch.equal(dst.gate, src.gate) and dst.ranks() == src.ranks() and torch.equal(dst.core, src.core)
    x = torch.randn(3, 24)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    bad = {**old, "gates.1": torch.ones(3)}
    with pytest.raises(ValueError, match=r"state_dict\['gates.1'\] has shape \(3,\) but this TTLinear expects \(2,\)"):
        dst.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"state_dict\['cores.1'\] has shape \(4, 4, 2\) but this TTLinear "
                                         r"expects \(4, 4, 4\).*ranks=\[1, 4, 2, 4, 1\]"):
        TTLinear(24, 30, num_cores=4, max_rank=4).load_state_dict(dict(old))


def test_prune_bad_input():
    layer = TTLinear(24, 30, num_cores=4, max_rank=4)
    for kept, match in [
        ({3: [0]}, r"kept has bond 3; bonds are 0..2"),
        ({1: []}, r"kept\[1\] is empty"),
        ({1: [0, 4]}, r"kept\[1\]=\[0, 4\] has indices outside 0..3"),
        ({1: [1, 1]}, r"kept\[1\]=\[1, 1\] has duplicate indices"),
    ]:
        with pytest.raises(ValueError, match=match):
            layer.prune_(kept)
    assert layer.bond_dims() == [4, 4, 4]  # a rejected plan changes nothing


def test_prune_keeps_the_output_for_unsorted_kept_indices():
    """``kept`` in any order: both neighbouring cores and the gate are sliced in that same order."""
    torch.manual_seed(0)
    layer = TTLinear(24, 30, num_cores=4, max_rank=4, dtype=torch.float64)
    with torch.no_grad():
        layer.gate.uniform_(0.5, 1.5)
        layer.gates[1][1] = 0.004  # dead: dropped below
    x = torch.randn(6, 24, dtype=torch.float64)
    y = layer(x)
    layer.prune_({1: torch.tensor([3, 0, 2])})
    assert layer.bond_dims() == [4, 3, 4]
    torch.testing.assert_close(layer(x), y)

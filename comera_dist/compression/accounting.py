"""Model size S, per-layer parameter/rank/FLOP accounting and compression ratios.

S (the size objective of the controller) is the number of core parameters counted with
the SURVIVING ranks: for core k of shape ``(r_{k-1}, modes..., r_k)`` it adds
``a_{k-1} * prod(modes) * a_k`` where ``a`` are the active ranks (``#(g > tau)``, boundary
ranks 1). TTM cores count both mode sizes ``m_k * n_k``. Gates are not counted: the
surviving gate values fold into the cores at export.

Core shapes come from the layers (``core_shapes()``, kept beside the flat ``core`` parameter) and
gate sizes through ``shape_of(param)`` (default ``ds_shape`` when present, else ``shape``), so the
counts hold when ZeRO-3 has partitioned the parameters. Active ranks need
the gate VALUES: under ZeRO-3 call these inside ``GatheredParameters`` over the gates
(a partitioned gate is an error, never a silent zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from comera_dist.compression.groups import param_roles
from comera_dist.compression.walk import tensorized_modules
from comera_dist.layers.base import gate_alive

ShapeOf = Callable[[torch.Tensor], Sequence[int]]


def default_shape_of(p: torch.Tensor) -> Sequence[int]:
    """The full shape of a parameter, also when ZeRO-3 partitioned it (``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def active_ranks(layer: nn.Module, shape_of: ShapeOf = default_shape_of) -> list[int]:
    """``#(g > tau)`` per interior bond of ``layer``; errors on a partitioned gate."""
    _check_full_gates(layer, shape_of)
    return [int(r) for r in layer.ranks()]


def core_params(core_shapes: Sequence[Sequence[int]], ranks: Sequence[int] | None = None) -> int:
    """Parameters of a core chain with shapes ``(r_{k-1}, modes..., r_k)``.

    ranks: interior ranks to count with (``len(core_shapes) - 1`` of them, each at most the
    physical bond size); ``None`` counts the physical shapes.
    """
    if ranks is None:
        return sum(math.prod(s) for s in core_shapes)
    if len(ranks) != len(core_shapes) - 1:
        raise ValueError(f"core_params: {len(core_shapes)} cores need {len(core_shapes) - 1} ranks, got {list(ranks)}")
    bounds = [core_shapes[0][0], *ranks, core_shapes[-1][-1]]
    for k, (r, s) in enumerate(zip(ranks, core_shapes)):
        if not 0 <= r <= s[-1]:
            raise ValueError(f"core_params: rank {k} = {r} outside [0, {s[-1]}] (bond size)")
    return sum(bounds[k] * math.prod(s[1:-1]) * bounds[k + 1] for k, s in enumerate(core_shapes))


def layer_size(layer: nn.Module, shape_of: ShapeOf = default_shape_of) -> int:
    """Surviving core parameters of one tensorized layer."""
    shapes = layer.core_shapes()
    return core_params(shapes, active_ranks(layer, shape_of))


def model_size(model: nn.Module, shape_of: ShapeOf = default_shape_of) -> int:
    """S: surviving core parameters over every tensorized layer of ``model``."""
    return sum(layer_size(layer, shape_of) for _, layer in tensorized_modules(model))


def model_size_tensor(model: nn.Module, shape_of: ShapeOf = default_shape_of) -> torch.Tensor:
    """S as a 0-d int64 tensor on the gates' device, with no host read (``model_size`` reads every
    gate back: one sync per gate on a GPU). Same value as ``model_size``; same ZeRO-3 rule. Code that
    needs S every step keeps one :class:`SizeCounter` instead (its plan is built once)."""
    return SizeCounter(model, shape_of)()


class SizeCounter:
    """S of ``model`` at its current shapes, as a 0-d int64 device tensor, in a fixed handful of ops.

    Walking every layer and bond costs about ten ops per core (1,794 per step on the six-encoder
    MLM). A call here is one ``g > tau`` over every layer's gate vector end to end, one
    ``index_add`` of the survivors into per-bond counts ``A`` (then a 1), and
    ``S = sum_t A[i_t] * A[j_t] * c_t`` over the cores (``a_{k-1} * prod(modes_k) * a_k`` with the
    fixed boundary ranks folded into ``c_t``). The index plan is built once and lives on the gates'
    device, so a call reads nothing back and copies nothing to the device. Build a new counter when
    shapes change (a prune rebuilds the module). Under ZeRO-3 call it inside ``GatheredParameters``
    over the gates, like ``model_size``.
    """

    def __init__(self, model: nn.Module, shape_of: ShapeOf = default_shape_of) -> None:
        named = list(tensorized_modules(model))
        self.layers = [layer for _, layer in named]
        if not self.layers:
            raise ValueError(f"SizeCounter: {type(model).__name__} has no tensorized layer")
        self.shape_of = shape_of
        bond_of: list[int] = []  # per gate entry: its bond's position in A
        layer_of: list[int] = []  # per gate entry: its layer's position in self.layers
        rows: list[tuple[int, int, int]] = []  # (i, j, c) per core
        first = 0  # the layer's first bond in A
        bonds = sum(len(layer.bond_dims()) for layer in self.layers)  # A's last entry, the constant 1
        for n, layer in enumerate(self.layers):
            for k, r in enumerate(layer.bond_dims()):
                bond_of += [first + k] * r
                layer_of += [n] * r
            shapes = layer.core_shapes()
            for k, s in enumerate(shapes):
                c = math.prod(s[1:-1]) * (s[0] if k == 0 else 1) * (s[-1] if k == len(shapes) - 1 else 1)
                rows.append((bonds if k == 0 else first + k - 1, bonds if k == len(shapes) - 1 else first + k, c))
            first += len(shapes) - 1
        device = self.layers[0].core.device
        self.i, self.j, self.c = torch.tensor(rows, dtype=torch.int64, device=device).T.contiguous()  # (cores,) each
        self.bond_of = torch.tensor(bond_of, dtype=torch.int64, device=device)  # (entries,)
        self.layer_of = torch.tensor(layer_of, dtype=torch.int64, device=device)  # (entries,)
        self.base = torch.zeros(bonds + 1, dtype=torch.int64, device=device)
        self.base[-1] = 1
        self.with_gates = [(name, layer) for name, layer in named if layer.bond_dims()]

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        for name, layer in self.with_gates:
            if layer.gate.numel() != math.prod(self.shape_of(layer.gate)):
                _check_full_gates(layer, self.shape_of, name)  # raises, naming the layer
        a = self.base
        if self.with_gates:
            g = torch.cat([layer.gate for _, layer in self.with_gates])  # (entries,) every layer's gates
            tau = torch.stack([layer.tau for layer in self.layers])[self.layer_of]  # (entries,) fp32
            a = a.index_add(0, self.bond_of, gate_alive(g, tau).to(torch.int64))  # (bonds + 1,) active ranks, 1
        return (a[self.i] * a[self.j] * self.c).sum()


def _check_full_gates(layer: nn.Module, shape_of: ShapeOf, name: str = "") -> None:
    g = layer.gate
    if g.numel() != math.prod(shape_of(g)):
        raise ValueError(f"active ranks need full gate values but the gate vector of {name or type(layer).__name__} "
                         f"holds {g.numel()} of {math.prod(shape_of(g))} entries (ZeRO-3 partition: gather the "
                         f"gates first)")


def compression_report(model: nn.Module, shape_of: ShapeOf = default_shape_of) -> dict[str, Any]:
    """Per-layer and total accounting (plain data, JSON-ready).

    ``layers[name]``: kind, dense_params (the matrix/table it replaces), physical_params
    (allocated core entries), active_params (surviving ranks), ranks, bond_dims,
    flops_per_token (active ranks). Totals: ``size`` (= S), ``physical_size``,
    ``flops_per_token_tensorized``, ``dense_params_tensorized``,
    ``leftover_params`` (every parameter that is no core or gate: norms, biases, heads,
    untensorized layers), ``gate_params``, ``compression_ratio_tensorized`` (dense /
    active over the tensorized layers; 1 without any, inf once all their ranks are dead) and
    ``compression_ratio_model`` ((leftover + dense) / (leftover + active): the whole model, dense
    leftovers included).
    """
    rows: dict[str, dict[str, Any]] = {}
    role_ids = {pid for pid, role in param_roles(model).items() if role != "dense"}
    gate_params = 0
    for name, layer in tensorized_modules(model):
        shapes = layer.core_shapes()
        ranks = active_ranks(layer, shape_of)
        gate_params += math.prod(shape_of(layer.gate))
        rows[name] = {
            "kind": type(layer).__name__,
            "dense_params": int(layer.dense_param_count()),
            "physical_params": core_params(shapes),
            "active_params": core_params(shapes, ranks),
            "ranks": ranks,
            "bond_dims": [s[-1] for s in shapes[:-1]],
            "flops_per_token": int(layer.flops_per_token(active=True)),
        }
    leftover = sum(math.prod(shape_of(p)) for p in model.parameters() if id(p) not in role_ids)
    dense = sum(r["dense_params"] for r in rows.values())
    size = sum(r["active_params"] for r in rows.values())
    return {
        "layers": rows,
        "size": size,
        "physical_size": sum(r["physical_params"] for r in rows.values()),
        "dense_params_tensorized": dense,
        "leftover_params": leftover,
        "gate_params": gate_params,
        "flops_per_token_tensorized": sum(r["flops_per_token"] for r in rows.values()),
        # no TT layer (a dense run): nothing compressed, 1; every rank dead: inf
        "compression_ratio_tensorized": dense / size if size else (math.inf if rows else 1.0),
        "compression_ratio_model": (leftover + dense) / (leftover + size) if leftover + size else math.inf,
    }

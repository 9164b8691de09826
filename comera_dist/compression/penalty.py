"""The rank penalty R: the differentiable surrogate of the model size (method doc section 3).

    R = (sum over all gates of m(g)) / (number of gates above tau),   m(g) = g * [g > tau]

It is a pure function of the gate values: no hooks, no accumulated state. R = 1 at
initialisation (all gates 1). The denominator is a count, so it carries no gradient;
the gradient of R w.r.t. a surviving gate entry is 1 / count, zero for a dead one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from comera_dist.compression.walk import tensorized_modules
from comera_dist.layers.base import gate_sums


def penalty_from_gates(gates: Sequence[Tensor], taus: Sequence[float | Tensor] | float | Tensor, *,
                       working_dtype: torch.dtype | None = None) -> Tensor:
    """R from explicit gate vectors (e.g. gathered from ZeRO-3 partitions by the engine).

    gates: 1-D gate tensors, a bond's or a layer's whole gate vector (any layers, any order); taus:
    one threshold per gate tensor, or a single threshold for all. Returns a 0-d tensor, differentiable w.r.t.
    the gates. With no surviving gate at all R is 0 (still attached to the graph).
    ``working_dtype``: the gates are fp32 masters of working gates of that dtype; the surviving
    set is decided on the working values (``layers.base.gate_alive``), as the forward decides it.
    The arithmetic (sums, count) is in fp32 or wider whatever the gates' dtype.

    All gate tensors of one dtype and device are concatenated and thresholded together: a handful
    of ops instead of several per tensor.
    No host reads: tensor thresholds stay on the device.
    """
    if len(gates) == 0:
        raise ValueError("penalty_from_gates: gates is empty (the model has no tensorized layer?)")
    if isinstance(taus, (float, int, Tensor)):
        taus = [taus] * len(gates)
    if len(taus) != len(gates):
        raise ValueError(f"penalty_from_gates: got {len(gates)} gate vectors but {len(taus)} taus")
    for i, (g, tau) in enumerate(zip(gates, taus)):
        if g.dim() != 1:
            raise ValueError(f"penalty_from_gates: gates[{i}] must be 1-D, got shape {tuple(g.shape)}")
        # Python thresholds are checked here; tensor thresholds (layer buffers) are checked
        # by the layers, and reading them back would force a device sync per gate.
        if not isinstance(tau, Tensor) and not tau > 0:
            raise ValueError(f"penalty_from_gates: tau for gates[{i}] must be > 0, got {tau}")
    total = gates[0].new_zeros((), dtype=torch.promote_types(gates[0].dtype, torch.float32))
    count = gates[0].new_zeros((), dtype=total.dtype)
    for s, c in gate_sums(gates, taus, working_dtype):  # one (sum m(g), #alive) per dtype and device
        total, count = total + s, count + c
    return total / count.clamp(min=1)


def rank_penalty(model: nn.Module) -> Tensor:
    """R over every gate of every tensorized layer of ``model`` (each layer's own ``tau``).

    ``model`` must hold full (not ZeRO-3 partitioned) gates; under ZeRO-3 the engine gathers
    the gates and calls :func:`penalty_from_gates`.
    """
    gates: list[Tensor] = []
    taus: list[Tensor] = []
    for _, layer in tensorized_modules(model):
        if layer.bond_dims():  # the whole gate vector: R counts entries, so bonds need not be split
            gates.append(layer.gate)
            taus.append(layer.tau)
    if not gates:
        raise ValueError(f"rank_penalty: {type(model).__name__} has no tensorized layer with gates")
    return penalty_from_gates(gates, taus)

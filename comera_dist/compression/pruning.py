"""Physical rank pruning: a serializable plan of kept rank indices, and applying it.

A plan says, per tensorized layer and per interior bond, which rank indices survive
(``{layer_name: {bond: [kept indices]}}``), plus the bond sizes it was made against so
that applying it to a model of other shapes is an error instead of a silent mix-up.
Applying it slices both neighbouring cores and the gate of each bond (the layer's
``prune_``) and slices the optimizer's AdamW moments to match, re-pointing the
optimizer's param groups to the new Parameters. Dead ranks contribute exactly zero to
the masked model (``m(g) = 0``), so the pruned model computes the same output.

This is the single-process form (parameters fully present). Under ZeRO the engine
gathers the parameters and rebuilds its optimizer from the sliced moments.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from comera_dist.compression.config import PruningConfig
from comera_dist.compression.walk import tensorized_modules
from comera_dist.layers.base import gate_alive, slice_flat


@dataclass(kw_only=True, slots=True)
class PruningPlan:
    """Which rank indices survive, per layer and bond."""

    kept: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    """``{layer_name: {bond: [kept indices, ascending]}}``; bonds not listed stay whole."""
    bond_dims: dict[str, list[int]] = field(default_factory=dict)
    """``{layer_name: [size of every interior bond]}`` before the plan (for validation)."""

    def __post_init__(self) -> None:
        for name, bonds in self.kept.items():
            if name not in self.bond_dims:
                raise ValueError(f"PruningPlan: layer {name!r} is in kept but not in bond_dims")
            dims = self.bond_dims[name]
            for bond, idx in bonds.items():
                where = f"PruningPlan layer {name!r} bond {bond}"
                if not 0 <= bond < len(dims):
                    raise ValueError(f"{where}: bond out of range, the layer has {len(dims)} interior bonds")
                if len(idx) == 0:
                    raise ValueError(f"{where}: kept indices are empty (a bond keeps at least one rank)")
                if any(not 0 <= i < dims[bond] for i in idx):
                    raise ValueError(f"{where}: kept indices {idx} out of range for bond size {dims[bond]}")
                if list(idx) != sorted(set(idx)):
                    raise ValueError(f"{where}: kept indices must be ascending and unique, got {idx}")

    def is_empty(self) -> bool:
        """True when the plan removes nothing."""
        return not any(self.kept.values())

    def bond_dims_after(self) -> dict[str, list[int]]:
        """``{layer_name: [bond sizes after the plan]}``."""
        return {
            name: [len(self.kept.get(name, {}).get(b, range(d))) for b, d in enumerate(dims)]
            for name, dims in self.bond_dims.items()
        }

    def to_json(self) -> str:
        """JSON text (bond keys become strings, as JSON requires)."""
        kept = {name: {str(b): list(map(int, idx)) for b, idx in bonds.items()} for name, bonds in self.kept.items()}
        return json.dumps({"kept": kept, "bond_dims": self.bond_dims}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PruningPlan:
        """Inverse of :meth:`to_json`; malformed content is a ``ValueError`` naming the key."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {"kept", "bond_dims"}:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"PruningPlan.from_json: expected keys ['bond_dims', 'kept'], got {keys}")
        try:
            kept = {name: {int(b): [int(i) for i in idx] for b, idx in bonds.items()}
                    for name, bonds in data["kept"].items()}
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"PruningPlan.from_json: malformed 'kept' {data['kept']!r}: {e}") from e
        bond_dims = {name: [int(d) for d in dims] for name, dims in data["bond_dims"].items()}
        return cls(kept=kept, bond_dims=bond_dims)


def bond_dims(model: nn.Module) -> dict[str, list[int]]:
    """Current physical interior bond sizes of every tensorized layer (gate lengths)."""
    return {name: list(layer.bond_dims()) for name, layer in tensorized_modules(model)}


def prune_due(cfg: PruningConfig, step: int) -> bool:
    """Whether a physical prune happens after optimizer step ``step`` (1-based count of steps done).

    Every ``cfg.every`` steps counted from ``cfg.start_step``; never when ``every == 0``.
    """
    if cfg.every == 0 or step < max(cfg.start_step, 1):
        return False
    return (step - cfg.start_step) % cfg.every == 0


def plan_to_bond_dims(model: nn.Module, dims: dict[str, list[int]]) -> PruningPlan:
    """A plan that resizes a freshly built ``model`` to the bond sizes ``dims`` (e.g. from a checkpoint).

    It keeps the first ``dims[layer][bond]`` indices of each bond; the values are meant to be
    overwritten by ``load_state_dict`` right after. Unknown layers, a wrong bond count or a
    size larger than the model's are ``ValueError``s.
    """
    have = bond_dims(model)
    missing = sorted(set(dims) - set(have))
    if missing:
        raise ValueError(f"plan_to_bond_dims: dims name layers the model does not have: {missing}")
    kept: dict[str, dict[int, list[int]]] = {}
    for name, want in dims.items():
        if len(want) != len(have[name]):
            raise ValueError(f"plan_to_bond_dims: layer {name!r} has {len(have[name])} bonds, dims gives {want}")
        for bond, (w, h) in enumerate(zip(want, have[name])):
            if not 1 <= w <= h:
                raise ValueError(f"plan_to_bond_dims: layer {name!r} bond {bond} size {w} outside [1, {h}]")
            if w < h:
                kept.setdefault(name, {})[bond] = list(range(w))
    return PruningPlan(kept=kept, bond_dims=have)


def make_plan(model: nn.Module, min_rank: int = 1, *, working_dtype: torch.dtype | None = None) -> PruningPlan:
    """Plan to keep, on every bond, the ranks whose gate exceeds the layer's ``tau``.

    ``working_dtype``: ``model`` holds fp32 masters of gates that train in that dtype (bf16); the
    plan keeps exactly the ranks the forward keeps (``layers.base.gate_alive``).

    A bond never keeps fewer than ``min_rank`` ranks (or its whole size if smaller): when
    too few gates survive, the largest gates are kept. Bonds that lose nothing are omitted.
    """
    if min_rank < 1:
        raise ValueError(f"make_plan: min_rank must be >= 1, got {min_rank}")
    kept: dict[str, dict[int, list[int]]] = {}
    dims: dict[str, list[int]] = {}
    for name, layer in tensorized_modules(model):
        dims[name] = list(layer.bond_dims())
        for bond, gate in enumerate(layer.gates):
            g = gate.detach()  # (r_k,)
            alive = torch.nonzero(gate_alive(g, layer.tau, working_dtype)).flatten()  # (a,) ascending
            floor = min(min_rank, g.numel())
            if alive.numel() < floor:
                alive = torch.sort(torch.topk(g, floor).indices).values  # (floor,)
            if alive.numel() < g.numel():
                kept.setdefault(name, {})[bond] = alive.tolist()
    return PruningPlan(kept=kept, bond_dims=dims)


def apply_plan(model: nn.Module, plan: PruningPlan, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Slice ``model`` in place to ``plan``; slice ``optimizer``'s per-parameter state to match.

    Everything is validated before anything changes: a layer or bond the model lacks, or
    bond sizes other than the plan's, is a ``ValueError``. Call at a step boundary (after
    ``optimizer.step()``/``zero_grad``): the new Parameters carry no ``.grad``. Every
    tensor state entry shaped like the old parameter (AdamW ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``) is sliced; scalar entries (``step``) are kept.
    """
    layers = dict(tensorized_modules(model))
    missing = sorted(set(plan.kept) - set(layers))
    if missing:
        raise ValueError(f"apply_plan: plan names layers the model does not have: {missing}; "
                         f"tensorized layers are {sorted(layers)}")
    for name in plan.kept:
        have = list(layers[name].bond_dims())
        if have != plan.bond_dims[name]:
            raise ValueError(f"apply_plan: layer {name!r} has bond sizes {have}, the plan was made "
                             f"for {plan.bond_dims[name]}")
    replaced: list[tuple[nn.Parameter, nn.Parameter, Callable[[Tensor], Tensor]]] = []
    for name, bonds in plan.kept.items():
        if not bonds:
            continue
        layer = layers[name]
        device = layer.gate.device
        index = {b: torch.tensor(idx, dtype=torch.long, device=device) for b, idx in bonds.items()}
        old_core, shapes, old_gate, gate_keep = layer.core, layer.core_shapes(), layer.gate, layer.gate_index(index)
        layer.prune_(index)
        replaced.append((old_core, layer.core, functools.partial(_flat_slicer, shapes=shapes, kept=index)))
        replaced.append((old_gate, layer.gate, _gate_slicer(gate_keep)))
    for old, new, slicer in replaced:
        if new is not old and tuple(new.shape) != tuple(slicer(old.detach()).shape):
            raise RuntimeError(f"apply_plan: prune_ produced shape {tuple(new.shape)}, expected "
                               f"{tuple(slicer(old.detach()).shape)}")
    if optimizer is not None:
        _repoint_optimizer(optimizer, [(o, n, s) for o, n, s in replaced if n is not o])


def _flat_slicer(t: Tensor, shapes: list[tuple[int, ...]], kept: dict[int, Tensor]) -> Tensor:
    """A flat tensor in core layout ``shapes`` (the cores, or a moment of them) sliced as ``prune_`` slices."""
    return slice_flat(t, shapes, kept)[0]


def _gate_slicer(keep: Tensor) -> Callable[[Tensor], Tensor]:
    """Keep the entries ``keep`` of a gate vector (or a moment of it)."""
    return lambda t: t.index_select(0, keep)


def _repoint_optimizer(optimizer: torch.optim.Optimizer,
                       replaced: list[tuple[nn.Parameter, nn.Parameter, Callable[[Tensor], Tensor]]]) -> None:
    """Swap old for new Parameters in the param groups and slice their state."""
    by_old = {id(old): (old, new, slicer) for old, new, slicer in replaced}
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            hit = by_old.get(id(p))
            if hit is None:
                continue
            old, new, slicer = hit
            group["params"][i] = new
            state = optimizer.state.pop(old, None)
            if state is not None:
                optimizer.state[new] = {
                    key: slicer(v) if torch.is_tensor(v) and v.shape == old.shape and v.dim() > 0 else v
                    for key, v in state.items()
                }

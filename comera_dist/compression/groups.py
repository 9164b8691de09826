"""AdamW parameter groups by ROLE: TT/TTM cores, rank gates, and everything else ("dense").

Roles come from the tensorized layers' ``core`` and ``gate`` parameters, matched by
object identity, never by parameter name (the reference's name matching misfiled cores); a model
packed by ``engine.packing`` (one flat parameter per role) reports its flat parameters' roles.
Default learning rates (``LrConfig``): cores 1e-4, gates 1e-3, dense 5e-5. Gates never
get weight decay: decay would act as a second, unscheduled rank penalty.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from comera_dist.compression.config import LrConfig
from comera_dist.compression.walk import tensorized_modules

ROLES = ("cores", "gates", "dense")


def param_roles(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> role`` for every core and gate of every tensorized layer (for a packed
    model: of its flat parameters; its layers' ``core``/``gate`` are then views, not parameters)."""
    roles: dict[int, str] = {}
    for _, layer in tensorized_modules(model):
        roles[id(layer.core)] = "cores"
        roles[id(layer.gate)] = "gates"
    packing = model.__dict__.get("_packing")  # engine.packing.Packing (this package does not import engine)
    if packing is not None:
        roles.update(packing.roles())
    return roles


def param_groups(model: nn.Module, lr: LrConfig) -> list[dict[str, Any]]:
    """Optimizer param groups ``{"name", "params", "lr", "weight_decay"}`` in ROLES order.

    Only trainable parameters (``requires_grad``) are included; each parameter appears once
    (shared parameters are deduplicated by ``model.parameters()``); empty groups are left
    out (ZeRO rejects empty groups), so look groups up by ``name``, not by position.
    """
    roles = param_roles(model)
    params: dict[str, list[nn.Parameter]] = {role: [] for role in ROLES}
    for p in model.parameters():
        if p.requires_grad:
            params[roles.get(id(p), "dense")].append(p)
    settings = role_settings(lr)
    return [
        {"name": role, "params": params[role], "lr": settings[role][0], "weight_decay": settings[role][1]}
        for role in ROLES
        if params[role]
    ]


def role_settings(lr: LrConfig) -> dict[str, tuple[float, float]]:
    """``role -> (lr, weight_decay)`` of the param group of each of ROLES (gates never decay)."""
    return {"cores": (lr.cores, lr.weight_decay), "gates": (lr.gates, 0.0), "dense": (lr.dense, lr.weight_decay)}

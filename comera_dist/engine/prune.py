"""Physical pruning under DeepSpeed: gather the full fp32 state, slice it, and seed a rebuilt engine with it.

A prune changes parameter shapes, which no ZeRO partitioning survives, so the engine is
rebuilt: (1) every rank gathers the full fp32 master weights and AdamW moments through
DeepSpeed's ``safe_get_*`` API; (2) a fresh model at the current shapes (the factory's model
with all earlier plans applied) loads them; (3) ``compression.make_plan``/``apply_plan`` slice
the model and, through a plain AdamW holding the moments, the moments; (4) a new engine is
built on the sliced model and ``restore_optimizer_state`` writes the surviving moments and
the step count into its (possibly partitioned) optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from deepspeed.utils import safe_get_full_optimizer_state
from torch import Tensor, nn

from comera_dist.compression.pruning import PruningPlan, apply_plan, make_plan
from comera_dist.compression.walk import tensorized_modules
from comera_dist.engine.device import accelerator_device
from comera_dist.engine.hooks import full_fp32, full_shape, set_full
from comera_dist.engine.packing import pack_state, unpack_state

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(slots=True)
class FullState:
    """Unpartitioned fp32 training state, keyed by parameter name (every alias of a tied weight)."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    moments: dict[str, dict[str, Tensor]]
    """name -> {"exp_avg": ..., "exp_avg_sq": ...}; empty before the first optimizer step."""
    step: int
    """AdamW's step count (bias correction) at the time of the gather."""


def torch_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (it holds the fp32 flat partitions at ZeRO 1-3)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def optimizer_step_count(engine) -> int:
    """AdamW's step count (the same for every parameter: skipped steps never call the optimizer)."""
    for state in torch_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def link_optimizer_state(engine) -> None:
    """(Re)map every parameter to its fragment of the flat optimizer state (ZeRO 1/2, bf16).

    DeepSpeed 0.19 links lazily inside the step of the FIRST param group only, so the
    parameters of later groups (our gates and dense groups) get empty fragments and
    ``safe_get_full_optimizer_state`` fails for them; relinking once every group's state
    exists fixes that. A no-op for ZeRO-3 and plain stage 0.
    """
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def gather_full_state(engine) -> FullState:
    """Full fp32 weights and AdamW moments of ``engine.module`` (collective: all ranks call it).

    Every tensor of the result lives on the accelerator's device (where the module is), whatever
    DeepSpeed keeps its fp32 masters or moments on, so slicing and rebuilding stay on one device.
    """
    module: nn.Module = engine.module
    device = accelerator_device()
    step = optimizer_step_count(engine)
    if step > 0:
        link_optimizer_state(engine)
    inner = torch_optimizer(engine)
    by_id: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}
    params: dict[str, Tensor] = {}
    moments: dict[str, dict[str, Tensor]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in by_id:
            value = full_fp32(p).to(device)
            m: dict[str, Tensor] = {}
            if step > 0 and p.requires_grad:
                for key in MOMENTS:
                    full = safe_get_full_optimizer_state(p, key)
                    if full is None:  # no ZeRO and no master copy: the state is keyed by p itself
                        full = inner.state[p][key]
                    m[key] = full.detach().float().to(device).clone().reshape(full_shape(p))
            by_id[id(p)] = (value.clone(), m)
        params[name], moments[name] = by_id[id(p)]
    buffers = {n: b.detach().to(device).clone() for n, b in module.named_buffers()}
    unpack_state(module, params, moments)  # per-module names, whatever the engine packed
    return FullState(params=params, buffers=buffers, moments=moments, step=step)


def model_at_shapes(factory: Callable[[], nn.Module], plans: Sequence[PruningPlan]) -> nn.Module:
    """``factory()`` sliced by every plan in order: a model with the current (pruned) shapes."""
    model = factory()
    for plan in plans:
        apply_plan(model, plan)
    return model


def load_full_state(model: nn.Module, state: FullState) -> None:
    """Copy ``state``'s weights and buffers into an unpartitioned ``model``; names and shapes must match."""
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    source = state.params | state.buffers
    missing, unexpected = sorted(set(own) - set(source)), sorted(set(source) - set(own))
    if missing or unexpected:
        raise ValueError(f"model/state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, layer in tensorized_modules(model):  # equal shapes of flat cores do not mean equal cores
        saved = source[f"{name}.bond_sizes"].tolist()
        if saved != layer.bond_dims():
            raise ValueError(f"{name}: the state's bond sizes {saved} differ from the model's {layer.bond_dims()}; "
                             f"a pruned state needs the model at its shapes")
    with torch.no_grad():
        for name, t in own.items():
            if tuple(t.shape) != tuple(source[name].shape):
                raise ValueError(f"{name}: model shape {tuple(t.shape)} != state shape {tuple(source[name].shape)}")
            t.copy_(source[name])


def prune_full_state(model: nn.Module, state: FullState, min_rank: int, *,
                     working_dtype: torch.dtype | None = None) -> PruningPlan | None:
    """Plan on ``model`` (holding ``state``) and slice it in place; returns None when nothing dies.

    ``working_dtype``: the dtype the engine's module gates train in (bf16 under DeepSpeed bf16);
    the fp32 masters in ``state`` are judged as that working copy, like the forward mask does.

    The moments in ``state`` are sliced to the new shapes alongside (through a plain AdamW,
    so exactly the rows/columns ``apply_plan`` keeps survive).
    """
    plan = make_plan(model, min_rank=min_rank, working_dtype=working_dtype)
    if plan.is_empty():
        return None
    named = dict(model.named_parameters())
    shim = torch.optim.AdamW(list(named.values()), lr=0.0)
    for name, p in named.items():
        if state.moments.get(name):
            shim.state[p] = {"step": torch.tensor(float(state.step)), **state.moments[name]}
    apply_plan(model, plan, optimizer=shim)
    new_named = dict(model.named_parameters(remove_duplicate=False))
    id_to_name = {id(p): n for n, p in model.named_parameters()}
    sliced = {id_to_name[id(p)]: {k: shim.state[p][k] for k in MOMENTS}
              for p in shim.state if id(p) in id_to_name and "exp_avg" in shim.state[p]}
    state.params = {n: p.detach().clone() for n, p in new_named.items()}
    state.moments = {n: sliced.get(id_to_name.get(id(p), ""), {}) for n, p in new_named.items()}
    return plan


def restore_optimizer_state(engine, state: FullState, *, set_master: bool) -> None:
    """Write ``state``'s moments and step count into a freshly built engine's optimizer (collective).

    DeepSpeed's optimizers create AdamW state lazily at the first step; it is created here
    (zeros, then the saved moments through ``safe_set_full_optimizer_state``). ``set_master``
    also writes the fp32 master weights (needed under bf16, where the engine built its
    master copy from the rounded module weights).
    """
    inner = torch_optimizer(engine)
    if state.step == 0:
        return
    # torch's AdamW keeps `step` on the host unless it is fused or capturable (then beside the param).
    on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    # ZeRO-3 swaps its flat fp32 partitions into the param groups only during its step.
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is None:
        flats = [flat for group in inner.param_groups for flat in group["params"]]
    for flat in flats:
        slot = inner.state[flat]
        slot.setdefault("exp_avg", torch.zeros_like(flat))
        slot.setdefault("exp_avg_sq", torch.zeros_like(flat))
        slot["step"] = torch.tensor(float(state.step), device=flat.device if on_device else "cpu")
    link_optimizer_state(engine)
    params, moments = dict(state.params), dict(state.moments)
    pack_state(engine.module, params, moments)  # the engine's own names (engine.packing)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if set_master:
            set_full(p, params[name], "fp32")
        for key, value in moments.get(name, {}).items():
            if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                set_full(p, value, key)
            else:
                inner.state[p][key].copy_(value.reshape(p.shape))

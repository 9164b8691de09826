"""Elastic resume: the consolidated training state every checkpoint carries, and seeding an engine from it.

Why not DeepSpeed's universal checkpoint: ``ds_to_universal`` is an offline conversion step
(a separate multi-process tool run between jobs, which a Slurm requeue does not do), 0.19.8
converts ZeRO 1/2 checkpoints and needs ``universal_checkpoint_info`` in the client state,
and ``load_universal`` is an engine-construction flag, so the loader would have to know the
checkpoint's format before building the engine. The route below is the one pruning already
takes on every prune (``engine/prune.py``): full fp32 weights and AdamW moments gathered through
DeepSpeed's ``safe_get_*`` API, loaded into a model at the saved shapes, a fresh engine built
for *this* job's world size and ZeRO stage, moments and step count written back through
``safe_set_*``. It works for ZeRO 0-3 in both directions, needs no conversion, and its state
is also where the non-finite check looks (one gather serves both).

The cost is one gather per save and a file of ~3x the fp32 parameters (weights + two moments):
small for CoMERA's compressed models; the soak benchmark measures the save time.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from comera_dist.engine.prune import MOMENTS, FullState, gather_full_state

_BOND_GATE = re.compile(r"(?:(.*)\.)?gates\.(\d+)")
_CORE = re.compile(r"(?:(.*)\.)?cores\.(\d+)")


def _cpu(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().cpu() for k, v in d.items()}


def consolidate(engine, client: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The consolidated state of ``engine`` (collective) and the names of its non-finite tensors.

    The payload is plain tensors and data (loads with ``weights_only=True``): ``params``,
    ``buffers``, ``moments`` (name -> {exp_avg, exp_avg_sq}), ``step`` (AdamW's), ``scheduler``
    (the LR scheduler's state dict or None), ``global_steps``, ``global_samples`` and ``client``
    (the CoMERA client state, which DeepSpeed keeps inside its own shards).
    """
    state = gather_full_state(engine)
    payload = {"params": _cpu(state.params), "buffers": _cpu(state.buffers),
               "moments": {n: _cpu(m) for n, m in state.moments.items()}, "step": state.step,
               **schedule_position(engine), "client": client}
    return payload, nonfinite_entries(payload)


def upgrade_layout(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload``, a consolidated state of an older ``checkpoint.PARAM_LAYOUT``, in the current one.

    Layout 1 had one ``<layer>.gates.<k>`` parameter per bond, layouts 1 and 2 one ``<layer>.cores.<k>``
    per core. Each layer's pieces, and their AdamW moments, are flattened and concatenated in order
    into ``<layer>.gate`` and ``<layer>.core`` (``TensorizedModule``'s views read them back at the
    shapes the rebuilt model knows), and the cores' interior ranks become the ``<layer>.bond_sizes``
    buffer the flat layout records, which the load compares with the rebuilt model's. Everything
    else is kept as it is.
    """
    params, moments, buffers = dict(payload["params"]), dict(payload["moments"]), dict(payload["buffers"])
    for pattern, leaf in ((_BOND_GATE, "gate"), (_CORE, "core")):
        layers: dict[str, dict[int, str]] = {}
        for name in params:
            hit = pattern.fullmatch(name)
            if hit:
                layers.setdefault(hit.group(1) or "", {})[int(hit.group(2))] = name
        for prefix, pieces in layers.items():
            if sorted(pieces) != list(range(len(pieces))):
                raise ValueError(f"upgrade_layout: layer {prefix!r} has {leaf} pieces {sorted(pieces)}, "
                                 f"not 0..{len(pieces) - 1}")
            names = [pieces[k] for k in range(len(pieces))]
            new = f"{prefix}.{leaf}" if prefix else leaf
            if leaf == "core":
                bonds = [int(params[n].shape[-1]) for n in names[:-1]]
                buffers[f"{prefix}.bond_sizes" if prefix else "bond_sizes"] = torch.tensor(bonds, dtype=torch.int64)
            params[new] = torch.cat([params.pop(n).reshape(-1) for n in names])
            states = [moments.pop(n, {}) for n in names]
            moments[new] = {k: torch.cat([s[k].reshape(-1) for s in states]) for k in MOMENTS} if all(states) else {}
    return {**payload, "params": params, "moments": moments, "buffers": buffers}


def schedule_position(engine) -> dict[str, Any]:
    """``scheduler`` (the LR scheduler's state dict or None), ``global_steps`` and ``global_samples``
    of ``engine``: what :func:`restore_schedule` writes into a fresh engine (resume, prune rebuild)."""
    return {"scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples)}


def nonfinite_entries(payload: dict[str, Any]) -> list[str]:
    """Names of the parameters and optimizer moments holding a NaN or an infinity (``name`` or ``name.exp_avg``)."""
    bad = [n for n, t in payload["params"].items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    for name, moments in payload["moments"].items():
        bad += [f"{name}.{k}" for k, t in moments.items() if not bool(torch.isfinite(t).all())]
    return sorted(set(bad))


def full_state(payload: dict[str, Any], device: torch.device) -> FullState:
    """``payload``'s tensors as the ``FullState`` that ``prune.load_full_state``/``restore_optimizer_state`` take."""
    return FullState(params={k: v.to(device) for k, v in payload["params"].items()},
                     buffers={k: v.to(device) for k, v in payload["buffers"].items()},
                     moments={n: {k: v.to(device) for k, v in m.items()} for n, m in payload["moments"].items()},
                     step=int(payload["step"]))


def restore_schedule(engine, payload: dict[str, Any]) -> None:
    """The LR schedule position and DeepSpeed's step/sample counters of ``payload`` into ``engine``."""
    engine.global_steps = payload["global_steps"]
    engine.global_samples = payload["global_samples"]
    place_schedule(engine, payload["scheduler"])


def place_schedule(engine, saved: dict[str, Any] | None) -> None:
    """Put ``engine``'s LR scheduler (if any) at the position of ``saved``, the writing run's scheduler state. A
    fresh scheduler has written its *initial* lrs into the param groups: the schedule is re-applied there, or the
    next step would run at the warmup-start lr. Without ``saved`` (the writing run had no scheduler,
    ``deepspeed.scheduler.kind=constant``) the scheduler starts where it would be had it run from the start: at
    the engine's optimizer step, whose counter is restored first."""
    sched = engine.lr_scheduler
    if sched is None or not hasattr(sched, "last_batch_iteration"):
        return
    if saved is not None:
        sched.load_state_dict(saved)
    sched.step(saved["last_batch_iteration"] if saved is not None else int(engine.global_steps) - 1)


def rank_entry(entries: list[Any], rank: int) -> Any:
    """This rank's entry of a per-rank list saved by a job of possibly another size (rank 0's for new ranks).

    Only used for values that are the same on every rank (the data position is global) or for
    which any rank's value is valid (RNG states).
    """
    return entries[rank] if rank < len(entries) else entries[0]


def describe_move(meta: dict[str, Any], world_size: int, zero_stage: int) -> str:
    return (f"{meta['world_size']} rank(s) at ZeRO {meta.get('zero_stage')} -> {world_size} rank(s) at ZeRO "
            f"{zero_stage}")

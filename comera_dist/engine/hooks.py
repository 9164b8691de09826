"""ZeRO-aware rank hooks: the rank penalty applied to the gates' fp32 master gradients (ZeRO-3).

Why not just ``loss = L + c * R``? At ZeRO 0-2 that is what the session does
(``TrainSession.penalty_in_loss``): the gates are whole module parameters there. Under ZeRO-3 the gates are partitioned outside their
layer's forward, so ``R`` cannot be computed from ``model`` parameters in the loss. Instead
the penalty acts inside the optimizer step, on the full fp32 master state:

1. the objective is evaluated with a detached *proxy* leaf ``R~`` standing in for ``R``, so
   back-propagation gives the task gradients plus ``c = d objective / d R`` (in ``R~.grad``,
   with DeepSpeed's accumulation/loss scaling applied exactly as to the task gradients);
2. at the accumulation boundary, before ``engine.step()``, ``dR/dg`` comes from autograd on
   ``compression.penalty_from_gates`` of the full fp32 gates, and ``c * dR/dg`` is added to each gate's
   gradient: under ZeRO-3 to this rank's partition of it (``safe_get_local_grad`` /
   ``safe_set_local_grad``), which is the slice of the full gradient the rank owns.

The full fp32 gates are read once per step, every gate vector in one all-gather (``full_fp32_all``), and
stay on the device with ``c`` and R: the step reads nothing back for the penalty (it used to read R and
``c`` per micro-batch and gather each gate and its gradient on its own, about 3 x 38 collectives per
six-encoder step).

By the chain rule this is the gradient of ``objective(L, R(g))``; the distributed tests
check it against plain PyTorch with the penalty in the loss. Every rank adds the same
penalty gradient (the gates are replicated in value), so adding it before or after the
data-parallel averaging gives the same result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from torch import Tensor, nn

from comera_dist.compression.penalty import penalty_from_gates
from comera_dist.compression.walk import tensorized_modules
from comera_dist.engine.device import accelerator_device


@dataclass(frozen=True, slots=True)
class GateRef:
    """The gate vector of one tensorized layer (every interior bond's gates end to end). ``param`` is the
    layer's gate parameter; in a model packed at ZeRO 0-2 (``engine.packing``) it is a view of the packed
    flat parameter, which only the dtype and the ZeRO-3 no-op ``gathered`` see (ZeRO-3 never packs, and
    only ZeRO-3 hands ``param`` to DeepSpeed's ``safe_*`` API)."""

    layer: str
    param: nn.Parameter
    tau: float


def gate_refs(model: nn.Module) -> list[GateRef]:
    """The gate parameter of every tensorized layer of ``model`` that has a bond, in module order."""
    return [GateRef(layer=name, param=layer.gate, tau=float(layer.tau))
            for name, layer in tensorized_modules(model) if layer.bond_dims()]


def full_shape(p: Tensor) -> tuple[int, ...]:
    """The unpartitioned shape of ``p`` (ZeRO-3 keeps it in ``ds_shape``; ``p.shape`` is empty)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def full_fp32(p: nn.Parameter) -> Tensor:
    """The full fp32 master value of ``p`` at any ZeRO stage (a collective under ZeRO-3).

    Stage 0 without a master copy returns the module weight itself, as fp32.
    """
    value = safe_get_full_fp32_param(p)
    if value is None:
        value = p.detach()
    return value.detach().float().reshape(full_shape(p))


def full_fp32_all(params: list[nn.Parameter]) -> list[Tensor]:
    """``full_fp32`` of each of ``params``; under ZeRO-3 in one all-gather for all of them, where
    ``full_fp32`` gathers each parameter on its own (a collective, and a host wait, per parameter).

    ZeRO-3 gives rank r the slice ``[r * part, (r + 1) * part)`` of each flattened parameter (``part``
    its partition size, the last one zero-padded). The ranks' fp32 master partitions of all ``params``,
    end to end, gather into one ``(world, sum of parts)`` buffer, from which each parameter is its
    column block read in rank order, cut to its size. Parameters in different partition groups (or not
    partitioned) go one by one.
    """
    if not params or not all(hasattr(p, "ds_id") for p in params):
        return [full_fp32(p) for p in params]
    groups = {id(getattr(p, "ds_process_group", None)) for p in params}
    if len(groups) != 1:
        return [full_fp32(p) for p in params]
    group = getattr(params[0], "ds_process_group", None)
    local = [safe_get_local_fp32_param(p).detach().float().flatten() for p in params]  # this rank's parts
    mine = torch.cat(local)  # (sum parts,)
    world = dist.get_world_size(group=group)
    everyone = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(world, mine.numel())  # row r: rank r's parts end to end
    out, start = [], 0
    for p, part in zip(params, (t.numel() for t in local), strict=True):
        full = rows[:, start:start + part].reshape(-1)[: p.ds_numel]  # the partitions in rank order
        out.append(full.reshape(full_shape(p)))
        start += part
    return out


def _z3_local(param: nn.Parameter, value: Tensor) -> Tensor:
    """This rank's slice of a full ``value`` of ZeRO-3 ``param``, zero-padded like its partition."""
    part = param.ds_tensor.numel()
    rank = dist.get_rank(group=param.ds_process_group) if getattr(param, "ds_process_group", None) else dist.get_rank()
    flat = torch.zeros(part * dist.get_world_size(), dtype=value.dtype, device=value.device)
    flat[: value.numel()] = value.flatten()
    return flat[rank * part:(rank + 1) * part]


def set_full(param: nn.Parameter, value: Tensor, what: str) -> None:
    """Write the full ``value`` into ``param``'s ``fp32`` master or optimizer state ``what``.

    Collective-free and ZeRO-aware. Under ZeRO-3 it writes this rank's slice through DeepSpeed's
    local API: its full-value setters assume ``numel`` divisible by the world size and fail for
    e.g. a 3-entry gate on 2 ranks (DeepSpeed 0.19).
    """
    if hasattr(param, "ds_id"):
        local = _z3_local(param, value)
        if what == "fp32":
            safe_set_local_fp32_param(param, local)
        else:
            safe_set_local_optimizer_state(param, local, what)
    elif what == "fp32":
        safe_set_full_fp32_param(param, value)
    else:
        safe_set_full_optimizer_state(param, value, what)


@contextlib.contextmanager
def gathered(params: list[nn.Parameter]) -> Iterator[None]:
    """Make ZeRO-3 partitioned ``params`` readable in full inside the block (read-only); no-op otherwise."""
    if any(hasattr(p, "ds_id") for p in params):
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield


class PenaltyHook:
    """The rank penalty R of a model and the injection of ``c * dR/dg`` into the gate gradients."""

    def __init__(self, model: nn.Module) -> None:
        self.gates = gate_refs(model)
        # R is computed from the fp32 masters but its surviving set is the working gates' (bf16 under
        # DeepSpeed bf16), so that R, S (layer.ranks()), the forward mask and the plan agree near tau.
        self.working_dtype = self.gates[0].param.dtype if self.gates else None

    @property
    def active(self) -> bool:
        """False for a dense model (no gates): R is 0 and nothing is injected."""
        return bool(self.gates)

    def gates_fp32(self) -> list[Tensor]:
        """The full fp32 master of every gate vector, each (sum r_k,): one all-gather under ZeRO-3
        (``full_fp32_all``). They do not change within a step: read them once, before its first forward."""
        return full_fp32_all([ref.param for ref in self.gates])

    def value(self, gates: list[Tensor]) -> Tensor:
        """R of ``gates`` (``gates_fp32()``), 0-d fp32 on the accelerator, the same on every rank; no host read."""
        with torch.no_grad():
            r = penalty_from_gates(gates, [ref.tau for ref in self.gates], working_dtype=self.working_dtype)
        # beside the task loss it is combined with (fp32 whatever the precision)
        return r.to(device=accelerator_device(), dtype=torch.float32)

    @staticmethod
    def proxy(value: Tensor) -> Tensor:
        """A fresh 0-d leaf holding R (``value``); after backward its ``.grad`` is ``d objective / d R``."""
        return value.detach().clone().requires_grad_(True)

    def inject(self, coef: Tensor, gates: list[Tensor]) -> None:
        """Add ``coef * dR/dg`` to each rank's partition of every gate's gradient (ZeRO-3; call between
        backward and step). No collective: the partition is the slice of the full gradient the rank owns.

        coef: 0-d, ``d objective / d R`` summed over the step's micro-batches, on the device (0 adds
        nothing; NaN, from a non-finite loss, turns the gates' gradients NaN like every other, and the
        step is skipped); gates: ``gates_fp32()`` of this step. At ZeRO 0-2 the penalty enters the loss
        instead (``TrainSession.penalty_in_loss``), so an unpartitioned gate here is an error.
        """
        if not self.active:
            return
        flat = [ref.layer for ref in self.gates if not hasattr(ref.param, "ds_id")]
        if flat:
            raise ValueError(f"PenaltyHook.inject: the gates of {flat} are not ZeRO-3 partitioned parameters; "
                             "at ZeRO 0-2 the rank penalty enters the loss (TrainSession.penalty_in_loss)")
        values = [g.detach().clone().requires_grad_(True) for g in gates]  # each (sum r_k,)
        penalty = penalty_from_gates(values, [ref.tau for ref in self.gates], working_dtype=self.working_dtype)
        grads = torch.autograd.grad(penalty, values, allow_unused=True)
        for ref, d_r in zip(self.gates, grads):
            current = safe_get_local_grad(ref.param) if d_r is not None else None
            if current is not None:
                update = coef.to(current.device) * _z3_local(ref.param, d_r).to(current.device)
                safe_set_local_grad(ref.param, current + update.to(current.dtype))

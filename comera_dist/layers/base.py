"""TensorizedModule: the cores, rank gates, threshold and pruning shared by TT/TTM layers.

Rank adaptation is explicit state: ``core`` is one ``nn.Parameter`` holding every core flattened end
to end (``cores`` are its views ``(r_{k-1}, modes..., r_k)``, shapes kept in ``core_shapes()``),
``gate`` one ``nn.Parameter`` holding every interior bond's gates end to end (``gates`` are its
per-bond views), ``tau`` a buffer, so all of it rides in the ``state_dict``, with the buffer
``bond_sizes`` (int64, the physical interior ranks) recording the shapes a flat ``core`` cannot show:
two layers pruned differently can hold the same number of elements. One core and one gate parameter
per layer instead of one per core and bond: every parameter tensor costs the optimizer, ZeRO's
gradient bookkeeping and autograd a fixed handful of ops per step whatever its size (a six-encoder
has 226 cores and 188 bonds in 38 layers). The mask ``m(g) = g * [g > tau]`` is computed
in every forward and never written back, so pruning by gates is reversible until ``prune_`` slices
the cores physically (a prune makes new parameters at the new shapes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


def gate_alive(g: Tensor, tau: Tensor | float, working_dtype: torch.dtype | None = None) -> Tensor:
    """The one rule deciding which ranks survive: ``g > tau``, compared in fp32 (bool, ``g``'s shape).

    Under mixed precision a gate exists twice: the fp32 master (optimizer) and the working copy the
    forward multiplies with (bf16 under DeepSpeed bf16), which is the master rounded to bf16. The
    working copy is the truth, because it is what the model computes with: the forward mask, the
    active ranks (S), the penalty's surviving set (R) and the pruning plan all use it. Code holding
    a master passes ``working_dtype`` (the module gate's dtype) so the master is rounded the way
    DeepSpeed rounds it before the comparison. ``tau`` is kept in fp32 by the layers.
    """
    if working_dtype is not None:
        g = g.to(working_dtype)
    cmp = torch.promote_types(g.dtype, torch.float32)  # fp32, or fp64 for fp64 gates (references)
    return g.to(cmp) > (tau.to(cmp) if isinstance(tau, Tensor) else float(tau))


def gate_sums(gates: Sequence[Tensor], taus: Sequence[Tensor | float], working_dtype: torch.dtype | None = None
              ) -> list[tuple[Tensor, Tensor]]:
    """``(sum of m(g), #(g > tau))`` per class of gate tensors of one dtype and device, end to end.

    The pieces of the rank penalty ``R = sum m(g) / #alive`` (``compression.penalty``). R counts
    entries, so the gate tensors (bonds' or whole layers' vectors, of any lengths, as a prune leaves
    them) are concatenated and compared with one threshold per entry: a handful of ops per class
    whatever the count, and no host reads (tensor thresholds stay on the device). Sums are in fp32
    or wider; counts are int64. Differentiable in the gates.
    """
    classes: dict[tuple, list[int]] = {}
    for i, g in enumerate(gates):
        classes.setdefault((g.dtype, g.device), []).append(i)
    terms = []
    for (_, device), idx in classes.items():
        g = torch.cat([gates[i] for i in idx])  # (entries,) every gate of the class
        tau = _entry_taus([taus[i] for i in idx], [gates[i].shape[0] for i in idx], device)  # (entries,) or a number
        alive = gate_alive(g, tau, working_dtype)  # (entries,) bool
        terms.append(((g * alive).sum(dtype=torch.promote_types(g.dtype, torch.float32)), alive.sum()))
    return terms


def _entry_taus(taus: list[Tensor | float], lengths: list[int], device: torch.device) -> Tensor | float:
    """One threshold per gate entry: each tensor's own, expanded (views) and concatenated on the
    device; a single Python number shared by all stays a number."""
    if all(not isinstance(t, Tensor) for t in taus) and len(set(taus)) == 1:
        return float(taus[0])
    parts = [t if isinstance(t, Tensor) else torch.tensor(float(t), dtype=torch.float32, device=device) for t in taus]
    return torch.cat([t.reshape(1).expand(n) for t, n in zip(parts, lengths)])


class TensorizedModule(nn.Module):
    """Base of ``TTLinear`` and ``TTEmbedding``; subclasses set the cores and the accounting."""

    core: nn.Parameter
    gate: nn.Parameter
    tau: Tensor
    bond_sizes: Tensor
    _shapes: tuple[tuple[int, ...], ...]
    _bonds: tuple[int, ...]

    def _init_state(self, cores: list[Tensor], tau: float) -> None:
        if not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and tau > 0):
            raise ValueError(f"tau must be a number > 0 (the gate threshold), got {tau!r}")
        self._shapes = tuple(tuple(int(n) for n in c.shape) for c in cores)
        self.core = nn.Parameter(torch.cat([c.reshape(-1) for c in cores]))  # no ParameterList: see core_list
        self._bonds = tuple(s[-1] for s in self._shapes[:-1])
        self.gate = nn.Parameter(torch.ones(sum(self._bonds), dtype=cores[0].dtype, device=cores[0].device))
        self.register_buffer("tau", torch.tensor(float(tau), dtype=torch.float32, device=cores[0].device))
        self.register_buffer("bond_sizes", self._bond_tensor(cores[0].device))

    def _bond_tensor(self, device: torch.device) -> Tensor:
        return torch.tensor(self._bonds, dtype=torch.int64, device=device)

    # ---- cores -------------------------------------------------------------------------

    @property
    def num_cores(self) -> int:
        """``D``, the number of cores."""
        return len(self._shapes)

    def core_shapes(self) -> list[tuple[int, ...]]:
        """Physical shape ``(r_{k-1}, modes..., r_k)`` of every core (known also under ZeRO-3, where
        ``core`` is an empty shard outside ``GatheredParameters``)."""
        return list(self._shapes)

    def split_cores(self, flat: Tensor) -> list[Tensor]:
        """Views ``(r_{k-1}, modes..., r_k)`` of a flat tensor in this layer's core layout: ``core``
        itself, its ``.grad``, or an optimizer moment of it."""
        return split_flat(flat, self._shapes)

    @property
    def cores(self) -> tuple[Tensor, ...]:
        """The cores as views of ``core`` (read them, or write them in place under ``torch.no_grad()``;
        the parameter, its ``.grad`` and its optimizer state are ``core``'s). Needs the full ``core``:
        under ZeRO-3 read them inside ``GatheredParameters``."""
        return tuple(self.split_cores(self.core))

    def core_list(self) -> list[Tensor]:
        """``cores`` as a list: the views the forward contracts (a differentiable split of ``core``).
        Also what torch 2.11's Dynamo needs: it cannot unpack an ``nn.ParameterList``, which the
        cores were before the flat layout (the compiled trainer failed on the H200 image's 2.11)."""
        return self.split_cores(self.core)

    # ---- gates -------------------------------------------------------------------------

    @property
    def gates(self) -> tuple[Tensor, ...]:
        """Bond ``k``'s gates ``g_k`` ``(r_k,)``, views of ``gate`` (read them, or write them in place
        under ``torch.no_grad()``; the parameter, its ``.grad`` and its optimizer state are ``gate``'s).
        Needs the full ``gate``: under ZeRO-3 read them inside ``GatheredParameters``."""
        return self.gate.split(self._bonds)

    def masked_gates(self) -> list[Tensor]:
        """``m(g_k) = g_k * [g_k > tau]`` for every interior bond (differentiable in ``g``)."""
        return self._mask(self.gate)

    def _mask(self, gate: Tensor) -> list[Tensor]:
        """``gate`` (this layer's whole gate vector) masked once and split into its bonds."""
        return list((gate * gate_alive(gate, self.tau)).split(self._bonds))  # keeps g's dtype (bf16 stays bf16)

    def ranks(self) -> list[int]:
        """Active rank ``#(g_k > tau)`` of every interior bond (compared in fp32, see ``gate_alive``)."""
        return self.active_ranks().tolist()  # one host read for every bond

    def active_ranks(self) -> Tensor:
        """``ranks()`` as one int64 tensor ``(D-1,)`` on the gates' device: no host read, so the
        engine can all-reduce or log it without stalling the GPU (``ranks()`` reads it back once)."""
        if not self._bonds:  # a single core: no interior bond
            return torch.zeros(0, dtype=torch.int64, device=self.tau.device)
        alive = gate_alive(self.gate.detach(), self.tau)  # (sum r_k,)
        return torch.stack([a.sum() for a in alive.split(self._bonds)])

    def bond_offsets(self) -> list[int]:
        """Where bond ``k``'s gates start in ``gate``."""
        return list(itertools.accumulate(self._bonds, initial=0))[:-1]

    def _apply(self, fn: Any, recurse: bool = True) -> TensorizedModule:
        """``.to(dtype)``/``.bfloat16()``/DeepSpeed's bf16 cast move ``tau`` but keep it fp32: the
        threshold must be the same number for the working gates, the fp32 masters and the plan."""
        before = self._buffers.get("tau")
        out = super()._apply(fn, recurse)
        tau = self._buffers.get("tau")
        if tau is not None and tau.dtype != torch.float32:  # the fp32 value, not the rounded one, moved
            self._buffers["tau"] = before.detach().to(device=tau.device, dtype=torch.float32)
        return out

    def bond_dims(self) -> list[int]:
        """Physical size of every interior bond (what the cores store; known also under ZeRO-3)."""
        return list(self._bonds)

    def full_ranks(self, active: bool = True) -> list[int]:
        """``[1, r_1, ..., r_{D-1}, 1]`` with active or physical interior ranks."""
        return [1, *(self.ranks() if active else self.bond_dims()), 1]

    # ---- pruning -----------------------------------------------------------------------

    @torch.no_grad()
    def prune_(self, kept: dict[int, Tensor]) -> None:
        """Keep only ``kept[k]`` indices of bond ``k``: slices core ``k`` (last dim), core ``k+1``
        (first dim) and bond ``k``'s part of ``gate``; ``core`` and ``gate`` become fresh
        ``nn.Parameter``s (optimizer state must be rebuilt by the caller, see
        ``compression.pruning.apply_plan``, which slices it with ``slice_flat``)."""
        if "core" not in self._parameters or "gate" not in self._parameters:
            raise ValueError(f"prune_: this {type(self).__name__}'s core and gate are views of a model's packed "
                             "flat parameters (engine.packing); prune an unpacked model and pack it again")
        D = self.num_cores
        idx: dict[int, Tensor] = {}
        for k, ix in kept.items():
            if not isinstance(k, int) or not 0 <= k < D - 1:
                raise ValueError(f"kept has bond {k!r}; bonds are 0..{D - 2}")
            size = self._bonds[k]
            ix = torch.as_tensor(ix, dtype=torch.long, device=self.gate.device).reshape(-1)
            if ix.numel() == 0:
                raise ValueError(f"kept[{k}] is empty: a bond must keep at least one rank")
            if int(ix.min()) < 0 or int(ix.max()) >= size:
                raise ValueError(f"kept[{k}]={ix.tolist()} has indices outside 0..{size - 1}")
            if torch.unique(ix).numel() != ix.numel():
                raise ValueError(f"kept[{k}]={ix.tolist()} has duplicate indices")
            idx[k] = ix
        if not idx:
            return
        keep = self.gate_index(idx)
        core, self._shapes = slice_flat(self.core, self._shapes, idx)
        self.core = _like(self.core, core)
        self.gate = _like(self.gate, self.gate.index_select(0, keep))
        self._bonds = tuple(s[-1] for s in self._shapes[:-1])
        self.bond_sizes = self._bond_tensor(self.bond_sizes.device)

    def gate_index(self, kept: dict[int, Tensor]) -> Tensor:
        """Positions in ``gate`` that survive keeping ``kept[k]`` of bond ``k`` (other bonds whole)."""
        parts = [kept[k] + at if k in kept else torch.arange(at, at + r, device=self.gate.device)
                 for k, (at, r) in enumerate(zip(self.bond_offsets(), self._bonds))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.gate.device)

    # ---- state_dict shape check ----------------------------------------------------------

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        full = self.core.numel() == sum(math.prod(s) for s in self._shapes)  # not an empty ZeRO-3 shard
        self._upgrade(state_dict, prefix, "cores", "core", list(self._shapes), full)  # first: its error names the ranks
        self._upgrade(state_dict, prefix, "gates", "gate", [(r,) for r in self._bonds], full)
        self._check_bonds(state_dict, prefix)
        # the local shapes: under ZeRO-3 a rank's module tensors and its state_dict's are both empty
        for key, shape in ((f"{prefix}core", tuple(self.core.shape)), (f"{prefix}gate", tuple(self.gate.shape))):
            if key in state_dict and tuple(state_dict[key].shape) != shape:
                raise ValueError(
                    f"state_dict[{key!r}] has shape {tuple(state_dict[key].shape)} but this "
                    f"{type(self).__name__} expects {shape} (core shapes {list(self._shapes)}); a pruned "
                    f"checkpoint needs a model built with its ranks (its meta's plans, or the export's shapes)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _check_bonds(self, state_dict: dict[str, Any], prefix: str) -> None:
        """The state's ``bond_sizes`` must be this layer's: equal element counts do not mean equal
        shapes (a layer pruned to ranks [2, 4, 4] and one pruned to [4, 4, 2] can both hold 240). A
        state without the buffer was written before it, one parameter per core, whose shapes
        ``_upgrade`` has just checked piece by piece: it takes this layer's."""
        key = f"{prefix}bond_sizes"
        if key not in state_dict:
            state_dict[key] = self.bond_sizes.clone()
        elif state_dict[key].tolist() != list(self._bonds):
            raise ValueError(
                f"state_dict[{key!r}] is {state_dict[key].tolist()} but this {type(self).__name__} has bond sizes "
                f"{list(self._bonds)}; a pruned checkpoint needs a model built with its ranks "
                f"(ranks={[1, *state_dict[key].tolist(), 1]})")

    def _upgrade(self, state_dict: dict[str, Any], prefix: str, old: str, new: str,
                 shapes: list[tuple[int, ...]], full: bool) -> None:
        """An older state_dict's ``<old>.k`` tensors (one Parameter per core or bond, before the flat
        ``core``/``gate`` layout) flattened and concatenated into ``<new>``, each shape checked first."""
        keys = [f"{prefix}{old}.{k}" for k in range(len(shapes))]
        if f"{prefix}{new}" in state_dict or not keys or not all(k in state_dict for k in keys):
            return
        if full:
            for key, shape in zip(keys, shapes):
                if tuple(state_dict[key].shape) != shape:
                    hint = f" (ranks={[int(state_dict[k].shape[0]) for k in keys] + [1]})" if old == "cores" else ""
                    raise ValueError(
                        f"state_dict[{key!r}] has shape {tuple(state_dict[key].shape)} but this "
                        f"{type(self).__name__} expects {shape}; a pruned checkpoint needs a model built "
                        f"with its ranks{hint}")
        state_dict[f"{prefix}{new}"] = torch.cat([state_dict.pop(k).reshape(-1) for k in keys])


def split_flat(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """Views of ``flat`` (1-D, the shapes' elements end to end) at ``shapes``."""
    return [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]


def slice_flat(flat: Tensor, shapes: Sequence[tuple[int, ...]], kept: dict[int, Tensor]
               ) -> tuple[Tensor, tuple[tuple[int, ...], ...]]:
    """``flat`` in core layout ``shapes`` with only ``kept[k]`` of bond ``k`` (core ``k``'s last dim,
    core ``k+1``'s first): the new flat tensor and the new shapes. The one slicing rule, used for the
    cores (``prune_``) and their optimizer moments (``compression.pruning.apply_plan``)."""
    cores = split_flat(flat, shapes)
    for k, ix in kept.items():
        cores[k] = cores[k].index_select(cores[k].dim() - 1, ix)
        cores[k + 1] = cores[k + 1].index_select(0, ix)
    return torch.cat([c.reshape(-1) for c in cores]), tuple(tuple(c.shape) for c in cores)


def _like(old: nn.Parameter, data: Tensor) -> nn.Parameter:
    return nn.Parameter(data.contiguous().clone(), requires_grad=old.requires_grad)

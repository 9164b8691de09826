"""One flat parameter for a model's small dense vectors (biases, LayerNorm weights and biases) at ZeRO 0-2.

DeepSpeed's ZeRO 1-2 step does its bookkeeping per parameter tensor: copying each gradient into its
partition, one norm per gradient, re-viewing each weight into the flat buffer, the bf16 overflow check
(about 34 aten ops per tensor and step; most of them kernel launches on a GPU). A six-encoder MLM has
143 parameter tensors, 66 of them 1-D vectors of the "dense" role: the TT layers' biases, the
LayerNorms and the MLM head's. Trained as one flat parameter, the same numbers train the same way (AdamW is
element-wise, and they share one param group) and DeepSpeed sees 78 tensors.

This is the flat-parameter technique of PyTorch FSDP (``use_orig_params=False``): the owners' own
parameters are removed and, at the start of every forward of the model, each owner gets a plain-tensor
*view* of its piece of the flat parameter under its old attribute name (``split`` once, so the backward
is one concatenation into the flat gradient). Between forwards the attributes hold detached views
(the same storage, so in-place updates of the flat parameter show through; a forward, or
``install(detached=True)`` after DeepSpeed moved or cast the module, refreshes them).

The model's ``state_dict`` and ``load_state_dict`` keep the unpacked keys (``...query.bias``), so
model files, exports and evaluation see no difference; ``unpack_state``/``pack_state`` do the same for
the consolidated training state (``engine.prune.FullState``), which elastic resume and the prune
rebuild move between packed (ZeRO 0-2) and unpacked (ZeRO-3, where each module's parameters must stay
its own for DeepSpeed to gather them around its forward) engines. DeepSpeed's own ZeRO shards record
the packed parameter, so they only load into a packed engine: a checkpoint's meta says whether it was
packed (``packed_vectors``), and ``engine.resume`` takes the consolidated route when that differs.
``zero_to_fp32`` of those shards yields the flat entry; ``unpack_saved`` splits it for the unpacked
model (``comera evaluate`` and ``export`` read checkpoints that way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera_dist.compression.groups import param_roles

NAME = "packed_vectors"
"""The flat parameter's name: a parameter of the model itself (no submodule, so nothing iterating the
model's children meets it)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One packed vector: its state-dict names (one per owner; a shared parameter has several), owners."""

    names: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class PackedVectors:
    """The model's packing: ``flat`` (the model's parameter ``NAME``, the concatenated pieces) and the
    pieces; hands each owner its view (``install``). Kept as the model's ``_packed_vectors`` attribute."""

    def __init__(self, model: nn.Module, pieces: list[Piece]) -> None:
        self.model = model
        self.pieces = pieces

    @property
    def flat(self) -> nn.Parameter:
        """The model's parameter ``NAME``, looked up each time (``Module._apply`` may replace it)."""
        return self.model._parameters[NAME]

    def views(self, *, detached: bool = False) -> list[Tensor]:
        """Each piece's view of ``flat``, in order (one ``split``: its backward is one concatenation);
        ``detached``: views outside autograd (what the attributes hold between forwards)."""
        flat = self.flat.detach() if detached else self.flat
        chunks = flat.split([p.numel for p in self.pieces])
        return [c.view(p.shape) for c, p in zip(chunks, self.pieces, strict=True)]

    def install(self, *, detached: bool = False) -> None:
        """Give every owner its view under its old attribute name (a plain tensor, not a parameter)."""
        for piece, view in zip(self.pieces, self.views(detached=detached), strict=True):
            for module, attr in piece.owners:
                setattr(module, attr, view)

    def __repr__(self) -> str:
        return f"PackedVectors({len(self.pieces)} vectors, {self.flat.numel()} elements)"


def packed_of(model: nn.Module) -> PackedVectors | None:
    """The model's ``PackedVectors``, or None when it was not packed."""
    found = model.__dict__.get("_packed_vectors")
    return found if isinstance(found, PackedVectors) else None


def pack_vectors(model: nn.Module) -> PackedVectors | None:
    """Move ``model``'s trainable 1-D dense-role parameters into one flat parameter (see the module
    docstring); None when it has fewer than two. Not for ZeRO-3-partitioned models (``ds_id``)."""
    if packed_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already packed")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("pack_vectors: the model is partitioned by ZeRO-3, whose per-module gathering needs "
                         "every module's parameters to stay its own")
    chosen = _plan(model)
    if not chosen:
        return None
    pieces = [piece for piece, _ in chosen]
    with torch.no_grad():
        flat = _cat([p.detach() for _, p in chosen])
    for piece in pieces:
        for module, attr in piece.owners:
            del module._parameters[attr]
    model.register_parameter(NAME, nn.Parameter(flat))
    packed = model._packed_vectors = PackedVectors(model, pieces)
    packed.install(detached=True)
    model.register_forward_pre_hook(_install)
    model.register_forward_hook(_detach, always_call=True)
    model.register_state_dict_post_hook(_unpack_state_dict)
    model.register_load_state_dict_pre_hook(_pack_state_dict)
    return packed


def _plan(model: nn.Module) -> list[tuple[Piece, nn.Parameter]]:
    """The vectors ``pack_vectors`` packs, in order (deterministic for an architecture at given shapes:
    ``unpack_saved`` relies on it), each with its parameter; empty when fewer than two."""
    roles = param_roles(model)  # cores and gates: their own groups, and pruned, so never packed
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    first: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None or id(p) in roles or not p.requires_grad or p.dim() != 1 or not p.is_floating_point():
                continue
            owners.setdefault(id(p), []).append((f"{prefix}.{attr}" if prefix else attr, module, attr))
            first.setdefault(id(p), p)
    if not first:
        return []
    dtype, device = next(iter(first.values())).dtype, next(iter(first.values())).device
    chosen = [pid for pid, p in first.items() if p.dtype == dtype and p.device == device]
    if len(chosen) < 2:
        return []
    return [(Piece(names=tuple(n for n, _, _ in owners[pid]),
                   owners=tuple({(id(m), a): (m, a) for _, m, a in owners[pid]}.values()),  # a module used twice
                   shape=tuple(first[pid].shape)), first[pid]) for pid in chosen]


def unpack_saved(model: nn.Module, state: dict[str, Tensor]) -> None:
    """In place: a state dict read from a packed run's DeepSpeed shards (``zero_to_fp32`` yields the flat
    ``NAME`` entry) gets the per-module keys of ``model``, the unpacked model at the run's shapes."""
    flat = state.pop(NAME, None)
    if flat is None:
        return
    pieces = [piece for piece, _ in _plan(model)]
    total = sum(p.numel for p in pieces)
    if flat.numel() != total:
        raise ValueError(f"the saved {NAME!r} holds {flat.numel()} values; the model's {len(pieces)} dense "
                         f"vectors hold {total}")
    state.update(_split(pieces, flat))


def _install(model: nn.Module, args) -> None:
    """Forward pre-hook of the packed model (a function of its module, so a deep copy uses its own)."""
    packed = packed_of(model)
    if packed is not None:
        packed.install()


def _detach(model: nn.Module, args, output) -> None:
    """Forward hook: between forwards the owners hold detached views (no autograd graph kept alive, and
    the module can be deep-copied)."""
    packed = packed_of(model)
    if packed is not None:
        packed.install(detached=True)


def _unpack_state_dict(model: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    packed = packed_of(model)
    if packed is None or prefix + NAME not in state:
        return
    for name, view in _split(packed.pieces, state.pop(prefix + NAME)):
        state[prefix + name] = view


def _pack_state_dict(model: nn.Module, state: dict, prefix: str, *args) -> None:
    packed = packed_of(model)
    if packed is None or not all(prefix + p.names[0] in state for p in packed.pieces):
        return  # a packed key, or pieces missing: the normal load reports what is missing
    state[prefix + NAME] = _cat(_take(packed.pieces, state, prefix))


def unpack_state(model: nn.Module, params: dict[str, Tensor], moments: dict[str, dict[str, Tensor]]) -> None:
    """In place: the packed entry of a consolidated state (weights and AdamW moments, keyed by
    ``named_parameters(remove_duplicate=False)`` names) becomes one entry per piece and owner."""
    packed = packed_of(model)
    if packed is None or NAME not in params:
        return
    flat_moments = moments.pop(NAME, {})
    params.update((n, v.clone()) for n, v in _split(packed.pieces, params.pop(NAME)))
    per_key = {k: dict(_split(packed.pieces, v)) for k, v in flat_moments.items()}
    for piece in packed.pieces:
        for name in piece.names:
            moments[name] = {k: views[name].clone() for k, views in per_key.items()}


def pack_state(model: nn.Module, params: dict[str, Tensor], moments: dict[str, dict[str, Tensor]]) -> None:
    """In place: the inverse of ``unpack_state`` for a packed ``model`` (a no-op for an unpacked one)."""
    packed = packed_of(model)
    if packed is None:
        return
    missing = [p.names[0] for p in packed.pieces if p.names[0] not in params]
    if missing:
        raise ValueError(f"pack_state: the state lacks {missing[:5]} ({len(missing)} packed vectors)")
    params[NAME] = _cat(_take(packed.pieces, params))
    states = [s or {} for s in _take(packed.pieces, moments)]
    moments[NAME] = {k: _cat([s[k] for s in states]) for k in states[0]} if all(states) else {}


def _split(pieces: list[Piece], flat: Tensor) -> list[tuple[str, Tensor]]:
    """``(name, view)`` for every piece and each of its names: ``flat`` cut back into the vectors."""
    chunks = flat.split([p.numel for p in pieces])
    return [(name, chunk.view(p.shape)) for p, chunk in zip(pieces, chunks, strict=True) for name in p.names]


def _take(pieces: list[Piece], entries: dict, prefix: str = "") -> list:
    """Pop every piece's entries (under all its names) from ``entries``; the first name's values, in order."""
    first = [entries.pop(prefix + p.names[0], None) for p in pieces]
    for p in pieces:
        for name in p.names[1:]:
            entries.pop(prefix + name, None)
    return first


def _cat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])

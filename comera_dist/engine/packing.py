"""The model's 1-D and 2-D parameters trained as one flat parameter per role (cores, gates, dense) at
ZeRO 0-2.

DeepSpeed's ZeRO 1-2 step does its bookkeeping per parameter tensor: copying each gradient into its
partition, one norm per gradient, re-viewing each weight into the flat buffer, the bf16 overflow check
(about 32 aten ops per tensor and step; most of them kernel launches on a GPU). A six-encoder MLM has
143 parameter tensors: every tensorized layer's flat ``core`` and ``gate`` (37 each), 66 vectors of the
"dense" role (the TT layers' biases, the LayerNorms, the MLM head's) and 3 tables and matrices of it
(the position and token-type tables, the MLM head's transform). Each role has its own AdamW group
(learning rate, weight decay), and AdamW is element-wise within a group, so the same numbers train the
same way as one flat parameter per role: ``packed_cores``, ``packed_gates`` and ``packed_vectors``
(the dense role's, named when it held vectors only). DeepSpeed then sees 3 tensors (6 with the first
layout, which left the 2-D ones alone: ``LAYOUT``).

This is the flat-parameter technique of PyTorch FSDP (``use_orig_params=False``): the owners' own
parameters are removed and, at the start of every forward of the model, each owner gets a plain-tensor
*view* of its piece of the flat parameter under its old attribute name (``split`` once per role, so the
backward is one concatenation into each flat gradient). Between forwards the attributes hold detached
views (the same storage, so in-place updates of the flat parameter show through, and the readers of the
gates between steps, S and the metrics, see current values; made once per storage of each flat
parameter and reused, so a compiled forward leaves nothing to rebuild after its graph: an eager forward,
or ``install(detached=True)`` after DeepSpeed moved or cast the module, makes them again when the flat
parameter moved). Code outside the model's forward that needs
gradients through the owners' attributes (the session's rank penalty) runs inside ``attached(model)``.

The model's ``state_dict`` and ``load_state_dict`` keep the unpacked keys (``...query.bias``,
``...query.core``), so model files, exports and evaluation see no difference; ``unpack_state`` and
``pack_state`` do the same for the consolidated training state (``engine.prune.FullState``), which
elastic resume and the prune rebuild move between packed (ZeRO 0-2) and unpacked (ZeRO-3, where each
module's parameters must stay its own for DeepSpeed to gather them around its forward) engines. A
prune always rebuilds the model unpacked and packs the new one. DeepSpeed's own ZeRO shards record the
flat parameters, so they only load into an engine packed the same way: a checkpoint's meta records
the packed roles (``packing``), and ``engine.resume`` takes the consolidated route when they differ.
``zero_to_fp32`` of those shards yields the flat entries; ``unpack_saved`` splits them for the unpacked
model (``comera evaluate`` and ``export`` read checkpoints that way).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera_dist.compression.groups import ROLES, param_roles
from comera_dist.models.blocks import RECOMPUTE_CONTEXT

NAMES = {"cores": "packed_cores", "gates": "packed_gates", "dense": "packed_vectors"}
"""Each role's flat parameter: a parameter of the model itself (no submodule, so nothing iterating the
model's children meets it). ``packed_vectors`` is the dense role's name since the first packing (dense
vectors only), so its shards and ``zero_to_fp32`` entries keep meaning the same."""


LAYOUT = 2
"""What a packing holds, as a checkpoint's meta records it (``packing_layout``): 1, the 1-D parameters
(checkpoints before the tenth session); 2, the 2-D ones of the dense role too (position and token-type
tables, the MLM head's transform), so a six-encoder MLM trains as 3 tensors instead of 6."""
DIMS = {1: (1,), 2: (1, 2)}
"""The parameter dims each layout packs."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One packed parameter: its state-dict names (one per owner; a shared parameter has several), owners,
    element count and shape."""

    names: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Pack:
    """One role's flat parameter (the model's parameter ``name``) and its pieces, in order."""

    role: str
    name: str
    pieces: tuple[Piece, ...]


class Packing:
    """The model's packs (one per role with two or more parameters); hands each owner its view
    (``install``). Kept as the model's ``_packing`` attribute."""

    def __init__(self, model: nn.Module, packs: list[Pack], layout: int = LAYOUT) -> None:
        self.model = model
        self.packs = packs
        self.layout = layout
        self._resting: dict[str, list[Tensor]] = {}  # pack name -> its pieces' resting views

    def flat(self, pack: Pack) -> nn.Parameter:
        """The model's parameter ``pack.name``, looked up each time (``Module._apply`` may replace it)."""
        return self.model._parameters[pack.name]

    def views(self, pack: Pack, *, detached: bool = False) -> list[Tensor]:
        """Each piece's view of ``pack``'s flat parameter, in order (one ``split``: its backward is one
        concatenation); ``detached``: views outside autograd (what the attributes hold between forwards)."""
        flat = self.flat(pack).detach() if detached else self.flat(pack)
        return _shaped(pack.pieces, flat.split([p.numel for p in pack.pieces]))

    def install(self, *, detached: bool = False, roles: tuple[str, ...] = ROLES) -> None:
        """Give every owner of ``roles`` its view under its old attribute name (a plain tensor, not a
        parameter): in autograd, or ``detached``, the resting views (``resting_views``)."""
        for pack in self.packs:
            if pack.role in roles:
                views = self.resting_views(pack) if detached else self.views(pack)
                for piece, view in zip(pack.pieces, views, strict=True):
                    for module, attr in piece.owners:
                        setattr(module, attr, view)

    def resting_views(self, pack: Pack) -> list[Tensor]:
        """The detached views the owners hold between forwards, made once per storage of the flat
        parameter and reused (in-place updates show through them).

        Reuse is what keeps a compiled forward's epilogue empty: every attribute a compiled forward
        leaves set to a tensor made inside it is rebuilt after the graph, about 3 host ops per piece
        (``detach``, ``split``, a view: 420 for the six-encoder MLM's 140 pieces), while a tensor that
        existed before the call is only put back. Eager, the views are made again when the flat
        parameter moved (``Module._apply``, DeepSpeed's re-viewing): the cached views keep the old
        storage alive, so a new one cannot take its address. Inside a traced forward, where addresses
        cannot be read, when its dtype or device changed."""
        views = self._resting.get(pack.name)
        if views is None or not _views_of(views, self.flat(pack), traced=torch.compiler.is_compiling()):
            views = self.views(pack, detached=True)
            if not torch.compiler.is_compiling():
                self._resting[pack.name] = views
        return views

    def refresh(self) -> None:
        """Eager: give the owners of every pack whose flat parameter moved since its resting views were
        made new ones (a compiled forward cannot see such a move when dtype and device stayed)."""
        for pack in self.packs:
            views = self._resting.get(pack.name)
            if views is None or not _views_of(views, self.flat(pack), traced=False):
                self.install(detached=True, roles=(pack.role,))

    def roles(self) -> dict[int, str]:
        """``id(flat parameter) -> role`` (what ``compression.groups.param_roles`` reports for a packed
        model)."""
        return {id(self.flat(pack)): pack.role for pack in self.packs}

    def __repr__(self) -> str:
        return "Packing(" + ", ".join(f"{p.name}: {len(p.pieces)} parameters, {self.flat(p).numel()} elements"
                                      for p in self.packs) + ")"


def _views_of(views: list[Tensor], flat: Tensor, *, traced: bool) -> bool:
    """Whether ``views`` (a pack's, end to end from its first element) still show ``flat``: the same
    dtype and device, and (not ``traced``: addresses cannot be read in a graph) the same storage and
    offset."""
    first = views[0]
    if first.dtype != flat.dtype or first.device != flat.device:
        return False
    return traced or (first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                      and first.storage_offset() == flat.storage_offset())


def packed_of(model: nn.Module) -> Packing | None:
    """The model's ``Packing``, or None when it was not packed."""
    found = model.__dict__.get("_packing")
    return found if isinstance(found, Packing) else None


def packing_layout(model: nn.Module) -> int:
    """The packed model's ``LAYOUT``, 0 for an unpacked one (what a checkpoint's meta records as
    ``packing_layout``)."""
    packing = packed_of(model)
    return packing.layout if packing is not None else 0


def packed_roles(model: nn.Module) -> list[str]:
    """The roles packed in ``model``, sorted (what a checkpoint's meta records as ``packing``)."""
    packing = packed_of(model)
    return sorted(p.role for p in packing.packs) if packing is not None else []


def pack_vectors(model: nn.Module, layout: int = LAYOUT) -> Packing | None:
    """Move ``model``'s trainable parameters of ``layout``'s dims (``DIMS``: 1-D and 2-D) into one flat
    parameter per role (see the module docstring); None when no role has two. Not for
    ZeRO-3-partitioned models (``ds_id``)."""
    if packed_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already packed")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("pack_vectors: the model is partitioned by ZeRO-3, whose per-module gathering needs "
                         "every module's parameters to stay its own")
    plan = _plan(model, layout)
    if not plan:
        return None
    packs = []
    for role, chosen in plan.items():
        with torch.no_grad():
            flat = _cat([p.detach() for _, p in chosen])
        for piece, _ in chosen:
            for module, attr in piece.owners:
                del module._parameters[attr]
        model.register_parameter(NAMES[role], nn.Parameter(flat))
        packs.append(Pack(role=role, name=NAMES[role], pieces=tuple(piece for piece, _ in chosen)))
    packing = model._packing = Packing(model, packs, layout)
    packing.install(detached=True)
    model.forward = types.MethodType(_packed_forward, model)
    # a block recomputed in backward (model.activation_checkpointing) runs after the forward put the
    # detached views back: it reads the views in autograd again, or it would save less than its forward
    setattr(model, RECOMPUTE_CONTEXT, types.MethodType(attached, model))
    model.register_state_dict_post_hook(_unpack_state_dict)
    model.register_load_state_dict_pre_hook(_pack_state_dict)
    return packing


def holder(model: nn.Module, module: nn.Module, attr: str) -> tuple[nn.Parameter, slice]:
    """The parameter holding ``module.<attr>`` and where in it, flattened: the module's own parameter
    (all of it), or the model's packed flat parameter (the piece's span). For DeepSpeed's ``safe_*``
    API (fp32 masters, moments, full gradients), which knows the parameters it trains, not views."""
    own = module._parameters.get(attr)
    if own is not None:
        return own, slice(0, own.numel())
    packing = packed_of(model)
    for pack in packing.packs if packing is not None else ():
        at = 0
        for piece in pack.pieces:
            if any(m is module and a == attr for m, a in piece.owners):
                return packing.flat(pack), slice(at, at + piece.numel)
            at += piece.numel
    raise ValueError(f"{type(module).__name__}.{attr} is neither a parameter of the module nor packed in "
                     "the model")


@contextlib.contextmanager
def attached(model: nn.Module, roles: tuple[str, ...] = ROLES) -> Iterator[None]:
    """Inside the block the owners of ``roles`` hold views in autograd (as during a forward), so code
    outside the forward can differentiate through them (``rank_penalty(model)``). No-op if unpacked."""
    packing = packed_of(model)
    if packing is None:
        yield
        return
    packing.install(roles=roles)
    try:
        yield
    finally:
        packing.install(detached=True, roles=roles)


def _plan(model: nn.Module, layout: int = LAYOUT) -> dict[str, list[tuple[Piece, nn.Parameter]]]:
    """Per role (ROLES order), the parameters ``pack_vectors`` packs (those of ``layout``'s dims), in order
    (deterministic for an architecture at given shapes: ``unpack_saved`` relies on it), each with its
    parameter; a role with fewer than two is left out."""
    roles = param_roles(model)
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    first: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None or not p.requires_grad or p.dim() not in DIMS[layout] or not p.is_floating_point():
                continue
            owners.setdefault(id(p), []).append((f"{prefix}.{attr}" if prefix else attr, module, attr))
            first.setdefault(id(p), p)
    plan: dict[str, list[tuple[Piece, nn.Parameter]]] = {}
    for role in ROLES:
        mine = [p for pid, p in first.items() if roles.get(pid, "dense") == role]
        chosen = [p for p in mine if p.dtype == mine[0].dtype and p.device == mine[0].device] if mine else []
        if len(chosen) < 2:
            continue
        plan[role] = [(Piece(names=tuple(n for n, _, _ in owners[id(p)]),
                             # one entry per (module, attribute): a module used twice owns it once
                             owners=tuple({(id(m), a): (m, a) for _, m, a in owners[id(p)]}.values()),
                             numel=p.numel(), shape=tuple(p.shape)), p) for p in chosen]
    return plan


def unpack_saved(model: nn.Module, state: dict[str, Tensor]) -> None:
    """In place: a state dict read from a packed run's DeepSpeed shards (``zero_to_fp32`` yields the flat
    entries, ``NAMES``) gets the per-module keys of ``model``, the unpacked model at the run's shapes."""
    plans = {layout: _plan(model, layout) for layout in sorted(DIMS, reverse=True)}
    for role in ROLES:
        flat = state.pop(NAMES[role], None)
        if flat is None:
            continue
        # the layout that wrote it: the one whose pieces hold as many values (a layout-1 run's shards too)
        candidates = [[piece for piece, _ in plan[role]] for plan in plans.values() if role in plan]
        pieces = next((c for c in candidates if sum(p.numel for p in c) == flat.numel()), None)
        if pieces is None:
            raise ValueError(f"the saved {NAMES[role]!r} holds {flat.numel()} values; the model's {role} "
                             f"parameters hold {sorted({sum(p.numel for p in c) for c in candidates})} "
                             f"(packing layouts {sorted(plans)})")
        state.update(_split(pieces, flat))
    left = sorted(set(NAMES.values()) & set(state))
    if left:
        raise ValueError(f"the saved {left} match no two parameters of the model: a checkpoint of another model?")


def _packed_forward(model: nn.Module, *args, **kwargs):
    """The packed model's ``forward`` (bound to it, so a deep copy binds its own): the class's forward
    between ``install`` and the detached views (no autograd graph kept alive between forwards, and the
    module can be deep-copied). Being the forward itself rather than forward hooks, it traces as one
    graph under ``torch.compile`` (``train.compile``), views and their backward included, whose inputs
    are the flat parameters. Hooks traced as frames of their own: three graphs, the forward's taking
    every view as an input of its own, which CUDA-graph trees (``compile_mode=reduce-overhead``) do not
    know as parameters and copy into their static buffers at each replay (read in torch's
    ``cudagraph_trees``; not measured on a GPU)."""
    packing = packed_of(model)
    packing.install()
    try:
        return type(model).forward(model, *args, **kwargs)
    finally:
        packing.install(detached=True)


def _unpack_state_dict(model: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    packing = packed_of(model)
    for pack in packing.packs if packing is not None else ():
        if prefix + pack.name in state:
            for name, view in _split(pack.pieces, state.pop(prefix + pack.name)):
                state[prefix + name] = view


def _pack_state_dict(model: nn.Module, state: dict, prefix: str, *args) -> None:
    """Load pre-hook: the per-module entries of each pack become its flat entry. A pack with an entry
    missing is left alone, for the normal load to report; a state of other ranks fails the layers' own
    ``bond_sizes`` check, which names them."""
    packing = packed_of(model)
    for pack in packing.packs if packing is not None else ():
        if all(prefix + p.names[0] in state for p in pack.pieces):
            state[prefix + pack.name] = _cat(_take(pack.pieces, state, prefix))


def unpack_state(model: nn.Module, params: dict[str, Tensor], moments: dict[str, dict[str, Tensor]]) -> None:
    """In place: the packed entries of a consolidated state (weights and AdamW moments, keyed by
    ``named_parameters(remove_duplicate=False)`` names) become one entry per piece and owner."""
    packing = packed_of(model)
    for pack in packing.packs if packing is not None else ():
        if pack.name not in params:
            continue
        flat_moments = moments.pop(pack.name, {})
        params.update((n, v.clone()) for n, v in _split(pack.pieces, params.pop(pack.name)))
        per_key = {k: dict(_split(pack.pieces, v)) for k, v in flat_moments.items()}
        for piece in pack.pieces:
            for name in piece.names:
                moments[name] = {k: views[name].clone() for k, views in per_key.items()}


def pack_state(model: nn.Module, params: dict[str, Tensor], moments: dict[str, dict[str, Tensor]]) -> None:
    """In place: the inverse of ``unpack_state`` for a packed ``model`` (a no-op for an unpacked one)."""
    packing = packed_of(model)
    for pack in packing.packs if packing is not None else ():
        missing = [p.names[0] for p in pack.pieces if p.names[0] not in params]
        if missing:
            raise ValueError(f"pack_state: the state lacks {missing[:5]} ({len(missing)} packed {pack.role} "
                             "parameters)")
        params[pack.name] = _cat(_take(pack.pieces, params))
        states = [s or {} for s in _take(pack.pieces, moments)]
        moments[pack.name] = {k: _cat([s[k] for s in states]) for k in states[0]} if all(states) else {}


def _split(pieces: Sequence[Piece], flat: Tensor) -> list[tuple[str, Tensor]]:
    """``(name, view)`` for every piece and each of its names: ``flat`` cut back into the parameters."""
    chunks = _shaped(pieces, flat.split([p.numel for p in pieces]))
    return [(name, chunk) for p, chunk in zip(pieces, chunks, strict=True) for name in p.names]


def _shaped(pieces: Sequence[Piece], chunks: Sequence[Tensor]) -> list[Tensor]:
    """Each 1-D chunk of a split flat tensor viewed at its piece's shape (a 1-D piece takes no view op)."""
    return [c if len(p.shape) == 1 else c.view(p.shape) for p, c in zip(pieces, chunks, strict=True)]


def _take(pieces: Sequence[Piece], entries: dict, prefix: str = "") -> list:
    """Pop every piece's entries (under all its names) from ``entries``; the first name's values, in order."""
    first = [entries.pop(prefix + p.names[0], None) for p in pieces]
    for p in pieces:
        for name in p.names[1:]:
            entries.pop(prefix + name, None)
    return first


def _cat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])

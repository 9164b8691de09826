"""Shared L/R factors: every TT linear layer of a model contracted once per forward, same shapes together.

A six-encoder has 37 TT linear layers in 3 shapes (768x768, 768x3072, 3072x768). Contracting
each layer's cores into ``L``/``R`` separately costs about a hundred small ops per layer and
step (forward and backward); stacking the cores of the layers that share their modes and
contracting them as one batched chain (``tensor.contract.contract_halves_batched``) costs about
the same per group. After a physical prune the layers of a group keep different ranks: their cores
and gates are then stacked zero-padded to the group's largest ranks (``layers.ragged``; a padded
rank has gate 0, so it is masked out and adds exactly nothing) and each layer's ``L``/``R`` is cut
back to its own middle rank on the CPU, or keeps the padded one on a GPU
(``kernels.dispatch.keeps_padded_ranks``), so pruning never costs the batching. The model computes
``shared_factors(self)`` once at the top of its forward and hands the mapping down;
``project(layer, x, factors)`` applies a layer with its factors (or without, for dense layers,
layers with a forced non-``lr`` order, and callers that pass none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from comera_dist.kernels import dispatch
from comera_dist.layers.base import TensorizedModule, gate_alive, gate_sums
from comera_dist.layers.linear import TTLinear
from comera_dist.layers.ragged import padded_cores, padded_segments
from comera_dist.tensor import contract
from comera_dist.tensor.smallops import on_one_thread

Factors = Mapping[int, tuple[Tensor, Tensor]]
"""``id(layer) -> (L (N_in, r_d), R (r_d, N_out))`` for the TT linear layers of one forward."""


def shared_factors(module: nn.Module) -> dict[int, tuple[Tensor, Tensor]]:
    """``L``/``R`` of every TT linear layer in ``module`` whose order is ``auto`` or ``lr``.

    Layers whose cores have the same modes (and dtype, device, split ``d``) are contracted
    together, zero-padded to the group's largest ranks; a group of one goes through the layer's
    own ``_halves``. Differentiable. Empty under ZeRO-3 (see ``partitioned``): each layer then
    contracts its own cores in its own forward.
    """
    if partitioned(module):
        return {}
    return _shared(module, with_penalty=False)[0]


def partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions ``module``'s parameters (it marks each with ``ds_id``).

    ZeRO-3 gathers a submodule's parameters only around that submodule's own forward, so a
    model-level contraction of every layer's cores would read empty shards.
    """
    return any(hasattr(p, "ds_id") for p in module.parameters())


def shared_factors_and_penalty(module: nn.Module, skip: Iterable[nn.Module] = ()
                               ) -> tuple[dict[int, tuple[Tensor, Tensor]], Tensor | None]:
    """``shared_factors(module)`` (less ``skip``'s layers) and the rank penalty R of every gate in ``module`` (None
    without gates).

    R is ``compression.penalty.rank_penalty``'s value, ``sum m(g) / #(g > tau)`` over all gates,
    computed from the same stacked masks the grouped factors use: a grouped gate then feeds one
    stack, so its gradient arrives once instead of being summed from the factors and a separate
    penalty pass. The gate vectors outside the groups (the embedding, singletons, forced orders)
    go through ``layers.base.gate_sums`` as the penalty's do.
    ``skip``: submodules whose layers get no factors here (a recomputed block contracts its own inside its
    recomputation, ``models.blocks.run_blocks``); their gates still count in R, through ``gate_sums``.
    Under ZeRO-3 (``partitioned``): no factors and no R (the caller computes R its own way).
    """
    if partitioned(module):
        return {}, None
    return _shared(module, with_penalty=True, skip=skip)


def _shared(module: nn.Module, *, with_penalty: bool, skip: Iterable[nn.Module] = ()
            ) -> tuple[dict[int, tuple[Tensor, Tensor]], Tensor | None]:
    skipped = {id(layer) for sub in skip for layer in sub.modules()}
    groups: dict[tuple, list[TTLinear]] = {}
    for layer in module.modules():
        if isinstance(layer, TTLinear) and layer.order in ("auto", "lr") and id(layer) not in skipped:
            key = (layer.d, tuple(s[1:-1] for s in layer.core_shapes()), layer.core.dtype, layer.core.device)
            groups.setdefault(key, []).append(layer)
    out: dict[int, tuple[Tensor, Tensor]] = {}
    terms: list[tuple[Tensor, Tensor]] = []  # (sum of m(g) in fp32, surviving count) per batched group
    covered: set[int] = set()
    for group in groups.values():
        if len(group) == 1:
            layer = group[0]
            out[id(layer)] = on_one_thread(layer._halves, layer.core, layer.gate)
            continue
        G = len(group)
        params = [t for layer in group for t in (layer.core, layer.gate, layer.tau)]
        shapes = tuple(tuple(layer.core_shapes()) for layer in group)
        shape = (G, group[0].d, shapes, not dispatch.keeps_padded_ranks(group[0].core))
        got = on_one_thread(lambda *p, s=shape: _batched(p, *s), *params)  # G L, G R, sum, count
        for i, layer in enumerate(group):
            out[id(layer)] = (got[i], got[G + i])
        terms.append((got[2 * G], got[2 * G + 1]))
        covered.update(id(layer) for layer in group)
    if not with_penalty:
        return out, None
    rest = [(layer.gate, layer.tau) for layer in module.modules()  # whole gate vectors: R is entry-wise
            if isinstance(layer, TensorizedModule) and id(layer) not in covered and layer.bond_dims()]
    terms += gate_sums([g for g, _ in rest], [tau for _, tau in rest])
    if not terms:
        return out, None
    total = terms[0][0]
    count = terms[0][1]
    for t, c in terms[1:]:
        total, count = total + t, count + c
    return out, total / count.clamp(min=1)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 gates: the penalty's arithmetic dtype (plain Python, no aten op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batched(params: tuple[Tensor, ...], G: int, d: int, shapes: tuple[tuple[tuple[int, ...], ...], ...],
             cut: bool = True) -> tuple[Tensor, ...]:
    """Stack the group's cores/gates/thresholds (zero-padded where ranks differ), mask, contract:
    ``(*L_i, *R_i, sum m(g), #alive)`` with each ``L_i``/``R_i`` at layer ``i``'s own middle rank when
    ``cut``, else at the group's (``kernels.dispatch.keeps_padded_ranks``: the padding is exact zeros);
    either rounded up to ``kernels.dispatch.aligned_rank`` with zeros too.

    ``params`` is ``(core, gate, tau)`` per layer, ``shapes[i]`` layer ``i``'s core shapes."""
    cores = padded_cores([params[3 * i] for i in range(G)], shapes)  # (G, r, n_k, r') per core
    bonds = tuple(tuple(c[-1] for c in s[:-1]) for s in shapes)
    g = padded_segments([params[3 * i + 1] for i in range(G)], bonds)  # (G, sum max r_k): padding is 0
    tau = torch.stack([params[3 * i + 2] for i in range(G)]).reshape(G, 1)  # (G, 1)
    alive = gate_alive(g, tau)  # (G, sum r_k) bool, the layers' own rule (tau > 0: padding is dead)
    m = g * alive  # m(g) = g [g > tau]
    total = m.sum(dtype=_acc(g.dtype))  # () penalty numerator
    count = alive.sum().to(total.dtype)  # () surviving entries
    widths = [max(b[k] for b in bonds) for k in range(len(shapes[0]) - 1)]
    L, R = contract.contract_halves_batched(cores, list(m.split(widths, dim=1)), d)  # (G, N_in, r_d), (G, r_d, N_out)
    L, R = dispatch.pad_rank(L, R)  # zero columns of L, zero rows of R: (x L) R is unchanged, its GEMMs aligned
    width = L.shape[-1]
    Ls, Rs = L.unbind(0), R.unbind(0)
    if not cut:
        return (*Ls, *Rs, total, count)
    mid = [dispatch.aligned_rank(b[d - 1]) for b in bonds]  # each layer's own middle rank, aligned
    Ls = [x if r == width else x[:, :r] for x, r in zip(Ls, mid)]
    Rs = [x if r == width else x[:r] for x, r in zip(Rs, mid)]
    return (*Ls, *Rs, total, count)


def project_shared_input(layers: Sequence[nn.Module], x: Tensor, factors: Factors | None) -> list[Tensor]:
    """``[project(layer, x, factors) for layer in layers]`` for layers that read the same ``x``
    (attention's Q, K, V). When every one is a TT layer with its shared factors, the input side of all
    of them is one GEMM (``kernels.dispatch.tt_linear_shared``)."""
    lrs = [None if factors is None else factors.get(id(layer)) for layer in layers]
    if any(lr is None for lr in lrs):
        return [project(layer, x, factors) for layer in layers]
    for layer in layers:
        layer.check_input(x)
    return dispatch.tt_linear_shared(x, lrs, [layer.bias for layer in layers])


def project_ffn(inp: nn.Module, out: nn.Module, x: Tensor, factors: Factors | None) -> Tensor:
    """``out(gelu(inp(x)))``, an FFN. When both are TT layers with their shared factors, as one op that keeps
    no (T, F) tensor for backward (``kernels.dispatch.tt_ffn``); otherwise ``project`` twice, GELU fused into
    ``out``'s input side, which keeps ``inp(x)``."""
    lr_in, lr_out = (None, None) if factors is None else (factors.get(id(inp)), factors.get(id(out)))
    if lr_in is None or lr_out is None:
        return project(out, project(inp, x, factors), factors, gelu_input=True)
    inp.check_input(x)
    return dispatch.tt_ffn(x, lr_in, inp.bias, lr_out, out.bias)


def project(layer: nn.Module, x: Tensor, factors: Factors | None, *, gelu_input: bool = False) -> Tensor:
    """``layer(x)``, with the layer's shared factors when ``factors`` holds them.

    ``gelu_input``: ``layer(gelu(x))``, fused (``tensor.fused``); ``layer`` is a ``TTLinear`` or a
    ``layers.dense.Linear``."""
    kw = {"gelu_input": True} if gelu_input else {}
    lr = None if factors is None else factors.get(id(layer))
    if lr is None:
        return layer(x, **kw)
    return layer(x, factors=lr, **kw)

"""Stack tensors of different sizes into one zero-padded tensor, by one gather with a cached index.

``padded_cores`` does it for every core of a group of layers at once, from their flat ``core``
parameters: one gather builds all the stacked, padded cores.

After a physical prune the TT layers of one shape class keep different ranks, so their cores no
longer ``torch.stack``; contracting each layer apart costs about a hundred small ops per layer and
step. ``padded_stack`` places every tensor in the corner of a zero tensor of the largest shape, and
``padded_segments`` every layer's gate vector bond by bond (each bond's block padded to the largest
size): one ``cat`` and one ``index`` whatever the count, with an index built once per set of shapes
(cached, on the tensors' device). Both are differentiable (each input's gradient is its part of the
output's) and static under CUDA graphs (build the index before a capture: a warm-up step does, as
``bench.graphed`` runs). Equal shapes take plain ``torch.stack``. Under
``torch.compile`` they pad each tensor with ``F.pad`` instead: Dynamo would trace the cached index's
construction into the graph (it ignores ``functools.lru_cache``), while the compiler fuses the pads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from comera_dist.layers.base import split_flat

Shapes = tuple[tuple[int, ...], ...]


def padded_stack(tensors: Sequence[Tensor]) -> Tensor:
    """``(G, *max shape)``: ``tensors[i]`` in the corner ``[i, :s_0, :s_1, ...]``, zeros elsewhere."""
    shapes = tuple(tuple(t.shape) for t in tensors)
    if len(set(shapes)) == 1:
        return torch.stack(list(tensors))
    if torch.compiler.is_compiling():
        top = _top(shapes)
        return torch.stack([F.pad(t, [p for n, m in zip(reversed(t.shape), reversed(top)) for p in (0, m - n)])
                            for t in tensors])
    return _gather(tensors, _corner_index(shapes, tensors[0].device))


def padded_segments(vectors: Sequence[Tensor], segments: Sequence[Sequence[int]]) -> Tensor:
    """``(G, sum_k max_i segments[i][k])``: segment ``k`` of ``vectors[i]`` (its lengths in
    ``segments[i]``, end to end) at the start of block ``k``, zeros after it."""
    segs = tuple(tuple(int(n) for n in s) for s in segments)
    if len(set(segs)) == 1:
        return torch.stack(list(vectors))
    if torch.compiler.is_compiling():
        widths = _top(segs)
        return torch.stack([torch.cat([F.pad(piece, (0, w - piece.shape[0])) for piece, w in zip(v.split(s), widths)])
                            for v, s in zip(vectors, segs)])
    return _gather(vectors, _segment_index(segs, vectors[0].device))


def padded_cores(flats: Sequence[Tensor], shapes: Sequence[Shapes]) -> list[Tensor]:
    """Layer ``i``'s flat cores ``flats[i]`` (its core shapes ``shapes[i]``, end to end) as the group's
    stacked cores ``(G, *max shape_k)``, each layer's core ``k`` in the corner of block ``k``: one
    ``cat`` and one ``index`` for every core of every layer (``padded_stack`` per core under
    ``torch.compile``). Equal shapes stack the flat cores once and view the stack."""
    shapes = tuple(tuple(tuple(int(n) for n in c) for c in s) for s in shapes)
    if len(set(shapes)) == 1:
        return split_stacked(torch.stack(list(flats)), shapes[0])
    tops = tuple(_top(tuple(s[k] for s in shapes)) for k in range(len(shapes[0])))
    if torch.compiler.is_compiling():
        per = [split_flat(f, s) for f, s in zip(flats, shapes)]
        return [padded_stack([cores[k] for cores in per]) for k in range(len(tops))]
    return split_stacked(_gather(flats, _flat_index(shapes, flats[0].device)), tops)


def split_stacked(stacked: Tensor, shapes: Shapes) -> list[Tensor]:
    """Views ``(G, *shapes[k])`` of ``stacked (G, sum of the shapes' elements)``, block by block."""
    G = stacked.shape[0]
    return [p.view(G, *s) for p, s in zip(stacked.split([math.prod(s) for s in shapes], dim=1), shapes)]


def _top(shapes: Shapes) -> tuple[int, ...]:
    """The largest size along every dim (or segment)."""
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"padded_stack/padded_segments/padded_cores: inputs must have the same number of dims (segments), "
                         f"got {list(shapes)}")
    return tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))


def _gather(tensors: Sequence[Tensor], index: Tensor) -> Tensor:
    flat = torch.cat([*(t.reshape(-1) for t in tensors), tensors[0].new_zeros(1)])  # (total + 1,): last is 0
    return flat[index]


@functools.lru_cache(maxsize=64)  # a prune makes ~20 new entries; older shapes never return
@torch.inference_mode(False)  # a cached index must serve grad-mode calls too
def _corner_index(shapes: Shapes, device: torch.device) -> Tensor:
    """Positions in the concatenated flat inputs (``total``: the zero) for every padded entry."""
    top = _top(shapes)
    total = sum(math.prod(s) for s in shapes)
    out = torch.full((len(shapes), *top), total, dtype=torch.int64)
    at = 0
    for i, s in enumerate(shapes):
        n = math.prod(s)
        out[(i, *(slice(0, k) for k in s))] = torch.arange(at, at + n).reshape(s)
        at += n
    return out.to(device)


@functools.lru_cache(maxsize=64)  # a prune makes ~20 new entries; older shapes never return
@torch.inference_mode(False)
def _flat_index(shapes: tuple[Shapes, ...], device: torch.device) -> Tensor:
    """``(G, sum_k prod(max shape_k))``: for layer ``i``, block ``k`` holds the positions of its core ``k``
    in the concatenated flat inputs, in the corner of the block's padded shape (``total``: the zero)."""
    tops = [_top(tuple(s[k] for s in shapes)) for k in range(len(shapes[0]))]
    total = sum(math.prod(c) for s in shapes for c in s)
    rows, at = [], 0
    for s in shapes:
        blocks = []
        for c, top in zip(s, tops):
            block = torch.full(top, total, dtype=torch.int64)
            n = math.prod(c)
            block[tuple(slice(0, k) for k in c)] = torch.arange(at, at + n).reshape(c)
            blocks.append(block.reshape(-1))
            at += n
        rows.append(torch.cat(blocks))
    return torch.stack(rows).to(device)


@functools.lru_cache(maxsize=64)  # a prune makes ~20 new entries; older shapes never return
@torch.inference_mode(False)
def _segment_index(segments: Shapes, device: torch.device) -> Tensor:
    top = _top(segments)
    total = sum(sum(s) for s in segments)
    rows = []
    at = 0
    for s in segments:
        row = []
        for n, width in zip(s, top):
            row += [*range(at, at + n), *([total] * (width - n))]
            at += n
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64, device=device)

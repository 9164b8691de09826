"""``layers.ragged``: zero-padded stacks by one gather, against ``F.pad`` + ``torch.stack``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comera_dist.bench.ops import OpCounter
from comera_dist.layers.base import split_flat
from comera_dist.layers.ragged import padded_cores, padded_segments, padded_stack


def test_padded_stack_equals_pad_then_stack_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 3, 4), (3, 3, 1), (1, 3, 4)]
    xs = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    want = torch.stack([F.pad(x, (0, 4 - x.shape[2], 0, 0, 0, 3 - x.shape[0])) for x in xs])  # (3, 3, 3, 4)
    padded_stack(xs)  # builds and caches the index for these shapes
    with OpCounter() as ops:
        got = padded_stack(xs)
    assert torch.equal(got, want)
    # a cat and a gather (and a view per input), nothing else per tensor
    assert sum(ops.ops.values()) - ops.views == 3 and not ops.syncs, ops.ops
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got_g = torch.autograd.grad((got * w).sum(), xs)
    want_g = torch.autograd.grad((want * w).sum(), xs)
    for a, b in zip(got_g, want_g, strict=True):
        assert torch.equal(a, b)


def test_padded_cores_equal_padded_stack_core_by_core_forward_and_backward():
    """Every layer's flat ``core`` into the group's padded cores with one gather, against splitting
    each layer's cores and ``padded_stack``-ing them core by core (itself checked against ``F.pad``)."""
    g = torch.Generator().manual_seed(2)
    shapes = (((1, 3, 2), (2, 4, 3), (3, 2, 1)), ((1, 3, 1), (1, 4, 3), (3, 2, 1)), ((1, 3, 2), (2, 4, 2), (2, 2, 1)))
    flats = [torch.randn(sum(a * b * c for a, b, c in s), generator=g, dtype=torch.float64, requires_grad=True)
             for s in shapes]
    want = [padded_stack([split_flat(f, s)[k] for f, s in zip(flats, shapes)]) for k in range(3)]
    padded_cores(flats, shapes)  # builds and caches the index
    with OpCounter() as ops:
        got = padded_cores(flats, shapes)
    assert [tuple(c.shape) for c in got] == [(3, 1, 3, 2), (3, 2, 4, 3), (3, 3, 2, 1)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert sum(ops.ops.values()) - ops.views == 3 and not ops.syncs, ops.ops  # one cat and one gather in all
    ws = [torch.randn(c.shape, generator=g, dtype=torch.float64) for c in want]
    got_g = torch.autograd.grad(sum((c * w).sum() for c, w in zip(got, ws)), flats)
    want_g = torch.autograd.grad(sum((c * w).sum() for c, w in zip(want, ws)), flats)
    for a, b in zip(got_g, want_g, strict=True):
        assert torch.equal(a, b)
    same = padded_cores(flats[:1] * 2, shapes[:1] * 2)  # equal shapes: one stack, viewed
    assert all(torch.equal(c[0], c[1]) and torch.equal(c[0], v) for c, v in zip(same, split_flat(flats[0], shapes[0])))
    compiled = torch.compile(lambda *f: padded_cores(f, shapes), fullgraph=True, backend="eager")(*flats)
    assert all(torch.equal(a, b) for a, b in zip(compiled, want, strict=True))


def test_padded_segments_pads_every_segment_to_its_widest():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # segments 2, 3
    b = torch.tensor([6.0, 7.0, 8.0])  # segments 1, 2
    got = padded_segments([a, b], [(2, 3), (1, 2)])
    assert torch.equal(got, torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 0.0, 7.0, 8.0, 0.0]]))
    same = padded_segments([a, a + 1], [(2, 3), (2, 3)])
    assert torch.equal(same, torch.stack([a, a + 1]))


def test_equal_shapes_take_plain_stack_and_bad_shapes_are_refused():
    xs = [torch.ones(2, 2), torch.zeros(2, 2)]
    with OpCounter() as ops:
        padded_stack(xs)
    assert set(ops.ops) == {"aten.stack"}
    with pytest.raises(ValueError, match=r"same number of dims \(segments\), got \[\(2, 2\), \(2,\)\]"):
        padded_stack([torch.ones(2, 2), torch.ones(2)])
    with pytest.raises(ValueError, match=r"same number of dims \(segments\), got \[\(1, 2\), \(3,\)\]"):
        padded_segments([torch.ones(3), torch.ones(3)], [(1, 2), (3,)])


def test_compiled_padding_equals_the_gather():
    """Under ``torch.compile`` the pads replace the cached gather: same values, no graph break."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(s, generator=g) for s in [(2, 3, 4), (3, 3, 1)]]
    vs = [torch.randn(5, generator=g), torch.randn(3, generator=g)]
    fn = torch.compile(lambda a, b, c, d: (padded_stack([a, b]), padded_segments([c, d], [(2, 3), (1, 2)])),
                       fullgraph=True, backend="eager")
    got = fn(*xs, *vs)
    assert torch.equal(got[0], padded_stack(xs)) and torch.equal(got[1], padded_segments(vs, [(2, 3), (1, 2)]))


def test_an_index_first_built_under_inference_mode_serves_grad_mode_calls():
    shapes = [(3, 2), (1, 5)]  # shapes no other test uses: the first call builds the index
    with torch.inference_mode():
        padded_stack([torch.ones(s) for s in shapes])
    xs = [torch.ones(s, requires_grad=True) for s in shapes]
    padded_stack(xs).sum().backward()
    assert all(torch.equal(x.grad, torch.ones_like(x)) for x in xs)

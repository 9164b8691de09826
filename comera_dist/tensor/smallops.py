"""Run the batch-independent core contractions (forward and backward) on one CPU thread.

Contracting the cores into ``L``/``R`` or the TTM halves is a chain of tiny GEMMs and
multiplies (kilo- to mega-FLOPs). With several intra-op threads every such op pays an OpenMP
fork/join; on a shared CPU the barrier waits for a descheduled sibling thread, and a 0.5 MFLOP
GEMM was measured at 21 ms with 2 threads vs 0.017 ms with 1 (docs/bench/layers-cpu.md).
``on_one_thread(fn, *tensors)`` evaluates ``fn`` with one thread and replays its backward the
same way through a private autograd graph. CUDA tensors, ``torch.compile`` tracing and
single-threaded processes call ``fn`` directly, and so do ``torch.func`` transforms (``grad``, ``vmap``).
A backward asked for a graph (``create_graph=True``: second-order gradients) remakes ``fn`` from the saved inputs
in the caller's graph, on the caller's threads, so that its gradients are themselves differentiable.

Inside a checkpointed block (``models.blocks``, within ``inside_checkpoint()``) the private graph would escape
``torch.utils.checkpoint``: its node holds ``fn``'s outputs (and through them its graph) past the checkpoint's
saved-tensor hooks until the outer graph is freed, keeping what the checkpoint is there to drop (a
six-encoder's factors, 10 MiB). There ``on_one_thread`` keeps only its inputs, through ``save_for_backward``
(which the hooks see), and remakes ``fn``'s graph on one thread in backward: one more forward of ``fn``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor


class _OneThread:
    """Context manager: ``torch.set_num_threads(1)`` inside, the previous count restored after."""

    def __enter__(self) -> None:
        self.n = torch.get_num_threads()
        if self.n != 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.n != 1:
            torch.set_num_threads(self.n)


def _leaves(inputs: tuple[Tensor, ...]) -> list[Tensor]:
    """Detached copies of ``inputs`` (same storage) that start a private graph where the inputs need gradients."""
    return [t.detach().requires_grad_(t.requires_grad) for t in inputs]


def _private_backward(outs: tuple[Tensor, ...], grads: tuple[Tensor | None, ...], leaves: list[Tensor],
                      retain_graph: bool, create_graph: bool = False) -> tuple[Tensor | None, ...]:
    """The gradients of the leaves of a private graph from its outputs' (the caller runs it on one thread), as an
    ``autograd.Function``'s backward returns them after ``fn``: ``(None, *per leaf)``. With ``create_graph`` the
    "leaves" are the inputs themselves and ``outs`` was made from them in the caller's graph."""
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in leaves if t.requires_grad]
    if not pairs or not wanted:
        return (None,) * (1 + len(leaves))
    it = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True,
                                  retain_graph=retain_graph, create_graph=create_graph))
    return (None, *(next(it) if t.requires_grad else None for t in leaves))


class _OneThreadFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[..., tuple[Tensor, ...]], *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        with torch.enable_grad(), _OneThread():
            leaves = _leaves(inputs)
            outs = fn(*leaves)
        ctx.fn, ctx.leaves, ctx.outs = fn, leaves, outs  # the private graph lives as long as this node
        ctx.save_for_backward(*inputs)  # unpacked only by a backward that builds a graph
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the private graph's gradients would be constants
            return _graph_backward(ctx.fn, ctx.saved_tensors, grads)
        with _OneThread():  # retain: the outer graph may be replayed (retain_graph=True)
            return _private_backward(ctx.outs, grads, ctx.leaves, retain_graph=True)


class _Remade(torch.autograd.Function):
    """``on_one_thread`` inside a checkpoint: ``fn`` on one thread without a graph, only the inputs kept; in
    backward ``fn`` runs again on one thread with its graph (under the forward's CPU autocast state, as
    ``torch.utils.checkpoint`` remakes it), which is differentiated and dropped."""

    @staticmethod
    def forward(ctx, fn: Callable[..., tuple[Tensor, ...]],  # type: ignore[override]
                *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.fn = fn
        ctx.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        ctx.set_materialize_grads(False)  # an output nobody used sends no zeros through the remade graph
        ctx.save_for_backward(*inputs)
        with torch.no_grad(), _OneThread():
            return tuple(o.detach() for o in fn(*inputs))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        inputs = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        if torch.is_grad_enabled():  # create_graph=True
            with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                return _graph_backward(ctx.fn, inputs, grads)
        with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled), _OneThread():
            leaves = _leaves(inputs)
            return _private_backward(ctx.fn(*leaves), grads, leaves, retain_graph=False)  # the graph dropped


def _graph_backward(fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...],
                    grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """A backward under ``create_graph=True``: ``fn`` remade from the saved ``inputs`` in the caller's graph and
    differentiated with a graph, so the gradients carry their own dependence on the inputs (second order)."""
    return _private_backward(fn(*inputs), grads, list(inputs), retain_graph=True, create_graph=True)


_state = threading.local()  # per thread: another thread's forward keeps its own mode


class inside_checkpoint:
    """Inside the ``with``, ``on_one_thread`` keeps only its inputs for backward and remakes ``fn`` there
    (``_Remade``), so a checkpoint around it drops everything else (``models.blocks``' recomputed blocks). The
    mode is per thread. Under ``torch.compile`` a no-op (``on_one_thread`` calls ``fn`` directly there)."""

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            self.previous = getattr(_state, "inside", False)
            _state.inside = True

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "previous"):  # set by __enter__ (not when it was traced)
            _state.inside = self.previous


def on_one_thread(fn: Callable[..., tuple[Tensor, ...]], *inputs: Tensor) -> tuple[Tensor, ...]:
    """``fn(*inputs)`` (a tuple of tensors) computed, and differentiated, on one CPU thread."""
    if (torch.compiler.is_compiling() or torch.get_num_threads() == 1 or any(t.is_cuda for t in inputs)
            or torch._C._are_functorch_transforms_active()):  # torch.func needs a setup_context Function
        return fn(*inputs)  # compiled graphs schedule their own small ops
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        with _OneThread():
            return fn(*inputs)
    if getattr(_state, "inside", False):
        return _Remade.apply(fn, *inputs)
    return _OneThreadFn.apply(fn, *inputs)

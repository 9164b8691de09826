"""``on_one_thread``: same values and gradients as a direct call, on one thread, count restored; inside
``inside_checkpoint`` it keeps only its inputs, through the saved-tensor hooks a checkpoint drops them by."""

import contextlib
import threading

import pytest
import torch

from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.tensor import contract
from comera_dist.tensor.smallops import inside_checkpoint, on_one_thread


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs with OMP_NUM_THREADS=1, where the wrapper is a no-op
    yield
    torch.set_num_threads(n)


def test_values_gradients_and_thread_count(two_threads):
    gen = torch.Generator().manual_seed(0)
    cores = [torch.randn(1, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True),
             torch.randn(4, 2, 1, generator=gen, dtype=torch.float64, requires_grad=True)]
    seen = []

    def fn(a, b):
        seen.append(torch.get_num_threads())
        return contract.contract_left([a], None), b * 2

    L, B = on_one_thread(fn, *cores)
    assert seen == [1] and torch.get_num_threads() == 2
    torch.testing.assert_close(L, cores[0][0])
    w = torch.randn(3, 4, dtype=torch.float64)
    ga, gb = torch.autograd.grad((L * w).sum() + B.sum(), cores, retain_graph=True)
    torch.testing.assert_close(ga, w[None])
    torch.testing.assert_close(gb, torch.full_like(cores[1], 2.0))
    # Only one output used: the other's gradient is zero; a second backward through the graph works.
    ga2, gb2 = torch.autograd.grad(L.sum(), cores, allow_unused=True)
    torch.testing.assert_close(ga2, torch.ones_like(cores[0]))
    assert gb2 is None or torch.all(gb2 == 0)
    assert torch.autograd.gradcheck(lambda a, b: on_one_thread(fn, a, b), tuple(cores))


def test_layers_match_with_several_threads(two_threads):
    torch.manual_seed(0)
    for layer, x in ((TTLinear(24, 30, num_cores=4, max_rank=4, order="lr", dtype=torch.float64),
                      torch.randn(5, 24, dtype=torch.float64)),
                     (TTEmbedding(60, 8, num_cores=3, max_rank=4, dtype=torch.float64), torch.tensor([1, 59, 1, 7]))):
        with torch.no_grad():
            layer.gates[0][0] = 0.0
        params = list(layer.parameters())
        out = layer(x)
        got = torch.autograd.grad(out.pow(2).sum(), params)
        torch.set_num_threads(1)  # the direct path
        want_out = layer(x)
        want = torch.autograd.grad(want_out.pow(2).sum(), params)
        torch.set_num_threads(2)
        torch.testing.assert_close(out, want_out)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), want_out)


def test_inside_a_checkpoint_it_keeps_only_its_inputs_and_remakes_fn_in_backward(two_threads):
    """The private graph's node holds ``fn``'s outputs and its graph past any saved-tensor hook, so a checkpoint
    around it could not drop them (the memory itself is tested in ``test_models_recompute``). Inside
    ``inside_checkpoint`` what is kept goes through the hooks, and is only the inputs; ``fn`` runs again in
    backward, on one thread too, with the same values and gradients as the private graph's. Per thread: another
    thread is not inside."""
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    threads = []

    def fn(x, y):
        threads.append(torch.get_num_threads())
        return ((x @ y).exp(), y.sum())  # mm saves both operands, exp its result

    results = {}
    for inside in (False, True):
        packed: list[torch.Tensor] = []
        with (torch.autograd.graph.saved_tensors_hooks(lambda t, p=packed: p.append(t) or t, lambda t: t),
              inside_checkpoint() if inside else contextlib.nullcontext()):
            out, total = on_one_thread(fn, a, b)
        grads = torch.autograd.grad(out.sum() + 2 * total, (a, b))
        results[inside] = ([t.shape for t in packed], out, grads)
    assert threads == [1, 1, 1] and torch.get_num_threads() == 2  # private: once; inside: forward, then backward
    assert results[True][0] == [a.shape, b.shape]  # the inputs, nothing of fn's graph
    assert len(results[False][0]) == 5  # the node's inputs (for a create_graph backward), and the private graph's
    # own saves: x, y and exp's result
    torch.testing.assert_close(results[True][1], results[False][1])
    for got, want in zip(results[True][2], results[False][2], strict=True):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda x, y: _inside(fn, x, y), (a, b))
    seen = []
    with inside_checkpoint():
        worker = threading.Thread(target=lambda: seen.append(type(on_one_thread(fn, a, b)[0].grad_fn).__name__))
        worker.start()
        worker.join()
    assert seen == ["_OneThreadFnBackward"]  # the other thread kept the private graph


def test_second_order_gradients_match_the_direct_path(two_threads):
    """A backward under ``create_graph=True`` (second order: MAML, gradient penalties) remakes ``fn`` in the
    caller's graph, private graph or inside a checkpoint, so its gradients are differentiable as the direct call's
    (one thread) are; before, the private graph's were constants and a MAML step's outer gradient silently lost
    its second-order term. ``torch.func.grad`` calls ``fn`` directly (it needs a ``setup_context`` Function)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(x, y):
        return ((x @ y).sin(), (y * y).sum())

    assert torch.autograd.gradgradcheck(lambda x, y: on_one_thread(fn, x, y), (a, b))
    assert torch.autograd.gradgradcheck(lambda x, y: _inside(fn, x, y), (a, b))
    torch.manual_seed(0)
    layer = TTLinear(12, 10, in_modes=[3, 4], out_modes=[2, 5], max_rank=3, order="lr", dtype=torch.float64)
    x_in, x_out = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 12, dtype=torch.float64)

    def call(core, x):
        return torch.func.functional_call(layer, {"core": core}, (x,), strict=False)

    def outer():  # one inner SGD step with a graph, then the gradient of the loss after it
        (g,) = torch.autograd.grad(call(layer.core, x_in).pow(2).sum(), layer.core, create_graph=True)
        return torch.autograd.grad(call(layer.core - 0.01 * g, x_out).pow(2).sum(), layer.core)[0]

    got, func_got = outer(), torch.func.grad(lambda c: call(c, x_in).pow(2).sum())(layer.core.detach())
    torch.set_num_threads(1)  # the direct path
    want, func_want = outer(), torch.func.grad(lambda c: call(c, x_in).pow(2).sum())(layer.core.detach())
    torch.set_num_threads(2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(func_got, func_want)


def _inside(fn, *inputs):
    with inside_checkpoint():
        return on_one_thread(fn, *inputs)


def test_inside_a_checkpoint_the_remade_fn_runs_under_the_forwards_autocast(two_threads):
    """``torch.utils.checkpoint`` remakes a block under the forward's CPU autocast; so does ``_Remade``, whose
    backward runs outside it (autograd's thread). Under bf16 autocast the remade ``fn`` computes what the forward
    did, so its gradients are the private graph's; remade in fp32 they were not."""
    a = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(32, 8, requires_grad=True)

    def fn(x, y):
        return ((x @ y).float().exp(),)  # the GEMM runs in bf16 under autocast

    grads = {}
    for inside in (False, True):
        with (torch.autocast("cpu", dtype=torch.bfloat16),
              inside_checkpoint() if inside else contextlib.nullcontext()):
            (out,) = on_one_thread(fn, a, b)
        grads[inside] = torch.autograd.grad(out.sum(), (a, b))
    for got, want in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

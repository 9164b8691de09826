"""``bench.compile_stats``: the counts ``bench trainer-rate``, ``bench ops --compiled`` and ``bench
six-encoder --modes compiled`` write for a compiled step.

The CUDA-graph tree counts and the graph kernels' CUDA case need a CUDA GPU (``launch/gpu_check.sh``
runs this file); off CUDA the trees are None, and Dynamo's counters and the inductor graphs' kernels
are read on the CPU."""

import pytest
import torch
from torch import nn

from comera_dist.bench.compile_stats import compile_counters, cudagraph_trees, graph_kernels, kernel_profile

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph trees)")


def test_dynamo_counts_a_graph_break():
    torch.compiler.reset()
    before = sum(compile_counters()["graph_break"].values())

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    torch.compile(broken, backend="eager")(torch.ones(3))
    assert sum(compile_counters()["graph_break"].values()) == before + 1
    assert cudagraph_trees(torch.device("cpu")) is None


def _gelu_loss(x, w):
    return (torch.nn.functional.gelu(x @ w) * 2).sum()


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton kernels)")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_graph_kernels_counts_each_graphs_kernels_by_kind(device):
    torch.compiler.reset()
    w = torch.randn(16, 16, device=device, requires_grad=True)
    x = torch.randn(4, 16, device=device)
    compiled = torch.compile(_gelu_loss, backend="inductor", fullgraph=True)
    with kernel_profile():
        compiled(x, w).backward()  # compiles the forward and backward graphs with their kernels recorded
        got = graph_kernels(lambda: compiled(x, w).backward())
    torch.compiler.reset()
    assert got["graph_calls"] == 2  # one forward graph, one backward graph
    assert got["externs"].get("aten::mm", 0) >= 2, got  # x @ w, and the backward's x^T @ grad
    assert got["extern"]["forward"] >= 1 and got["extern"]["backward"] >= 1, got
    assert got["generated"]["forward"] >= 1 and got["generated"]["backward"] >= 1, got  # GELU and its backward
    assert got["kernels"] == sum(got["extern"].values()) + sum(got["generated"].values())


def test_graph_kernels_refuses_a_step_whose_kernels_it_cannot_see():
    torch.compiler.reset()
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    plain = torch.compile(_gelu_loss, backend="inductor", fullgraph=True)
    plain(x, w).backward()  # compiled on the CPU without kernel_profile: its kernels leave no record
    with pytest.raises(RuntimeError, match="kernel_profile"):
        graph_kernels(lambda: plain(x, w).backward())
    torch.compiler.reset()
    with pytest.raises(RuntimeError, match="no inductor graph"):
        graph_kernels(lambda: _gelu_loss(x, w).backward())


@needs_cuda
@pytest.mark.gpu
@pytest.mark.timeout(100)  # two inductor compiles of forward and backward; gpu_check's default is 40 s
def test_cudagraph_trees_count_a_steady_loop_and_a_new_shape():
    """A training loop under ``reduce-overhead`` records its forward and backward once and then replays
    them: the recorded count stays put over more steps. A new input shape (static shapes) compiles two
    more functions, recorded once each."""
    torch.compiler.reset()
    device = torch.device("cuda")
    assert cudagraph_trees(device)["recorded_graphs"] == 0
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    forward = torch.compile(model, mode="reduce-overhead", dynamic=False)

    def step(x: torch.Tensor) -> float:
        loss = forward(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    x = torch.randn(8, 32, device=device)
    for _ in range(4):  # warm-up, recording, replays
        step(x)
    first = cudagraph_trees(device)
    for _ in range(6):
        step(x)
    steady = cudagraph_trees(device)
    assert first["functions"] == 2 and first["recorded_graphs"] == 2, first  # forward, backward
    assert steady == first, (first, steady)
    assert steady["stuck_warming_up"] == 0 and steady["rerecords"] == 0
    wide = torch.randn(16, 32, device=device)
    for _ in range(4):
        step(wide)
    grown = cudagraph_trees(device)
    assert grown["functions"] == 4 and grown["recorded_graphs"] == 4, grown
    torch.compiler.reset()

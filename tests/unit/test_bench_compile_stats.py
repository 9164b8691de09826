"""``bench.compile_stats``: the counts ``bench trainer-rate`` writes for a compiled run.

The CUDA-graph tree counts need a CUDA GPU (``launch/gpu_check.sh`` runs this file); off CUDA they
are None, and Dynamo's counters are read everywhere."""

import pytest
import torch
from torch import nn

from comera_dist.bench.compile_stats import compile_counters, cudagraph_trees

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

"""``six_encoder_device.workspace_bytes``: how much of a row's CUDA peak is cuBLAS's workspaces (the H200's
batch-1 peaks carried about 65 MiB per stream). The CUDA case needs a GPU (gpu_check's kernel-tests)."""

import pytest
import torch

from comera_dist.bench.six_encoder_device import workspace_bytes


def test_the_cpu_has_no_workspaces():
    torch.randn(64, 64) @ torch.randn(64, 64)
    assert workspace_bytes(torch.device("cpu")) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuBLAS workspaces)")
def test_a_products_workspace_is_measured_and_freed():
    device = torch.device("cuda")
    workspace_bytes(device)  # none left from earlier tests
    a = torch.randn(512, 512, device=device)
    kept = torch.cuda.memory_allocated(device)
    b = a @ a  # the first product on this stream allocates its workspace
    got = workspace_bytes(device)
    assert got > 0, "a cuBLAS product left no workspace in the allocator"
    assert torch.cuda.memory_allocated(device) == kept + b.numel() * 4  # the tensors are untouched
    assert workspace_bytes(device) == 0  # freed, so measured once

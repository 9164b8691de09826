"""Fixtures of the unit tests that need a real DeepSpeed engine."""

from __future__ import annotations

import pytest
import torch

from comera_dist.engine.ports import free_port


@pytest.fixture(scope="module")
def engine():
    """A DeepSpeed engine in a one-process group on a free port; the group is destroyed after the module."""
    import deepspeed
    import deepspeed.comm as dist
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        model = torch.nn.Linear(4, 4)
        eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}})
        yield eng
        dist.destroy_process_group()

"""Shared test setup: CPU DeepSpeed, Triton interpreter, offline HF, free ports, native-only ``gpu`` tests."""

import os

# Must be set before triton/deepspeed/transformers are imported anywhere.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from comera_dist.engine.ports import free_port


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.hookimpl(trylast=True)  # after the skip markers: a skipped ``gpu`` test (no CUDA) stays skipped
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``gpu`` test that runs must run compiled Triton kernels, never the interpreter.

    The interpreter (the default above) takes CUDA tensors too, so such a test would otherwise pass
    on a GPU machine without compiling a kernel. launch/gpu_check.sh runs them with TRITON_INTERPRET=0.
    """
    if item.get_closest_marker("gpu") is None:
        return
    from comera_dist.kernels.launch import native_problem  # imports triton: only for gpu tests

    problem = native_problem()
    if problem is not None:
        pytest.fail(f"{item.nodeid} is a `gpu` test, but {problem}; run the gpu tests with TRITON_INTERPRET=0 "
                    "on a CUDA machine (launch/gpu_check.sh does)", pytrace=False)

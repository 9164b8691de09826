"""Shared test setup: CPU DeepSpeed, Triton interpreter, offline HF, free ports."""

import os

# Must be set before triton/deepspeed/transformers are imported anywhere.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import socket  # noqa: E402

import pytest  # noqa: E402


def free_port() -> int:
    """A free TCP port on loopback (each distributed test rendezvouses on its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()

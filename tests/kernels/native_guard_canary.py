"""Run by test_native_guard.py in a subprocess (not collected otherwise): outcomes that show the
``gpu`` guard of tests/conftest.py at work under TRITON_INTERPRET=1."""

import pytest


@pytest.mark.gpu
def test_gpu_not_skipped():
    """Stands for a ``gpu`` test on a CUDA machine: the guard must stop it before its body."""


@pytest.mark.gpu
@pytest.mark.skipif(True, reason="stands for needs_cuda on a machine without CUDA")
def test_gpu_skipped():
    """A skipped ``gpu`` test stays skipped: the guard runs after the skip markers."""


def test_not_gpu():
    """Other tests are left alone."""

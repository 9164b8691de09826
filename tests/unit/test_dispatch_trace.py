"""The dispatch decision under ``torch.compile`` (``kernels.dispatch`` module docstring): ``use_backend``
is guarded by Dynamo (changing it re-traces, changing it back reuses the first graph), and
``COMERA_KERNELS`` is read when a graph is traced.

The Triton path runs on CPU tensors in the interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from comera_dist.kernels import dispatch, launch, tt_linear_kernel
from comera_dist.tensor.contract import tt_linear_lr

pytestmark = pytest.mark.skipif(not launch.INTERPRET, reason="forces Triton on CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture
def counts(monkeypatch):
    """Graphs compiled, and calls into the Triton forward wrapper (a spy: it still runs)."""
    monkeypatch.delenv("COMERA_KERNELS", raising=False)
    torch._dynamo.reset()
    seen = {"graphs": 0, "kernel": 0}
    fwd = tt_linear_kernel.tt_linear_fwd

    def spy(*a, **k):
        seen["kernel"] += 1
        return fwd(*a, **k)

    monkeypatch.setattr(tt_linear_kernel, "tt_linear_fwd", spy)

    def backend(gm, example_inputs):
        seen["graphs"] += 1
        return gm.forward

    seen["compile"] = lambda: torch.compile(lambda x, L, R: dispatch.tt_linear(x, L, R), backend=backend,
                                            fullgraph=True)
    yield seen
    torch._dynamo.reset()


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 16, generator=g), torch.randn(16, 3, generator=g), torch.randn(3, 16, generator=g)


def test_changing_use_backend_retraces_and_changing_it_back_reuses_the_graph(counts):
    f, args = counts["compile"](), _args()
    want = tt_linear_lr(*args)
    with dispatch.use_backend("torch"):
        torch.testing.assert_close(f(*args), want)
    assert (counts["graphs"], counts["kernel"]) == (1, 0)
    with dispatch.use_backend("triton"):
        torch.testing.assert_close(f(*args), want)
    assert (counts["graphs"], counts["kernel"]) == (2, 1)  # a new graph, whose op runs the kernel
    with dispatch.use_backend("torch"):
        f(*args)
    assert (counts["graphs"], counts["kernel"]) == (2, 1)  # the first graph again: no kernel, no trace


@pytest.mark.parametrize("order", [("triton", "torch"), ("torch", "triton")])
def test_comera_kernels_is_read_when_tracing(counts, monkeypatch, order):
    """The value set when a graph is traced decides its path (not one frozen at import, nor 'auto').

    Whether a change without a new trace re-traces is Dynamo's business (torch 2.13 guards
    ``os.environ`` reads and re-traces), so each value gets a fresh trace here.
    """
    args = _args()
    for i, name in enumerate(order):
        torch._dynamo.reset()
        monkeypatch.setenv("COMERA_KERNELS", name)
        before = counts["kernel"]
        torch.testing.assert_close(counts["compile"]()(*args), tt_linear_lr(*args))
        assert counts["graphs"] == i + 1
        assert counts["kernel"] - before == (1 if name == "triton" else 0), f"COMERA_KERNELS={name} traced the other path"


def test_triton_kernels_asked_for_where_they_cannot_run_are_a_setting_error(monkeypatch):
    """``COMERA_KERNELS=triton`` on a CPU run without the interpreter crashed at the first lookup (a traceback
    from the kernel launch); the trainer checks it at its start, where the device is known."""
    from comera_dist.kernels.dispatch import SettingError, check_device

    monkeypatch.setenv("COMERA_KERNELS", "triton")
    monkeypatch.setattr(launch, "INTERPRET", False)
    with pytest.raises(SettingError, match="COMERA_KERNELS=triton runs the Triton kernels, which need CUDA; this "
                                           "run's device is cpu: set TRITON_INTERPRET=1"):
        check_device(torch.device("cpu"))
    check_device(torch.device("cuda"))  # where they run
    monkeypatch.setattr(launch, "INTERPRET", True)
    check_device(torch.device("cpu"))  # interpreted
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setenv("COMERA_KERNELS", "auto")
    check_device(torch.device("cpu"))  # auto picks the torch path there

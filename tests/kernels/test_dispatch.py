"""The one dispatch point: which implementation runs for which tensor, and how tests/users force it."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import needs_interpreter
from torch._subclasses.fake_tensor import FakeTensorMode

from comera_dist.kernels import dispatch, tt_linear_kernel, ttm_lookup_kernel
from comera_dist.tensor.contract import tt_linear_lr, ttm_lookup_pairs


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("COMERA_KERNELS", raising=False)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls into the Triton wrappers (they still run: a spy, not a stub)."""
    calls = {"tt_linear": 0, "ttm_lookup": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(tt_linear_kernel, "tt_linear_fwd", spy("tt_linear", tt_linear_kernel.tt_linear_fwd))
    monkeypatch.setattr(ttm_lookup_kernel, "ttm_lookup_fwd", spy("ttm_lookup", ttm_lookup_kernel.ttm_lookup_fwd))
    return calls


def _tt_args():
    return torch.randn(5, 16), torch.randn(16, 3), torch.randn(3, 16), torch.randn(16)


def _ttm_args():
    return torch.tensor([0, 5, 5, 11]), torch.randn(3, 2, 4), torch.randn(4, 4, 3)


def test_auto_on_cpu_picks_torch(kernel_calls):
    x = torch.randn(2, 2)
    assert dispatch.resolve_backend(x) == "torch"
    x, L, R, b = _tt_args()
    torch.testing.assert_close(dispatch.tt_linear(x, L, R, b), tt_linear_lr(x, L, R, b), rtol=0, atol=0)
    ids, A, B = _ttm_args()
    torch.testing.assert_close(dispatch.ttm_lookup(ids, A, B), ttm_lookup_pairs(ids, A, B), rtol=0, atol=0)
    assert kernel_calls == {"tt_linear": 0, "ttm_lookup": 0}


def test_auto_on_cuda_picks_torch_unless_a_measured_rule_says_triton(monkeypatch):
    # Fake tensors carry a CUDA device without needing a GPU, which is all the decision looks at.
    # The H200 measured both kernels slower than the torch path: no rule, torch everywhere.
    monkeypatch.setattr(dispatch, "_card", lambda t: "NVIDIA H200")
    with FakeTensorMode():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = torch.empty(2, device="cuda", dtype=dtype)
            assert dispatch.resolve_backend(t) == "torch"
            assert dispatch.resolve_backend(t, "tt_linear", (768, 30, 768)) == "torch"
            assert dispatch.resolve_backend(t, "ttm_lookup", (320, 16, 32, 100, 48)) == "torch"
        monkeypatch.setitem(dispatch.FASTER_WITH_TRITON, "tt_linear",
                            frozenset({("NVIDIA H200", (768, 30, 768), torch.bfloat16)}))
        bf16 = torch.empty(2, device="cuda", dtype=torch.bfloat16)
        assert dispatch.resolve_backend(bf16, "tt_linear", (768, 30, 768)) == "triton"
        assert dispatch.resolve_backend(bf16, "tt_linear", (768, 30, 3072)) == "torch"
        assert dispatch.resolve_backend(torch.empty(2, device="cuda"), "tt_linear", (768, 30, 768)) == "torch"
        assert dispatch.resolve_backend(torch.empty(2, device="cuda", dtype=torch.float64)) == "torch"


@needs_interpreter
def test_forcing_triton_runs_the_kernels_on_cpu(kernel_calls):
    x, L, R, b = _tt_args()
    ids, A, B = _ttm_args()
    with dispatch.use_backend("triton"):
        assert dispatch.resolve_backend(x) == "triton"
        y = dispatch.tt_linear(x, L, R, b)
        rows = dispatch.ttm_lookup(ids, A, B)
    assert kernel_calls == {"tt_linear": 1, "ttm_lookup": 1}
    torch.testing.assert_close(y, tt_linear_lr(x, L, R, b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows, ttm_lookup_pairs(ids, A, B), rtol=1e-4, atol=1e-4)
    assert dispatch.resolve_backend(x) == "torch"  # restored on exit


def test_forcing_torch_and_nesting(monkeypatch, kernel_calls):
    monkeypatch.setenv("COMERA_KERNELS", "triton")
    x, L, R, b = _tt_args()
    with dispatch.use_backend("torch"):
        dispatch.tt_linear(x, L, R, b)
        with dispatch.use_backend("triton"):
            assert dispatch.resolve_backend(x) == "triton"
        assert dispatch.resolve_backend(x) == "torch"
    assert kernel_calls["tt_linear"] == 0


def test_override_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"), dispatch.use_backend("triton"):
        raise RuntimeError("boom")
    assert dispatch.resolve_backend(torch.zeros(1)) == "torch"


@needs_interpreter
def test_env_var_selects_backend(monkeypatch, kernel_calls):
    x, L, R, b = _tt_args()
    monkeypatch.setenv("COMERA_KERNELS", "triton")
    assert dispatch.resolve_backend(x) == "triton"
    dispatch.tt_linear(x, L, R, b)
    assert kernel_calls["tt_linear"] == 1
    monkeypatch.setenv("COMERA_KERNELS", "torch")
    assert dispatch.resolve_backend(x) == "torch"
    monkeypatch.setenv("COMERA_KERNELS", "auto")
    assert dispatch.resolve_backend(x) == "torch"


def test_bad_names_raise(monkeypatch):
    with pytest.raises(ValueError, match=r"backend 'cuda' is not one of \['auto', 'torch', 'triton'\]"), \
            dispatch.use_backend("cuda"):
        pass
    monkeypatch.setenv("COMERA_KERNELS", "Triton")
    with pytest.raises(ValueError, match=r"COMERA_KERNELS='Triton' is not one of"):
        dispatch.tt_linear(*_tt_args())


@needs_interpreter
def test_backward_through_forced_triton_matches_torch():
    x, L, R, b = (t.requires_grad_(True) for t in _tt_args())
    with dispatch.use_backend("triton"):
        dispatch.tt_linear(x, L, R, b).square().sum().backward()
    got = [t.grad.clone() for t in (x, L, R, b)]
    for t in (x, L, R, b):
        t.grad = None
    with dispatch.use_backend("torch"):
        dispatch.tt_linear(x, L, R, b).square().sum().backward()
    for g, t in zip(got, (x, L, R, b)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4)


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix_it():
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom comera_dist.kernels import dispatch\n"
            "with dispatch.use_backend('triton'):\n"
            "    dispatch.tt_linear(torch.randn(4, 16), torch.randn(16, 2), torch.randn(2, 16))\n")
    env = os.environ | {"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode != 0
    assert "RuntimeError: tt_linear: the Triton kernels need CUDA tensors, got cpu" in proc.stderr
    assert "TRITON_INTERPRET=1" in proc.stderr and "COMERA_KERNELS=torch" in proc.stderr


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_leading_dims_on_both_backends(backend):
    x, L, R, b = _tt_args()
    x3 = torch.cat([x, x]).reshape(2, 5, 16)  # (B, S, N_in)
    with dispatch.use_backend(backend):
        y = dispatch.tt_linear(x3, L, R, b)  # (B, S, N_out)
    assert y.shape == (2, 5, 16)
    torch.testing.assert_close(y[1], tt_linear_lr(x, L, R, b), rtol=1e-4, atol=1e-4)

"""The guard that keeps ``gpu`` tests native: ``launch.native_problem`` and its hook in tests/conftest.py.

The ``gpu`` tests run on a GPU machine only (launch/gpu_check.sh, TRITON_INTERPRET=0); here the guard
itself is checked: it names the interpreter whichever way it is on, and a ``gpu`` test that is not
skipped errors under TRITON_INTERPRET=1 instead of passing through the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comera_dist.kernels import launch

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_names_the_interpreter_variable(monkeypatch, value):
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert launch.native_problem() == (f"TRITON_INTERPRET={value!r} is set, so kernels decorated from now on "
                                       "would run in the Triton interpreter")


def test_names_interpreted_kernels_and_a_missing_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "INTERPRET", True)  # decorated while the variable was on
    assert "every launch runs in the Triton interpreter" in launch.native_problem()
    monkeypatch.setattr(launch, "INTERPRET", False)
    assert launch.native_problem() is None  # compiled kernels, a GPU: native
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.native_problem() == "no CUDA device is visible, and compiled Triton kernels need one"


def test_gpu_test_errors_under_the_interpreter_skipped_one_stays_skipped():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           str(HERE / "native_guard_canary.py")], env=env, cwd=HERE.parents[1],
                          capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout
    assert proc.returncode == 1 and "1 passed, 1 skipped, 1 error" in out, out[-3000:] + proc.stderr[-2000:]
    error = next(ln for ln in out.splitlines() if ln.startswith("ERROR "))
    assert "test_gpu_not_skipped" in error
    assert ("is a `gpu` test, but the kernels were decorated under TRITON_INTERPRET=1" in out
            and "run the gpu tests with TRITON_INTERPRET=0" in out)

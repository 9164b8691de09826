"""Smoke test of ``python -m comera_dist.bench kernels``: refusal without CUDA, a tiny interpreter run.

The GPU run itself (paper shapes, 4k-32k tokens) is not a test; see the module docstring of
comera_dist/bench/kernels.py for how to run it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comera_dist.bench.kernels import add_roofline, speedups

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    # Hide any GPU so that both the refusal and the interpreter path are what runs.
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "comera_dist.bench", "kernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_refuses_without_cuda_unless_allowed():
    proc = _run()
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and "--allow-cpu" in proc.stderr


def test_tiny_interpreter_run_writes_rows_and_metrics(tmp_path):
    out = tmp_path / "kernels.json"
    proc = _run("--allow-cpu", "--tokens", "32", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "kernels"
    rows = result["rows"]
    impls = {(r["op"], r["impl"], r["pass"]) for r in rows}
    for op, names in (("tt_linear", ("fused", "torch", "dense")), ("ttm_lookup", ("fused", "pairs", "naive", "dense"))):
        assert {(op, n, p) for n in names for p in ("fwd", "fwd+bwd")} <= impls
    assert all(r["ms"] > 0 and 0 < r["roofline_frac"] and r["model_flops"] > 0 for r in rows)
    m = result["metrics"]
    for key in ("fused_tt_linear_speedup_vs_torch", "fused_lookup_speedup_vs_naive", "peak_bytes_per_s",
                "peak_flops_per_s_fp32"):
        assert math.isfinite(m[key]) and m[key] > 0, key
    assert "interpreter" in result["config"]["device"]


def test_speedups_and_roofline_arithmetic():
    rows = [
        {"op": "tt_linear", "shape": "s", "tokens": 8, "dtype": "fp32", "pass": "fwd", "impl": "fused", "ms": 2.0,
         "model_flops": 4e9, "model_bytes": 1e6},
        {"op": "tt_linear", "shape": "s", "tokens": 8, "dtype": "fp32", "pass": "fwd", "impl": "torch", "ms": 3.0,
         "model_flops": 4e9, "model_bytes": 1e6},
    ]
    assert speedups(rows, "tt_linear", "fused", "torch", "fwd") == [1.5]
    add_roofline(rows, {"peak_flops_per_s_fp32": 4e12, "peak_bytes_per_s": 1e12})
    # ideal time = max(4e9 / 4e12, 1e6 / 1e12) = 1 ms
    assert rows[0]["roofline_frac"] == pytest.approx(0.5) and rows[1]["roofline_frac"] == pytest.approx(1 / 3)

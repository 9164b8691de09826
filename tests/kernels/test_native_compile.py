"""Every kernel variant the wrappers launch compiles natively for sm_90 (H100), on a machine with no GPU.

The interpreter accepts programs that compiled Triton rejects (this check found one: an
accumulator whose type differed between the branches of an ``if``); see native_compile_check.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_all_launched_kernel_variants_compile_for_sm90():
    env = os.environ | {"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(HERE / "native_compile_check.py")], env=env, cwd=HERE.parents[1],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    compiled = [ln for ln in proc.stdout.splitlines() if ln.startswith("compiled ")]
    # 2 dtypes x (2 forward + 2x2 backward TT-linear variants + 4 lookup kernels)
    assert len(compiled) == 20 and proc.stdout.rstrip().endswith("OK 20 kernel variants compiled for sm_90")
    assert {ln.split()[1] for ln in compiled} == {
        "_tt_linear_fwd_kernel", "_tt_linear_bwd_dx_kernel", "_tt_linear_bwd_w_kernel",
        "_ttm_lookup_fwd_kernel", "_ttm_lookup_bwd_chunk_kernel", "_ttm_lookup_bwd_a_kernel",
        "_ttm_lookup_bwd_b_kernel"}
    assert {ln.split()[3] for ln in compiled} == {"*fp32", "*bf16"}

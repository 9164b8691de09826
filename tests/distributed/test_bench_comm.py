"""``python -m comera_dist.bench comm`` measures real traffic of 2 ranks and writes the JSON metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_comm_writes_measured_bytes(tmp_path):
    out = tmp_path / "comm.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "comera_dist.bench", "comm", "--steps", "1", "--warmup", "1",
                           "--batch-size", "2", "--json", str(out)], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert m["comm_bytes_per_step_dense"] > m["comm_bytes_per_step_comera"] > 0
    assert m["comm_bytes_ratio_dense_over_comera"] == m["comm_bytes_per_step_dense"] / m["comm_bytes_per_step_comera"]
    assert m["compression_ratio"] > 1
    # measured per collective by DeepSpeed's logger, identical on both ranks
    rows = {(r["model"], r["rank"]): r for r in result["rows"]}
    assert "all_reduce" in rows[("dense", 0)]["ops"]
    assert rows[("dense", 0)]["bytes_per_step"] == rows[("dense", 1)]["bytes_per_step"]

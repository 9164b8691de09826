"""CI smoke of the trainer-rate benchmark on the CPU: the bare CoMERA step and the real 1-rank trainer on a
tiny model; the JSON's trainer rate is the median of what the trainer's own log lines printed."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one real training process (not a distributed test)
REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("COMERA_TEST_CACHE", str(Path(tempfile.gettempdir()) / "comera-dist-test-cache"))
STEP_LINE = re.compile(r"\[rank 0\] INFO comera_dist\.engine\.trainer: step (\d+)/(\d+) .*tokens_per_second (\S+)")


def test_trainer_rate_smoke(tmp_path):
    out = tmp_path / "trainer-rate.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(COMERA_CACHE=CACHE, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    skip, steps = 2, 3
    # every step logged, so the trainer's log prints each step's tokens_per_second (4 significant digits)
    proc = subprocess.run([sys.executable, "-m", "comera_dist.bench", "trainer-rate", "--smoke", "--device", "cpu",
                           "--steps", str(steps), "--skip", str(skip), "--warmup", "1",
                           "--set", "train.log_every=1", "--json", str(out)],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    m = result["metrics"]
    for key in ("bench_tokens_per_s", "trainer_tokens_per_s", "trainer_rate_over_bench", "session_tokens_per_s",
                "session_rate_over_bench"):
        assert math.isfinite(m[key]) and m[key] > 0, (key, m[key])
    assert m["trainer_rate_over_bench"] == pytest.approx(m["trainer_tokens_per_s"] / m["bench_tokens_per_s"])
    assert m["session_rate_over_bench"] == pytest.approx(m["session_tokens_per_s"] / m["bench_tokens_per_s"])
    assert set(result["config"]["profile"]) == {"bench step", "session step"}
    assert all(ops and ops[0]["calls"] >= 1 for ops in result["config"]["profile"].values())
    # by function: the session step's Python includes DeepSpeed's engine, the bare step's does not
    host = result["config"]["host_profile"]
    assert set(host) == {"bench step", "session step", "trainer loop"}
    assert host["bench step"]["runs"] == host["session step"]["runs"] == 5 and host["trainer loop"]["runs"] == 3
    assert all(len(p["by_self"]) == 25 and len(p["by_cumulative"]) == 60 for p in host.values())
    # the loop's profile holds whole iterations after the timed steps: its own calls (made by the trainer's
    # `train`, which began before the profile) are one step, batch fetch, synchronize, metrics call and log each
    loop = {r["function"]: r["calls"] for r in host["trainer loop"]["root_rows"]}
    for pattern in (r"comera_dist/bench/trainer_rate\.py:\d+\(train_step\)",  # the bench's wrapper of it
                    r"comera_dist/engine/run_data\.py:\d+\(next_train_batches\)",
                    r"deepspeed/accelerator/cpu_accelerator\.py:\d+\(synchronize\)",
                    r"comera_dist/engine/trainer\.py:\d+\(_step_metrics\)",
                    r"comera_dist/metrics/core\.py:\d+\(log\)"):
        assert [c for f, c in loop.items() if re.fullmatch(pattern, f)] == [1.0], (pattern, loop)
    assert all(r["self_s"] >= 0 and r["calls"] > 0 for p in host.values() for r in p["by_self"] + p["by_cumulative"])
    # the cumulative view names DeepSpeed's phases inside the session step, and none inside the bare one
    session_cum = [r["function"] for r in host["session step"]["by_cumulative"]]
    bench_cum = [r["function"] for r in host["bench step"]["by_cumulative"]]
    assert any(f.startswith("deepspeed/runtime/engine.py") and f.endswith("(backward)") for f in session_cum)
    assert not any(f.startswith("deepspeed/") for f in bench_cum)
    assert result["config"]["target"] == {"trainer_rate_over_bench": 0.8}
    assert result["config"]["device"] == "cpu"
    assert result["config"]["compile_counters"] is None  # not compiled (train.compile off)
    assert result["config"]["cudagraph_trees"] == {"trainer": None, "session": None}  # no CUDA here
    assert m["host_ops_per_step_session"] > 0 and m["ops_per_step_session"] > 0
    # the batch wait is part of the trainer's step time (tokens / step time is its tokens_per_second)
    assert 0 <= m["trainer_data_wait_s"] < m["trainer_step_s"], (m["trainer_data_wait_s"], m["trainer_step_s"])
    assert result["config"]["command"].startswith("comera pretrain --config configs/codebert-tiny-cpu.yaml ")

    trainer_steps = skip + steps + 3 + 1  # then 3 profiled loop iterations and the step that ends their profile
    assert result["config"]["trainer_steps"] == trainer_steps and result["config"]["trainer_timed_steps"] == steps
    logged = {int(s): float(v) for s, total, v in STEP_LINE.findall(proc.stdout + proc.stderr)
              if int(total) == trainer_steps}
    assert sorted(logged) == list(range(1, trainer_steps + 1)), logged
    assert sorted(map(int, result["config"]["trainer_tokens_per_second_by_step"])) == list(range(1, skip + steps + 1))
    logged = {s: v for s, v in logged.items() if s <= skip + steps}  # the profiled steps are in no rate
    from_log = statistics.median(v for s, v in logged.items() if s > skip)
    assert m["trainer_tokens_per_s"] == pytest.approx(from_log, rel=1e-3)

"""CI smoke of the soak benchmark: the real 1-rank training job for a few steps, checkpointing twice;
the JSON carries finite figures and says it is not the full 2,000-step run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one real training process (not a distributed test)
REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("COMERA_TEST_CACHE", str(Path(tempfile.gettempdir()) / "comera-dist-test-cache"))


def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(COMERA_CACHE=CACHE, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "comera_dist.bench", "soak", "--steps", "4", "--checkpoint-every",
                           "2", "--json", str(out)], check=False, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert m["steps"] == 4 and m["checkpoints"] == 2 and m["checkpoints_on_disk"] == 2
    assert 0 < m["checkpoint_time_share"] < 1 and m["save_seconds_median"] > 0
    assert math.isfinite(m["rss_drift"]) and m["checkpoint_bytes"] > 0 and m["digest_seconds_per_checkpoint"] > 0
    assert result["config"]["full_run"] is False

"""A resumed job's ``report.md`` covers the whole run, as a Slurm requeue leaves it: the history saved in the
checkpoint (``metrics_history.json``, under its manifest) is continued. Before, the report held the last job's
steps only (its "first" values, best validation loss and late-stage step were that job's), and re-running a
finished run rewrote it empty. Later the history was written beside the report after the checkpoint, so a crash
between the two left it one checkpoint behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _pretrain(out: Path, cache: Path, steps: int) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(COMERA_CACHE=str(cache), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "comera_dist.cli", "pretrain", "--config", "configs/tiny-cpu.yaml",
                        "--set", f"train.output_dir={out}", "--set", f"train.steps={steps}",
                        "--set", "train.checkpoint_every=2", "--set", "train.log_every=1",
                        "--set", "train.eval_every=2", "--set", "metrics.prometheus=false",
                        "--set", "comera.controller.late_stage_step=3"],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return (out / "report.md").read_text()


def _row(report: str, key: str) -> list[str]:
    return re.search(rf"^\| {key} \| (.*) \|$", report, re.MULTILINE).group(1).split(" | ")


def test_a_resumed_job_reports_the_whole_run(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    first = _pretrain(out, cache, 4)
    step4 = out / "checkpoints" / "step00000004"
    assert "metrics_history.json" in json.loads((step4 / "COMPLETE").read_text())["files"]  # the manifest's
    assert not (out / "metrics_history.json").exists()  # nothing outside that a crash could leave behind
    resumed = _pretrain(out, cache, 6)
    assert "- checkpoints: 2 saved" in first and "- checkpoints: 3 saved" in resumed, resumed
    assert "- late stage from step 3" in first and "- late stage from step 3" in resumed, resumed
    assert _row(resumed, "train_loss")[0] == _row(first, "train_loss")[0]  # the run's first value, not step 5's
    assert _row(resumed, "stage")[0] == "0"
    saved = json.loads((out / "checkpoints" / "step00000006" / "metrics_history.json").read_text())["history"]
    twice = {key: steps for key, data in saved["scalars"].items()
             if len(steps := [s for s, _ in data["points"]]) != len(set(steps))}
    assert not twice, f"the resumed job logged its starting step again: {twice}"
    rank_steps = [s for s, _ in saved["ranks"]["points"]]
    assert len(rank_steps) == len(set(rank_steps)), rank_steps
    again = _pretrain(out, cache, 6)  # a finished run started again: nothing to train, the report stays whole
    assert _row(again, "train_loss") == _row(resumed, "train_loss") and "- checkpoints: 3 saved" in again, again

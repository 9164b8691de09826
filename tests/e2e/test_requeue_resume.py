"""A requeued Slurm job continues its run whatever ``--resume`` it was submitted with.

``slurm/pretrain.sh`` passes the user's arguments after its own ``--resume auto``, and a requeue runs the same
command: with ``--resume none`` every requeue started the run over (and a checkpoint path went back to that
checkpoint), so a job longer than its time limit never finished. The trainer now resumes the run's newest
checkpoint when ``SLURM_RESTART_COUNT`` > 0 and the run has one (``checkpoint.requeued_spec``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from comera_dist.engine.checkpoint import requeued_spec

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _pretrain(out: Path, cache: Path, steps: int, resume: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_RESTART_COUNT")}
    env.update(COMERA_CACHE=str(cache), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env_extra)
    p = subprocess.run([sys.executable, "-m", "comera_dist.cli", "pretrain", "--config", "configs/tiny-cpu.yaml",
                        "--set", f"train.output_dir={out}", "--set", f"train.steps={steps}",
                        "--set", "train.checkpoint_every=2", "--set", "metrics.prometheus=false",
                        "--resume", resume],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_a_requeued_job_submitted_with_resume_none_continues_its_run(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    first = _pretrain(out, cache, 4, "none")
    assert "resumed at step" not in first.stderr
    requeued = _pretrain(out, cache, 6, "none", SLURM_RESTART_COUNT="1")
    assert "resumed at step 4" in requeued.stderr, requeued.stderr[-3000:]
    assert "requeued job (SLURM_RESTART_COUNT=1): resuming the run's newest checkpoint" in requeued.stderr
    again = _pretrain(out, cache, 6, "none")  # not requeued: --resume none starts over, as asked
    assert "resumed at step" not in again.stderr and "requeued job" not in again.stderr, again.stderr[-3000:]


def test_the_spec_stands_before_the_runs_first_checkpoint_and_outside_a_requeue(tmp_path):
    root = tmp_path / "checkpoints"
    assert requeued_spec("none", root, 2) == "none"  # preempted before its first checkpoint: start as submitted
    assert requeued_spec("/runs/base/checkpoints/step00000100", root, 1) == "/runs/base/checkpoints/step00000100"
    step = root / "step00000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("step00000004\n")
    (step / "comera_meta.json").write_text("{}")
    assert requeued_spec("none", root, 1) == "auto"
    assert requeued_spec("/runs/base/checkpoints/step00000100", root, 3) == "auto"
    assert requeued_spec("none", root, 0) == "none" and requeued_spec("auto", root, 0) == "auto"

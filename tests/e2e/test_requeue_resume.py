"""A requeued Slurm job continues its run whatever ``--resume`` it was submitted with.

``slurm/pretrain.sh`` passes the user's arguments after its own ``--resume auto``, and a requeue runs the same
command: with ``--resume none`` every requeue started the run over (and a checkpoint path went back to that
checkpoint), so a job longer than its time limit never finished. The trainer now resumes ``auto`` when
``SLURM_RESTART_COUNT`` > 0 and the checkpoint ``auto`` would take was written by this job (``SLURM_JOB_ID``,
recorded in its meta: ``checkpoint.requeued_spec``); an older run's checkpoints do not count.
"""

from __future__ import annotations

import json
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
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_RESTART_COUNT", "SLURM_JOB_ID")}
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
    first = _pretrain(out, cache, 4, "none", SLURM_JOB_ID="4242")
    assert "resumed at step" not in first.stderr
    requeued = _pretrain(out, cache, 6, "none", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1")
    assert "resumed at step 4" in requeued.stderr, requeued.stderr[-3000:]
    assert "requeued job (SLURM_RESTART_COUNT=1): resuming this job's newest checkpoint" in requeued.stderr
    # another job asked to start over in that directory, requeued before its first checkpoint: it starts over
    other = _pretrain(out, cache, 6, "none", SLURM_JOB_ID="5000", SLURM_RESTART_COUNT="1")
    assert "resumed at step" not in other.stderr and "requeued job" not in other.stderr, other.stderr[-3000:]
    again = _pretrain(out, cache, 6, "none")  # not requeued: --resume none starts over, as asked
    assert "resumed at step" not in again.stderr and "requeued job" not in again.stderr, again.stderr[-3000:]


def _checkpoint(root: Path, step: int, job_id: str | None) -> None:
    path = root / f"step{step:08d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(f"{path.name}\n")
    (path / "comera_meta.json").write_text(json.dumps({"slurm_job_id": job_id}))
    (root / "latest").write_text(path.name)


def test_the_spec_stands_until_the_job_has_a_checkpoint_and_outside_a_requeue(tmp_path):
    root, rewind = tmp_path / "checkpoints", "/runs/base/checkpoints/step00000600"
    assert requeued_spec("none", root, 2, "7") == "none"  # preempted before its first checkpoint: start as submitted
    for step in (600, 800, 1000):  # an earlier job's run, left in place by `none` or by a rewind to step 600
        _checkpoint(root, step, "6")
    assert requeued_spec("none", root, 1, "7") == "none" and requeued_spec(rewind, root, 1, "7") == rewind
    _checkpoint(root, 700, None)  # written outside Slurm (no job id)
    assert requeued_spec("none", root, 1, "7") == "none"
    _checkpoint(root, 650, "7")  # this job's first checkpoint, which `latest` names
    assert requeued_spec("none", root, 1, "7") == "auto" and requeued_spec(rewind, root, 3, "7") == "auto"
    assert requeued_spec("none", root, 0, "7") == "none" and requeued_spec("auto", root, 0, "7") == "auto"
    assert requeued_spec("none", root, 1, None) == "none"  # not a Slurm job
    (root / "step00000650" / "comera_meta.json").write_text("{")  # unreadable: auto would skip it too
    assert requeued_spec("none", root, 1, "7") == "none"


@pytest.mark.parametrize(("restarts", "spec"), [(None, "none"), ("0", "none"), ("", "none"), ("x1", "none"),
                                                 ("1", "auto"), ("12", "auto")])
def test_only_a_requeue_count_above_0_makes_a_job_continue(tmp_path, monkeypatch, restarts, spec):
    """``trainer._requeued`` reads ``SLURM_RESTART_COUNT``: unset, 0 or not a count is a first run (a second
    ``comera pretrain --resume none`` inside the same allocation starts over), only a requeue continues."""
    from comera_dist.config import load_run_config
    from comera_dist.engine.trainer import _requeued

    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [f"train.output_dir={tmp_path}"])
    _checkpoint(tmp_path / "checkpoints", 4, "77")  # this job's checkpoint
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    if restarts is None:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    assert _requeued(cfg, "none", rank=0) == spec

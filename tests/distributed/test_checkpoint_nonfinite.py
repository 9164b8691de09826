"""The issue's sequence on a real 2-rank training job: a run resumes from a checkpoint whose weights are
NaN (written before manifests existed, so it cannot be verified), every loss is non-finite, the
non-finite stop trips. The poisoned state must not be written as "last good", no checkpoint may be
deleted, and the log must say which checkpoint is kept."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from dist_helpers import run_ranks

from comera_dist.engine.checkpoint import tag_for

REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("COMERA_TEST_CACHE", str(Path(tempfile.gettempdir()) / "comera-dist-test-cache"))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank: int, world_size: int, outdir: str, steps: int) -> dict:
    os.environ.update(COMERA_CACHE=CACHE, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    from comera_dist.config import load_run_config
    from comera_dist.engine.trainer import train

    records = _Records()
    for name in ("comera_dist.engine.session", "comera_dist.engine.trainer", "comera_dist.engine.checkpoint"):
        logging.getLogger(name).addHandler(records)
    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [
        f"train.output_dir={outdir}", f"train.steps={steps}", "train.checkpoint_every=2", "train.eval_every=0",
        "train.keep_checkpoints=2", "deepspeed.zero_stage=0", "comera.pruning.every=0",
        "metrics.prometheus=false", "metrics.report=false"])
    status = train(cfg, resume="auto")
    return {"status": status, "log": records.lines}


def test_nonfinite_stop_never_writes_poisoned_state_and_keeps_previous(tmp_path):
    out = tmp_path / "run"
    run_ranks(_train, tmp_path / "w1", str(out), 4)
    root = out / "checkpoints"
    step4 = root / tag_for(4)
    # Poison step 4 the way an old, unverifiable checkpoint could be: NaN weights, pre-manifest marker.
    shard = step4 / "mp_rank_00_model_states.pt"
    state = torch.load(shard, map_location="cpu", weights_only=False)
    for name, t in state["module"].items():
        if t.is_floating_point() and "cores" in name:
            t.fill_(float("nan"))
    torch.save(state, shard)
    (step4 / "COMPLETE").write_text(f"{tag_for(4)}\n")

    results = run_ranks(_train, tmp_path / "w2", str(out), 10)
    for r in results:
        assert r["status"] == 3, r["log"][-10:]
    log = results[0]["log"]
    assert any("written before checkpoint manifests" in line for line in log), log
    assert any("stopping: 3 consecutive non-finite steps" in line for line in log), log
    refused = [line for line in log if line.startswith("step 7: not checkpointing")]
    assert refused and "non-finite" in refused[0] and "cores" in refused[0], log
    assert any(f"nothing written; the previous checkpoint {step4} is kept" in line for line in log), log
    # Nothing was written at the stop, and nothing was deleted.
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [tag_for(2), tag_for(4)]
    assert (root / "latest").read_text() == tag_for(4)

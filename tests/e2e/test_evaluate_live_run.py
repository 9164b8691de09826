"""``comera evaluate --checkpoint RUN_DIR`` on a live run: the run publishes a newer checkpoint and its retention
deletes the one the evaluation located, after the evaluation read that checkpoint's config and tokenizer and
while it reads the weights. The evaluation then scores the newest checkpoint, as it would have had it started a
moment later, instead of failing.

One real tiny-cpu pretraining run (checkpoints at steps 3 and 6); the live run's publish of step 6 and its
retention (``checkpoint.remove_old``, keep 1) are played when the evaluation first verifies a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from comera_dist import cli

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("COMERA_TEST_CACHE", Path(tempfile.gettempdir()) / "comera-dist-test-cache"))
STEP3, STEP6 = "step00000003", "step00000006"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("live") / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(COMERA_CACHE=str(CACHE), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "comera_dist.cli", "pretrain", "--config", "configs/tiny-cpu.yaml",
                        "--set", f"train.output_dir={out}", "--set", "metrics.prometheus=false",
                        "--set", "metrics.report=false"],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert {d.name for d in (out / "checkpoints").glob("step*")} == {STEP3, STEP6}
    return out


def test_evaluate_scores_the_newest_when_retention_deletes_the_located_checkpoint(finished_run, tmp_path,
                                                                                   monkeypatch, capsys):
    from comera_dist.engine import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    root = run / "checkpoints"
    os.rename(root / STEP6, root / (ckpt.TMP_PREFIX + STEP6))  # not yet published: latest is step 3
    (root / ckpt.LATEST).write_text(STEP3)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted((REPO / "comera_dist" / "engine").glob("*.py"))[:3]:
        (corpus / f.name).write_text(f.read_text())
    checked, real_check = [], ckpt.check

    def check(path: Path, **only) -> list[str]:
        if only:  # evaluate's first look at the config and meta alone (``_read``), before it loads
            return real_check(path, **only)
        checked.append(Path(path).name)
        if len(checked) == 1:  # the live run publishes step 6 and keeps 1
            os.rename(root / (ckpt.TMP_PREFIX + STEP6), root / STEP6)
            (root / ckpt.LATEST).write_text(STEP6)
            assert ckpt.remove_old(root, keep=1) == [root / STEP3]
        return real_check(path)

    monkeypatch.setattr(ckpt, "check", check)
    rc = cli.main(["evaluate", "--checkpoint", str(run), "--data", str(corpus), "--json", "--batch-size", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert checked == [STEP3, STEP6]
    result = json.loads(out)
    assert result["checkpoint"] == str(root / STEP6) and result["masked_tokens"] > 0

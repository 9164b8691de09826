"""``comera export`` of a real (one-step tiny-cpu) run, as a user walks through it: the exported tokenizer
fits the exported model (``AutoTokenizer(long text, truncation=True)`` feeds ``AutoModelForMaskedLM`` at most
``max_positions`` ids framed ``[CLS] ... [SEP]``, as the training blocks are), in every format, and the run's
tokenizer and the exports are readable by the group (a plain ``mkdir``'s mode, not ``mkdtemp``'s 0700)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from comera_dist import cli

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("COMERA_TEST_CACHE", Path(tempfile.gettempdir()) / "comera-dist-test-cache"))
UMASK = 0o022  # a shared cluster's usual one: mkdtemp's 0700 differs from what it gives a plain mkdir
FORMATS = ("dense-hf", "tt", "consolidated")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A one-step tiny-cpu run (max_positions 64) and its export in each format, all under ``UMASK``."""
    root = tmp_path_factory.mktemp("export-tokenizer")
    run = root / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(COMERA_CACHE=str(CACHE), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "comera_dist.cli", "pretrain", "--config", "configs/tiny-cpu.yaml",
                        "--set", f"train.output_dir={run}", "--set", "train.steps=1", "--set", "train.eval_every=1",
                        "--set", "train.checkpoint_every=1", "--set", "metrics.prometheus=false"],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, umask=UMASK)
    assert p.returncode == 0, p.stderr[-4000:]
    old = os.umask(UMASK)
    try:
        for fmt in FORMATS:
            assert cli.main(["export", "--checkpoint", str(run), "--out", str(root / fmt), "--format", fmt]) == 0
        os.mkdir(run / "plain")  # what a plain mkdir gets beside <run>/tokenizer, and beside the exports
        os.mkdir(root / "plain")
    finally:
        os.umask(old)
    return run, {fmt: root / fmt for fmt in FORMATS}


def test_the_dense_export_tokenizer_feeds_its_model_a_long_file(exported):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    run, outs = exported
    text = "".join(f.read_text() for f in sorted((REPO / "comera_dist" / "engine").glob("*.py"))[:3])
    tok = AutoTokenizer.from_pretrained(outs["dense-hf"])
    model = AutoModelForMaskedLM.from_pretrained(outs["dense-hf"]).eval()
    positions = model.config.max_position_embeddings
    assert positions == 64 and tok.model_max_length == positions
    batch = tok(text, truncation=True, return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    assert len(ids) == positions and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    with torch.no_grad():
        assert model(**batch).logits.shape == (1, positions, model.config.vocab_size)
    short = tok("import os")["input_ids"]
    assert short[0] == tok.cls_token_id and short[-1] == tok.sep_token_id
    # the run's own copy is left for packing: whole documents, no special tokens added by the tokenizer
    run_tok = AutoTokenizer.from_pretrained(run / "tokenizer")
    assert run_tok.model_max_length == 10**9 and run_tok("import os")["input_ids"] == short[1:-1]


@pytest.mark.parametrize("fmt", ["tt", "consolidated"])
def test_every_formats_tokenizer_is_the_dense_exports(exported, fmt):
    _, outs = exported
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (outs[fmt] / name).read_text() == (outs["dense-hf"] / name).read_text()


def test_the_runs_tokenizer_and_the_exports_get_a_plain_mkdirs_mode(exported):
    run, outs = exported
    assert _mode(run / "tokenizer") == _mode(run / "plain")
    for out in outs.values():
        assert _mode(out) == _mode(out.parent / "plain"), out


def _mode(path: Path) -> str:
    return stat.filemode(path.stat().st_mode)  # drwxr-xr-x

"""An exported model's tokenizer (``save_export_tokenizer``) fits the model: ``truncation=True`` stops at its
position table, and an MLM export frames the text as the training blocks are (``[CLS] chunk [SEP]``) while
a causal export adds nothing; and a run's published tokenizer directory gets a plain ``mkdir``'s mode."""

from __future__ import annotations

import os
import stat

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from comera_dist.data import TokenizerConfig
from comera_dist.data.tokenizer import (
    load_tokenizer,
    save_export_tokenizer,
    save_run_tokenizer,
    train_tokenizer,
)
from comera_dist.models import ModelConfig, build_model
from comera_dist.models.export import export_dense

POSITIONS = 24
DOC = "def _get_default_tempdir(self):\n    return os.path.join(base, name)\n"
LONG = DOC * 40  # hundreds of tokens: far more than POSITIONS


@pytest.fixture(scope="module")
def run_tok(tmp_path_factory):
    """A trained tokenizer saved as a run saves it (``<run>/tokenizer``)."""
    texts = datasets.Dataset.from_dict({"text": [DOC, "import sys\nprint(sys.argv)\n"] * 20})
    path = tmp_path_factory.mktemp("run") / "tokenizer"
    save_run_tokenizer(train_tokenizer(texts, TokenizerConfig(kind="bpe", vocab_size=300), show_progress=False),
                       path)
    return path


def _export(run_tok, out, arch: str, **kw):
    """A tiny random ``arch`` exported to ``out`` with the run tokenizer set for it; (tokenizer, model)."""
    run = load_tokenizer(run_tok)
    cfg = ModelConfig(arch=arch, vocab_size=len(run), hidden_size=16, num_layers=1, num_heads=2,
                      intermediate_size=32, max_positions=POSITIONS)
    export_dense(build_model(cfg), out)
    save_export_tokenizer(run_tok, out, max_length=POSITIONS, objective="mlm" if arch == "bert_mlm" else "causal",
                          **kw)
    auto = AutoModelForMaskedLM if arch == "bert_mlm" else AutoModelForCausalLM
    return AutoTokenizer.from_pretrained(out), auto.from_pretrained(out).eval()


def test_an_mlm_export_truncates_to_the_position_table_and_frames_like_the_training_blocks(run_tok, tmp_path):
    tok, model = _export(run_tok, tmp_path / "out", "bert_mlm")
    run = load_tokenizer(run_tok)
    assert run.model_max_length == 10**9  # the run's copy still packs whole documents
    ids = tok(LONG, truncation=True)["input_ids"]
    assert len(ids) == POSITIONS and ids[0] == run.cls_token_id and ids[-1] == run.sep_token_id
    assert ids[1:-1] == run(LONG, add_special_tokens=False)["input_ids"][:POSITIONS - 2]
    with torch.no_grad():
        logits = model(**tok(LONG, truncation=True, return_tensors="pt")).logits  # (1, POSITIONS, V)
    assert logits.shape == (1, POSITIONS, len(run))
    pair = tok("import sys", "print(x)", return_token_type_ids=True)
    a, b = (run(t, add_special_tokens=False)["input_ids"] for t in ("import sys", "print(x)"))
    cls, sep = run.cls_token_id, run.sep_token_id
    assert pair["input_ids"] == [cls, *a, sep, *b, sep]
    assert pair["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_an_mlm_export_of_a_model_with_one_token_type_keeps_pairs_on_type_0(run_tok, tmp_path):
    tok, _ = _export(run_tok, tmp_path / "out", "bert_mlm", pair_type_id=0)
    assert set(tok("import sys", "print(x)", return_token_type_ids=True)["token_type_ids"]) == {0}


def test_a_causal_export_truncates_and_adds_no_special_token(run_tok, tmp_path):
    """A causal run's blocks are windows of the document stream: a prompt's ids are its text's ids."""
    tok, model = _export(run_tok, tmp_path / "out", "gpt")
    ids = tok(LONG, truncation=True)["input_ids"]
    assert ids == load_tokenizer(run_tok)(LONG, add_special_tokens=False)["input_ids"][:POSITIONS]
    with torch.no_grad():
        assert model(**tok(LONG, truncation=True, return_tensors="pt")).logits.shape[:2] == (1, POSITIONS)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=oct)
def test_a_runs_tokenizer_directory_gets_a_plain_mkdirs_mode(run_tok, tmp_path, umask):
    """Not mkdtemp's 0700: a teammate on a shared cluster evaluates and exports the run."""
    old = os.umask(umask)
    try:
        save_run_tokenizer(load_tokenizer(run_tok), tmp_path / "tokenizer")
        os.mkdir(tmp_path / "plain")
    finally:
        os.umask(old)
    modes = [stat.filemode((tmp_path / name).stat().st_mode) for name in ("tokenizer", "plain")]
    assert modes[0] == modes[1]  # drwxr-xr-x under 022

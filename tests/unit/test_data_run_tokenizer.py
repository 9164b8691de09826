"""The pieces of a run's tokenizer: its digest, its files sent between ranks, packing with a given one, and
``save_run_tokenizer`` beside the checkpoints."""

from __future__ import annotations

import pytest

from comera_dist.data import DataConfig, TokenizerConfig
from comera_dist.data.prepare import prepare_data, prepare_tokenizer
from comera_dist.data.tokenizer import (
    load_tokenizer,
    save_run_tokenizer,
    tokenizer_digest,
    tokenizer_files,
    tokenizer_from_files,
)

TEXT = "def _get_default_tempdir(self):\n    return os.path.join(base, name)\n"


def _cfg(cache, vocab: int = 400) -> DataConfig:
    return DataConfig(max_files=12, validation_fraction=0.25, seq_len=32, cache_dir=str(cache),
                      tokenizer=TokenizerConfig(vocab_size=vocab))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return prepare_tokenizer(_cfg(cache), show_progress=False), prepare_tokenizer(_cfg(cache, 300), show_progress=False)


def test_the_files_sent_to_other_ranks_make_the_same_tokenizer(tokenizers):
    tok, other = tokenizers
    copy = tokenizer_from_files(tokenizer_files(tok))
    assert tokenizer_digest(copy) == tokenizer_digest(tok) != tokenizer_digest(other)
    assert copy(TEXT)["input_ids"] == tok(TEXT)["input_ids"] != other(TEXT)["input_ids"]


def test_blocks_are_packed_with_the_given_tokenizer_and_cached_by_its_digest(tmp_path, tokenizers):
    _, other = tokenizers
    own = prepare_data(_cfg(tmp_path), show_progress=False)
    given = prepare_data(_cfg(tmp_path), show_progress=False, tokenizer=other)
    assert given.tokenizer is other and given.cache_path != own.cache_path
    assert max(max(row) for row in given.train["input_ids"]) < len(other) < len(own.tokenizer)
    first = other.decode(given.train["input_ids"][0][:8])
    assert first and first == other.decode(other(first, add_special_tokens=False)["input_ids"])


def test_a_runs_tokenizer_is_kept_when_it_is_the_same_and_replaced_when_not(tmp_path, tokenizers):
    tok, other = tokenizers
    path = tmp_path / "run" / "tokenizer"
    save_run_tokenizer(tok, path)
    stamp = (path / "tokenizer.json").stat().st_mtime_ns
    save_run_tokenizer(tok, path)
    assert (path / "tokenizer.json").stat().st_mtime_ns == stamp  # the same one: left as it is
    save_run_tokenizer(other, path)  # a fresh start in an earlier run's directory
    assert tokenizer_digest(load_tokenizer(path)) == tokenizer_digest(other)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokenizer"]  # nothing left aside

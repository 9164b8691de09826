"""Tokenizer training with ``tokenizers``: both kinds, special tokens, save/load, byte cap, caching."""

import datasets
import pytest
from transformers import AutoTokenizer

from comera_dist.data import (
    SPECIAL_TOKENS,
    CacheError,
    DataError,
    TokenizerConfig,
    load_tokenizer,
    train_tokenizer,
)
from comera_dist.data.tokenizer import _capped, obtain_tokenizer

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))  # caf\u00e9 \u2603\n",
] * 40


@pytest.fixture(scope="module")
def texts():
    return datasets.Dataset.from_dict({"text": CODE})


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_trained_tokenizer_has_specials_and_requested_size(texts, kind, tmp_path):
    tok = train_tokenizer(texts, TokenizerConfig(kind=kind, vocab_size=300, min_frequency=1), show_progress=False)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (0, 2, 3, 4)
    assert 5 < len(tok) <= 300
    ids = tok(CODE[1], add_special_tokens=False)["input_ids"]
    assert len(ids) < len(CODE[1]) / 2  # it learnt merges
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(CODE[2])["input_ids"] == tok(CODE[2])["input_ids"] and len(again) == len(tok)


def test_byte_level_bpe_is_lossless_on_code_and_unicode(texts):
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=300, min_frequency=1), show_progress=False)
    unseen = "x\t=  {'\u00fc': 1}\r\n\u4e2d\U0001f600\n"
    for text in CODE[:3] + [unseen]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.unk_token_id not in tok(unseen)["input_ids"]


def test_wordpiece_maps_unseen_symbols_to_unk(texts):
    tok = train_tokenizer(texts, TokenizerConfig(kind="wordpiece", vocab_size=300, min_frequency=1),
                          show_progress=False)
    assert tok.unk_token_id in tok("\u4e2d", add_special_tokens=False)["input_ids"]


def test_training_text_is_capped_by_bytes():
    ds = datasets.Dataset.from_dict({"text": ["abcd" * 25] * 1000})  # 100 bytes each
    seen = [t for batch in _capped(ds, 1050) for t in batch]
    assert len(seen) == 11  # stops at the document that reaches the cap
    assert sum(len(t) for batch in _capped(ds, 10**9) for t in batch) == 100_000


def test_cached_by_content_and_damage_is_reported(texts, tmp_path):
    cfg = TokenizerConfig(vocab_size=300, min_frequency=1)
    tok, key = obtain_tokenizer(texts, cfg, corpus_key="c1", cache_root=tmp_path, show_progress=False)
    again, key2 = obtain_tokenizer(None, cfg, corpus_key="c1", cache_root=tmp_path)  # load only
    assert key == key2 and again.get_vocab() == tok.get_vocab()
    _, other = obtain_tokenizer(texts, TokenizerConfig(vocab_size=280, min_frequency=1), corpus_key="c1",
                                cache_root=tmp_path, show_progress=False)
    assert other != key and obtain_tokenizer(texts, cfg, corpus_key="c2", cache_root=tmp_path,
                                             show_progress=False)[1] != key
    entry = tmp_path / f"tokenizer-{key}"
    (entry / "tokenizer.json").write_text("{ not json")
    with pytest.raises(CacheError, match=f"unreadable cache entry {entry}.*rm -rf '{entry}'"):
        obtain_tokenizer(texts, cfg, corpus_key="c1", cache_root=tmp_path)
    with pytest.raises(CacheError, match="missing after the building rank finished"):
        obtain_tokenizer(None, cfg, corpus_key="c3", cache_root=tmp_path)


def test_pretrained_directory(texts, tmp_path):
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=300, min_frequency=1), show_progress=False)
    tok.save_pretrained(tmp_path / "mine")
    got, _ = obtain_tokenizer(None, TokenizerConfig(pretrained=str(tmp_path / "mine")), corpus_key="x",
                              cache_root=tmp_path / "cache")
    assert got.get_vocab() == tok.get_vocab()
    with pytest.raises(DataError, match=r"data.tokenizer.pretrained: no such directory: .*absent"):
        obtain_tokenizer(None, TokenizerConfig(pretrained=str(tmp_path / "absent")), corpus_key="x",
                         cache_root=tmp_path)
    (tmp_path / "junk").mkdir()
    with pytest.raises(DataError, match=r"data.tokenizer.pretrained: cannot load a tokenizer from .*junk"):
        load_tokenizer(tmp_path / "junk")


def test_a_bpe_vocabulary_below_its_byte_alphabet_is_refused_by_the_config(texts):
    """Byte-level BPE keeps its 256 byte tokens whatever the target: a run learned so only after its data build
    (the model's vocab_size refused the 261-token tokenizer then). The refusal's floor is the real one."""
    from comera_dist.data.config import BPE_MIN_VOCAB

    with pytest.raises(ValueError, match=f"tokenizer.vocab_size must be >= {BPE_MIN_VOCAB} for kind bpe"):
        TokenizerConfig(vocab_size=BPE_MIN_VOCAB - 1)
    TokenizerConfig(kind="wordpiece", vocab_size=100)  # WordPiece has no byte alphabet
    floor = train_tokenizer(texts, TokenizerConfig(vocab_size=BPE_MIN_VOCAB, min_frequency=10**6), show_progress=False)
    assert len(floor) == BPE_MIN_VOCAB  # no merge learned: the alphabet and the specials alone

"""prepare_data end to end on the embedded stdlib corpus, check_compat, evaluation_corpus, rank roles."""

import json

import datasets
import numpy as np
import pytest

from comera_dist.data import (
    CacheError,
    DataConfig,
    DataError,
    PackedLoader,
    TokenizerConfig,
    check_compat,
    evaluation_corpus,
    prepare_data,
)
from comera_dist.data import prepare as prepare_mod

SEQ = 64


def _cfg(cache, **kw):
    kw.setdefault("tokenizer", TokenizerConfig(vocab_size=500))
    return DataConfig(max_files=20, validation_fraction=0.2, seq_len=SEQ, cache_dir=str(cache), **kw)


@pytest.fixture(scope="module")
def stdlib_mlm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, prepare_data(_cfg(cache), show_progress=False)


def _arr(ds):
    return np.asarray(ds.with_format("numpy")["input_ids"])


def test_stdlib_blocks_are_packed_mlm_blocks(stdlib_mlm):
    _, data = stdlib_mlm
    tok = data.tokenizer
    assert data.vocab_size == len(tok) == 500
    for ds in (data.train, data.validation):
        ids = _arr(ds)  # (n, L)
        assert ids.shape[1] == SEQ and len(ids) > 20
        assert (ids[:, 0] == tok.cls_token_id).all() and (ids[:, -1] == tok.sep_token_id).all()
        assert ids.min() >= 0 and ids.max() < data.vocab_size
        assert not np.isin(ids, [tok.pad_token_id, tok.mask_token_id]).any()
    text = tok.decode(_arr(data.train)[0, 1:-1])
    assert "def " in text or "import " in text or '"""' in text  # it is Python source


def test_split_is_by_file_and_disjoint(stdlib_mlm):
    cache, _ = stdlib_mlm
    corpus = datasets.load_from_disk(str(next(cache.glob("corpus-*"))))
    train, val = set(corpus["train"]["path"]), set(corpus["validation"]["path"])
    assert train.isdisjoint(val) and len(train) + len(val) <= 20 and val


def test_rebuild_elsewhere_is_identical_and_cache_hit_skips_all_work(stdlib_mlm, tmp_path, monkeypatch):
    _, data = stdlib_mlm
    fresh = prepare_data(_cfg(tmp_path), show_progress=False)
    assert np.array_equal(_arr(fresh.train), _arr(data.train))
    assert np.array_equal(_arr(fresh.validation), _arr(data.validation))
    assert fresh.tokenizer.get_vocab() == data.tokenizer.get_vocab()

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(prepare_mod.corpus, "build_corpus", boom)
    monkeypatch.setattr(prepare_mod.packing, "pack", boom)
    again = prepare_data(_cfg(tmp_path), show_progress=False)
    assert np.array_equal(_arr(again.train), _arr(data.train))


def test_causal_and_wordpiece_variants(tmp_path):
    data = prepare_data(_cfg(tmp_path, objective="causal", tokenizer=TokenizerConfig(kind="wordpiece",
                                                                                      vocab_size=400)),
                        show_progress=False)
    ids = _arr(data.train)
    assert ids.shape[1] == SEQ and not (ids[:, 0] == data.tokenizer.cls_token_id).all()
    batch = next(PackedLoader(data.train, batch_size=2, rank=0, world_size=1, seed=0, collator=data.collator))
    assert (batch["labels"] == batch["input_ids"]).all()
    assert len(list(tmp_path.glob("corpus-*"))) == 1 and len(list(tmp_path.glob("blocks-*"))) == 1


def test_mlm_batches_from_prepared_data(stdlib_mlm):
    _, data = stdlib_mlm
    batch = next(PackedLoader(data.train, batch_size=4, rank=0, world_size=1, seed=0, collator=data.collator))
    masked = batch["input_ids"] == data.tokenizer.mask_token_id
    assert masked.any() and (batch["labels"][masked] >= 5).all()


def test_seq_len_longer_than_the_corpus_is_an_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("short text\n")
    (tmp_path / "tiny2.txt").write_text("also short\n")
    cfg = DataConfig(source="files", files=[str(tmp_path / "tiny.txt"), str(tmp_path / "tiny2.txt")],
                     split_by="document", validation_fraction=0.5, seq_len=512, cache_dir=str(tmp_path / "c"),
                     tokenizer=TokenizerConfig(vocab_size=300, min_frequency=1))
    with pytest.raises(DataError, match=r"tokenizing \w+: \d+ tokens from 1 documents make no block of "
                                        r"data.seq_len=512"):
        prepare_data(cfg, show_progress=False)
    assert not list((tmp_path / "c").glob("blocks-*"))


def test_check_compat():
    cfg = DataConfig(seq_len=256, tokenizer=TokenizerConfig(vocab_size=8000))
    check_compat(cfg, vocab_size=8000, max_positions=256)
    check_compat(cfg, vocab_size=8192, max_positions=512)  # a padded vocabulary is fine
    with pytest.raises(DataError, match="data.seq_len=256 exceeds the model's max_positions=128"):
        check_compat(cfg, vocab_size=8000, max_positions=128)
    with pytest.raises(DataError, match="model vocab_size=5000 is smaller than data.tokenizer.vocab_size=8000"):
        check_compat(cfg, vocab_size=5000, max_positions=512)


def test_check_compat_with_the_built_tokenizer(stdlib_mlm):
    _, data = stdlib_mlm
    cfg = DataConfig(seq_len=SEQ)
    check_compat(cfg, vocab_size=500, max_positions=SEQ, tokenizer=data.tokenizer)
    with pytest.raises(DataError, match=r"model vocab_size=499 is smaller than the tokenizer's vocabulary "
                                        r"\(500 tokens\): token ids up to 499"):
        check_compat(cfg, vocab_size=499, max_positions=SEQ, tokenizer=data.tokenizer)


def test_evaluation_corpus_reads_any_local_files(stdlib_mlm, tmp_path):
    _, data = stdlib_mlm
    src = tmp_path / "eval"
    (src / "pkg").mkdir(parents=True)
    code = "def f(x):\n    return [i * x for i in range(10)]\n" * 20
    (src / "pkg" / "m.py").write_text(code)
    (src / "notes.txt").write_text("plain words " * 100)
    (src / "rows.jsonl").write_text("\n".join(json.dumps({"text": code}) for _ in range(3)))
    datasets.Dataset.from_dict({"text": [code] * 2}).to_parquet(str(src / "t.parquet"))
    blocks = evaluation_corpus([src], data.tokenizer, seq_len=SEQ, cache_dir=tmp_path / "c", show_progress=False)
    one = evaluation_corpus([src / "pkg" / "m.py"], data.tokenizer, seq_len=SEQ, show_progress=False)
    assert len(blocks) > 6 * len(one) > 0  # six code-sized documents plus the text file
    assert _arr(blocks).shape[1] == SEQ
    with pytest.raises(DataError, match=r"evaluation paths: no such file or directory: .*missing.py"):
        evaluation_corpus([tmp_path / "missing.py"], data.tokenizer, seq_len=SEQ)
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match=r"empty corpus: the evaluation paths \[.*empty.txt'\] hold no"):
        evaluation_corpus([tmp_path / "empty.txt"], data.tokenizer, seq_len=SEQ)


def test_rank_roles_with_a_barrier(tmp_path):
    calls = []
    with pytest.raises(DataError, match="world_size=2 needs a barrier callable"):
        prepare_data(_cfg(tmp_path), rank=0, world_size=2)
    # a non-building rank waits first, then only loads: with nothing built it fails clearly
    with pytest.raises(CacheError, match="missing after the building rank finished: it may have failed"):
        prepare_data(_cfg(tmp_path), rank=1, world_size=2, barrier=lambda: calls.append("r1"))
    assert calls == ["r1"]
    built = prepare_data(_cfg(tmp_path), rank=0, world_size=2, barrier=lambda: calls.append("r0"),
                         show_progress=False)
    loaded = prepare_data(_cfg(tmp_path), rank=1, world_size=2, barrier=lambda: calls.append("r1"))
    assert calls == ["r1", "r0", "r1"] and np.array_equal(_arr(built.train), _arr(loaded.train))


def test_progress_bars_on_the_building_rank_only(tmp_path, capfd):
    prepare_data(_cfg(tmp_path), rank=0, world_size=2, barrier=lambda: None, show_progress=True)
    err = capfd.readouterr().err
    assert "reading train files" in err and "tokenizing validation" in err
    prepare_data(_cfg(tmp_path), rank=1, world_size=2, barrier=lambda: None, show_progress=True)
    assert "files" not in capfd.readouterr().err
    prepare_data(_cfg(tmp_path / "quiet"), show_progress=False)
    quiet = capfd.readouterr().err
    assert "reading" not in quiet and "tokenizing" not in quiet and "Saving the dataset" not in quiet

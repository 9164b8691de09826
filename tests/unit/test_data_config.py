"""DataConfig / TokenizerConfig: defaults, validation messages, strict YAML loading."""

import pytest

from comera_dist.configbase import ConfigError, from_dict, to_dict
from comera_dist.data import DataConfig, TokenizerConfig


def test_defaults_are_the_embedded_stdlib_mlm_run():
    cfg = DataConfig()
    assert (cfg.source, cfg.objective, cfg.mlm_probability, cfg.tokenizer.kind) == ("stdlib", "mlm", 0.15, "bpe")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("COMERA_CACHE", raising=False)
    assert str(DataConfig().resolved_cache_dir()).endswith(".cache/comera-dist")
    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "env"))
    assert DataConfig().resolved_cache_dir() == tmp_path / "env"
    assert DataConfig(cache_dir=str(tmp_path / "x")).resolved_cache_dir() == tmp_path / "x"


@pytest.mark.parametrize("source, split_by", [("stdlib", "auto"), ("stdlib", "file"), ("hf", "auto"),
                                              ("hf", "document"), ("files", "auto"), ("files", "file"),
                                              ("files", "document")])
def test_split_by_that_the_source_honours_is_accepted(source, split_by):
    extra = {"stdlib": {}, "hf": {"hf_kwargs": {"path": "x"}}, "files": {"files": ["a.txt"]}}[source]
    assert DataConfig(source=source, split_by=split_by, **extra).split_by == split_by


@pytest.mark.parametrize("kwargs, needle", [
    ({"validation_fraction": 0.0}, "data.validation_fraction must be in (0, 1), got 0.0"),
    ({"validation_fraction": 1.5}, "data.validation_fraction must be in (0, 1), got 1.5"),
    ({"seq_len": 4}, "data.seq_len must be >= 8, got 4"),
    ({"mlm_probability": 1.0}, "data.mlm_probability must be in (0, 1), got 1.0"),
    ({"max_files": 1}, "data.max_files must be >= 2 (one per split) or null, got 1"),
    ({"num_proc": 0}, "data.num_proc must be >= 1, got 0"),
    ({"source": "files"}, "data.files must list at least one path when data.source is 'files', got []"),
    ({"files": ["a.txt"]}, "data.files is only read when data.source is 'files' (source is 'stdlib'), got ['a.txt']"),
    ({"source": "hf"}, ("data.hf_kwargs must hold load_dataset arguments (at least 'path') when data.source is "
                        "'hf', got {}")),
    ({"hf_kwargs": {"path": "x"}}, ("data.hf_kwargs is only read when data.source is 'hf' (source is 'stdlib'), "
                                    "got {'path': 'x'}")),
    ({"text_column": ""}, "data.text_column must be a non-empty column name, got ''"),
    # split_by a source cannot honour: the stdlib always splits by file, hf by document
    ({"split_by": "document"}, ("data.split_by='document' is not honoured by data.source='stdlib', which splits "
                                "by file (a hash of each path under the stdlib root); set data.split_by to 'auto' "
                                "or 'file'")),
    ({"source": "hf", "hf_kwargs": {"path": "x"}, "split_by": "file"},
     "data.split_by='file' is not honoured by data.source='hf', which splits by document"),
])
def test_bad_values_name_field_and_value(kwargs, needle):
    with pytest.raises(ValueError) as e:
        DataConfig(**kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("kwargs, needle", [
    ({"vocab_size": 8}, "tokenizer.vocab_size must be >= 16, got 8"),
    ({"min_frequency": 0}, "tokenizer.min_frequency must be >= 1, got 0"),
    ({"max_train_bytes": 0}, "tokenizer.max_train_bytes must be >= 1, got 0"),
    ({"pretrained": " "}, "tokenizer.pretrained must be a directory path or null, got ''"),
])
def test_bad_tokenizer_values(kwargs, needle):
    with pytest.raises(ValueError) as e:
        TokenizerConfig(**kwargs)
    assert needle in str(e.value)


def test_yaml_section_roundtrip_and_strictness():
    data = {"source": "files", "files": ["a.json"], "builder": "json", "seq_len": 64,
            "tokenizer": {"kind": "wordpiece", "vocab_size": 1000}}
    cfg = from_dict(DataConfig, data, "data")
    assert cfg.tokenizer.kind == "wordpiece" and cfg.builder == "json"
    assert from_dict(DataConfig, to_dict(cfg), "data") == cfg
    with pytest.raises(ConfigError, match="data.seq_lne.*did you mean 'seq_len'"):
        from_dict(DataConfig, {"seq_lne": 64}, "data")
    with pytest.raises(ConfigError, match="data.tokenizer.kind"):
        from_dict(DataConfig, {"tokenizer": {"kind": "unigram"}}, "data")
    with pytest.raises(ConfigError, match="data.objective"):
        from_dict(DataConfig, {"objective": "seq2seq"}, "data")

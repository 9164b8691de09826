"""ModelConfig validation: every bad value is a clear error naming the field and the value."""

import pytest

from comera_dist.configbase import ConfigError, from_dict, to_dict
from comera_dist.models import ModelConfig


@pytest.mark.parametrize("kw, msg", [
    ({"hidden_size": 30, "num_heads": 4}, r"model.hidden_size \(30\) must be divisible by model.num_heads \(4\)"),
    ({"arch": "t5"}, r"model.arch must be one of .*'t5'"),
    ({"num_layers": 0}, "model.num_layers must be >= 1, got 0"),
    ({"vocab_size": -3}, "model.vocab_size must be >= 1, got -3"),
    ({"dropout": 1.0}, r"model.dropout must be in \[0, 1\), got 1.0"),
    ({"layer_norm_eps": 0.0}, "model.layer_norm_eps must be > 0"),
    ({"num_labels": 0}, "model.num_labels must be >= 1"),
    ({"type_vocab_size": -1}, "model.type_vocab_size must be >= 0"),
    ({"dropout": -0.1}, r"model.dropout must be in \[0, 1\), got -0.1"),
    ({"init_std": 0.0}, "model.init_std must be > 0, got 0.0"),
    ({"max_positions": 0}, "model.max_positions must be >= 1, got 0"),
])
def test_invalid_values_name_field_and_value(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**kw)


def test_yaml_section_round_trip_and_strict_keys():
    data = {"arch": "gpt", "vocab_size": 100, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
            "intermediate_size": 64, "max_positions": 16, "layer_norm_eps": 1e-5}
    cfg = from_dict(ModelConfig, data, "model")
    assert cfg.head_dim == 8 and from_dict(ModelConfig, to_dict(cfg), "model") == cfg
    with pytest.raises(ConfigError, match="did you mean 'num_heads'"):
        from_dict(ModelConfig, {**data, "num_head": 4}, "model")
    with pytest.raises(ConfigError, match=r"^model\.hidden_size \(32\) must be divisible by model\.num_heads \(5\)"):
        from_dict(ModelConfig, {**data, "num_heads": 5}, "model")

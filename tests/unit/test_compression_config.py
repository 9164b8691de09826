"""ComeraConfig: defaults, YAML loading, and every validation error naming field and value."""

import pytest

from comera_dist.compression.config import (
    ComeraConfig,
    ControllerConfig,
    LrConfig,
    PruningConfig,
    TensorizeConfig,
)
from comera_dist.configbase import ConfigError, from_dict, to_dict


def test_defaults_are_the_documented_ones():
    c = ComeraConfig()
    assert (c.tensorize.num_cores, c.tensorize.embedding_num_cores) == (6, 4)
    assert (c.tensorize.max_rank, c.tensorize.embedding_max_rank) == (30, 32)
    assert (c.controller.gamma, c.controller.tau, c.controller.target_ratio) == (0.01, 1e-2, 0.5)
    assert (c.controller.late_task_weight, c.controller.late_rank_weight) == (0.1, 0.01)
    assert (c.lr.cores, c.lr.gates, c.lr.dense, c.lr.weight_decay) == (1e-4, 1e-3, 5e-5, 0.0)
    assert (c.pruning.every, c.pruning.min_rank) == (0, 1)
    # default_factory: configs never share a mutable dict
    assert ComeraConfig().tensorize.modes is not c.tensorize.modes


def test_from_yaml_dict_round_trips():
    data = {
        "enabled": True,
        "tensorize": {"num_cores": 4, "modes": {"attention": [[4, 4], [2, 8]], "embedding": [[8, 8], [4, 4]]}},
        "controller": {"late_stage_step": 100, "target_ratio": 0.25, "target_loss": 2.0},
        "pruning": {"every": 50, "start_step": 200, "min_rank": 2},
        "lr": {"gates": 0.01},
    }
    c = from_dict(ComeraConfig, data, "comera")
    assert c.tensorize.modes["attention"] == [[4, 4], [2, 8]]
    assert c.controller.late_stage_step == 100 and c.pruning.every == 50 and c.lr.gates == 0.01
    assert from_dict(ComeraConfig, to_dict(c), "comera") == c


def test_unknown_key_is_a_config_error_with_hint():
    with pytest.raises(ConfigError, match=r"comera.controller.gama.*did you mean 'gamma'"):
        from_dict(ComeraConfig, {"controller": {"gama": 0.1}}, "comera")


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (TensorizeConfig, {"num_cores": 5}, r"num_cores .* got 5"),
        (TensorizeConfig, {"num_cores": 0}, r"num_cores .* got 0"),
        (TensorizeConfig, {"embedding_num_cores": 1}, r"embedding_num_cores .* got 1"),
        (TensorizeConfig, {"max_rank": 0}, r"max_rank .* got 0"),
        (TensorizeConfig, {"embedding_max_rank": -3}, r"embedding_max_rank .* got -3"),
        (TensorizeConfig, {"modes": {"mlp": [[2], [2]]}}, r"modes key .* got 'mlp'"),
        (TensorizeConfig, {"modes": {"ffn_in": [[2, 2]]}}, r"modes\['ffn_in'\] .*\[\[2, 2\]\]"),
        (TensorizeConfig, {"modes": {"ffn_out": [[2, 0], [2, 2]]}}, r"positive integers"),
        (TensorizeConfig, {"modes": {"attention": [[2, 2], [4]]}}, r"as many input as output"),
        (ControllerConfig, {"tau": 0.0}, r"tau must be in \(0, 1\), got 0.0"),
        (ControllerConfig, {"tau": -1e-3}, r"tau must be in \(0, 1\), got -0.001"),
        (ControllerConfig, {"tau": 1.0}, r"tau must be in \(0, 1\), got 1.0: every gate starts at 1"),
        (ControllerConfig, {"tau": float("nan")}, r"tau must be in \(0, 1\), got nan"),
        (ControllerConfig, {"embedding_tau": 0.0}, r"controller.embedding_tau must be in \(0, 1\) or null, got 0.0"),
        (ControllerConfig, {"embedding_tau": 1.0}, r"controller.embedding_tau must be in \(0, 1\) or null, got 1.0"),
        (ControllerConfig, {"gamma": -1.0}, r"gamma .* got -1.0"),
        (ControllerConfig, {"target_ratio": 0.0}, r"target_ratio .* got 0.0"),
        (ControllerConfig, {"target_ratio": 1.5}, r"target_ratio .* got 1.5"),
        (ControllerConfig, {"target_loss": -0.5}, r"target_loss .* got -0.5"),
        (ControllerConfig, {"late_stage_step": -1}, r"late_stage_step .* got -1"),
        (ControllerConfig, {"late_stage_loss": 0.0}, r"late_stage_loss .* got 0.0"),
        (PruningConfig, {"min_rank": 0}, r"min_rank must be >= 1, got 0"),
        (PruningConfig, {"every": -5}, r"every .* got -5"),
        (PruningConfig, {"start_step": -1}, r"start_step .* got -1"),
        (LrConfig, {"gates": 0.0}, r"lr.gates must be > 0, got 0.0"),
        (LrConfig, {"weight_decay": -0.1}, r"weight_decay .* got -0.1"),
    ],
)
def test_bad_values_raise_naming_field_and_value(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_bad_value_in_yaml_names_the_section():
    with pytest.raises(ConfigError, match=r"tau must be in \(0, 1\)"):
        from_dict(ComeraConfig, {"controller": {"tau": 0}}, "comera")

"""``deepspeed.precision``: fp32 and bf16 only; fp16 is refused naming the key (see the field's docstring).

fp16 was offered but never tested: DeepSpeed's CPU accelerator refuses it here ("Type fp16 is not
supported on your device"), and its ``DynamicLossScaler`` would fail the ``weights_only`` resume gate.
The 2-rank bf16 checkpoints are tested in tests/distributed/test_checkpoint_precision.py.
"""

from __future__ import annotations

import pytest

from comera_dist.config import build_run_config
from comera_dist.configbase import ConfigError
from comera_dist.engine.config import DeepSpeedSection, to_deepspeed_dict

RUN = {"model": {"arch": "bert_mlm", "vocab_size": 64, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                 "intermediate_size": 32, "max_positions": 16},
       "comera": {"tensorize": {"num_cores": 4, "embedding_num_cores": 2, "max_rank": 4}},
       "data": {"seq_len": 16}}


def test_fp16_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^deepspeed\.precision: 'fp16' is not one of \['fp32', 'bf16'\]$"):
        build_run_config(RUN | {"deepspeed": {"micro_batch_size_per_gpu": 2, "precision": "fp16"}})
    with pytest.raises(ValueError, match=r"^deepspeed\.precision must be 'fp32' or 'bf16', got 'fp16' "
                                         r"\(fp16 is not supported: use bf16\)$"):
        DeepSpeedSection(micro_batch_size_per_gpu=2, precision="fp16")


@pytest.mark.parametrize("precision,expected", [("fp32", None), ("bf16", {"enabled": True, "check_grad_overflow": True})])
def test_deepspeed_json_has_no_fp16_section(precision, expected):
    cfg = build_run_config(RUN | {"deepspeed": {"micro_batch_size_per_gpu": 2, "precision": precision, "zero_stage": 1}})
    ds = to_deepspeed_dict(cfg.deepspeed, 2, total_steps=4, group_lrs=[1e-3])
    assert ds.get("bf16") == expected and "fp16" not in ds


def test_bf16_overflow_check_reaches_the_deepspeed_json_and_is_a_boolean():
    section = {"micro_batch_size_per_gpu": 2, "precision": "bf16", "zero_stage": 1, "bf16_overflow_check": False}
    ds = to_deepspeed_dict(build_run_config(RUN | {"deepspeed": section}).deepspeed, 2, total_steps=4, group_lrs=[1e-3])
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
    with pytest.raises(ConfigError, match=r"deepspeed\.bf16_overflow_check"):
        build_run_config(RUN | {"deepspeed": {**section, "bf16_overflow_check": "no"}})


@pytest.mark.parametrize("stage", [1, 2])
def test_contiguous_gradients_reaches_the_deepspeed_json_at_zero_1_and_2_only(stage):
    section = {"micro_batch_size_per_gpu": 2, "zero_stage": stage, "contiguous_gradients": False}
    ds = to_deepspeed_dict(build_run_config(RUN | {"deepspeed": section}).deepspeed, 2, total_steps=4, group_lrs=[1e-3])
    assert ds["zero_optimization"] == {"stage": stage, "contiguous_gradients": False}
    default = to_deepspeed_dict(build_run_config(RUN | {"deepspeed": {**section, "contiguous_gradients": True}}).deepspeed,
                                2, total_steps=4, group_lrs=[1e-3])
    assert default["zero_optimization"]["contiguous_gradients"] is True  # DeepSpeed's own default, stated
    for other in (0, 3):
        with pytest.raises(ConfigError, match=rf"deepspeed\.contiguous_gradients=false is a ZeRO 1-2 setting, got zero_stage {other}"):
            build_run_config(RUN | {"deepspeed": {**section, "zero_stage": other}})
    with pytest.raises(ConfigError, match=r"deepspeed\.contiguous_gradients"):
        build_run_config(RUN | {"deepspeed": {**section, "contiguous_gradients": "no"}})


def test_bf16_at_zero_stage_0_is_refused_naming_both_keys():
    """DeepSpeed trains bf16 at stage 0 through FP16_Optimizer, whose flat state maps to no parameter:
    a checkpoint of it failed with KeyError 'exp_avg' (engine.prune.gather_full_state)."""
    with pytest.raises(ConfigError, match=r"deepspeed\.precision=bf16 needs deepspeed\.zero_stage >= 1 \(got 0\)"):
        build_run_config(RUN | {"deepspeed": {"micro_batch_size_per_gpu": 2, "precision": "bf16", "zero_stage": 0}})
    DeepSpeedSection(micro_batch_size_per_gpu=2, precision="bf16", zero_stage=1)  # stage 1: accepted

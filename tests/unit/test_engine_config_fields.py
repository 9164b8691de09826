"""``engine.config``'s guards and the DeepSpeed JSON it writes, field by field.

A mutation review of ``engine/config.py`` (``docs/mutation/config_breaks.py``) found 20 of its 47 breaks unseen
by the fast config tests. This file and five more cases of ``test_config_run.py``'s
``test_out_of_range_values_name_their_key`` catch all 20 (each checked red under its break): a guard removed, a
DeepSpeed field that no longer follows its config key, and the batch arithmetic without the world size.
"""

from __future__ import annotations

import os

import pytest

from comera_dist.engine.config import (
    DeepSpeedSection,
    SchedulerConfig,
    TrainConfig,
    solve_batch_sizes,
    to_deepspeed_dict,
)


def test_train_paths_expand_the_home_directory():
    cfg = TrainConfig(output_dir="~/runs/a", resume="~/runs/a/checkpoints/step00000004")
    home = os.path.expanduser("~")
    assert cfg.output_dir == f"{home}/runs/a" and cfg.resume == f"{home}/runs/a/checkpoints/step00000004"
    assert TrainConfig(resume="auto").resume == "auto"


def test_batch_sizes_divide_by_the_world_size():
    got = solve_batch_sizes(DeepSpeedSection(train_batch_size=8), world_size=2)
    assert (got.micro_batch, got.accumulation) == (4, 1)
    got = solve_batch_sizes(DeepSpeedSection(train_batch_size=8, micro_batch_size_per_gpu=2), world_size=2)
    assert got.accumulation == 2
    with pytest.raises(ValueError, match="train_batch_size=6 is not divisible by gradient_accumulation_steps x "
                                         "world_size = 1 x 4"):
        solve_batch_sizes(DeepSpeedSection(train_batch_size=6), world_size=4)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        solve_batch_sizes(DeepSpeedSection(micro_batch_size_per_gpu=1), world_size=0)


def test_deepspeed_json_guards_its_arguments():
    section = DeepSpeedSection(micro_batch_size_per_gpu=1)
    with pytest.raises(ValueError, match=r"group_lrs must be a non-empty list of positive lrs, got \[0.01, 0.0\]"):
        to_deepspeed_dict(section, 1, total_steps=10, group_lrs=[1e-2, 0.0])
    with pytest.raises(ValueError, match="total_steps must be >= 1, got 0"):
        to_deepspeed_dict(section, 1, total_steps=0, group_lrs=[1e-2])


def test_deepspeed_json_follows_each_config_key():
    section = DeepSpeedSection(micro_batch_size_per_gpu=1, gradient_clipping=0.5, adam_betas=[0.8, 0.95],
                               adam_eps=1e-6, comms_logger=True,
                               scheduler=SchedulerConfig(kind="warmup_cosine", warmup_steps=3, min_ratio=0.1))
    ds = to_deepspeed_dict(section, 2, total_steps=40, group_lrs=[1e-2, 5e-2], weight_decay=0.01)
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {
        "lr": 1e-2, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.01, "torch_adam": True, "adam_w_mode": True,
        "fused": True}
    assert ds["scheduler"]["params"] == {"total_num_steps": 40, "warmup_num_steps": 3, "warmup_min_ratio": 0.0,
                                         "cos_min_ratio": 0.1, "warmup_type": "linear"}
    assert ds["comms_logger"]["enabled"] is True
    assert "comms_logger" not in to_deepspeed_dict(DeepSpeedSection(micro_batch_size_per_gpu=1), 1, total_steps=1,
                                                   group_lrs=[1e-2])
    decay = to_deepspeed_dict(DeepSpeedSection(micro_batch_size_per_gpu=1), 1, total_steps=40, group_lrs=[1e-2])
    assert decay["scheduler"]["params"]["total_num_steps"] == 40

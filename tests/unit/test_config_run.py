"""Run-config validation: each mistake is one clear ConfigError naming the dotted key."""

from __future__ import annotations

import re

import pytest
import torch

from comera_dist.config import load_run_config, resolved_dict
from comera_dist.configbase import ConfigError
from comera_dist.engine.config import DeepSpeedSection, solve_batch_sizes, to_deepspeed_dict

BASE = """
model: {arch: bert_mlm, vocab_size: 64, hidden_size: 16, num_layers: 1, num_heads: 2,
        intermediate_size: 32, max_positions: 16}
comera: {tensorize: {num_cores: 4, embedding_num_cores: 2, max_rank: 4}}
data: {seq_len: 16}
deepspeed: {zero_stage: 1, micro_batch_size_per_gpu: 2, gradient_accumulation_steps: 2}
"""


def _write(tmp_path, text=BASE):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_valid_config_and_overrides(tmp_path):
    cfg = load_run_config(_write(tmp_path), ["train.steps=7", "deepspeed.precision=bf16"], world_size=2)
    assert cfg.train.steps == 7 and cfg.deepspeed.precision == "bf16"
    assert resolved_dict(cfg)["deepspeed"]["zero_stage"] == 1


def test_unknown_key_has_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.stepz.*did you mean 'steps'"):
        load_run_config(_write(tmp_path), ["train.stepz=3"])


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"deepspeed\.zero_stage: expected an integer, got str"):
        load_run_config(_write(tmp_path), ["deepspeed.zero_stage=three"])


def test_bad_value_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"deepspeed\.zero_stage must be 0, 1, 2 or 3, got 5"):
        load_run_config(_write(tmp_path), ["deepspeed.zero_stage=5"])


def test_batch_arithmetic(tmp_path):
    with pytest.raises(ConfigError, match=r"2 x 2 x 2 = 8 != train_batch_size = 6"):
        load_run_config(_write(tmp_path), ["deepspeed.train_batch_size=6"], world_size=2)
    sizes = solve_batch_sizes(DeepSpeedSection(train_batch_size=12, micro_batch_size_per_gpu=2), 3)
    assert (sizes.global_batch, sizes.micro_batch, sizes.accumulation) == (12, 2, 2)
    with pytest.raises(ValueError, match="not divisible"):
        solve_batch_sizes(DeepSpeedSection(train_batch_size=10, micro_batch_size_per_gpu=4), 2)
    with pytest.raises(ValueError, match="both are null"):
        solve_batch_sizes(DeepSpeedSection(), 2)


def test_impossible_factorization(tmp_path):
    with pytest.raises(ConfigError, match=r"comera\.tensorize\.modes\.attention: modes \[4, 2\] x \[4, 4\]"):
        load_run_config(_write(tmp_path), ["comera.tensorize.modes={attention: [[4, 2], [4, 4]]}"])
    with pytest.raises(ConfigError, match=r"dimension 17 has no factorization into 2 modes"):
        load_run_config(_write(tmp_path), ["model.intermediate_size=17"])


def test_seq_len_beyond_positions(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.seq_len=32 exceeds model\.max_positions=16"):
        load_run_config(_write(tmp_path), ["data.seq_len=32"])
    with pytest.raises(ConfigError, match=r"data\.seq_len=17 exceeds model\.max_positions=16"):
        load_run_config(_write(tmp_path), ["data.seq_len=17"])
    assert load_run_config(_write(tmp_path), ["data.seq_len=16"]).data.seq_len == 16  # every position used


@pytest.mark.parametrize("setting, message", [
    ("train.steps=0", "train.steps must be >= 1, got 0"),
    ("train.eval_batches=0", "train.eval_batches must be >= 1, got 0"),
    ("train.output_dir=''", "train.output_dir must be a non-empty path, got ''"),
    ("train.resume=''", "train.resume must be 'auto', 'none' or a checkpoint path, got ''"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage must be 0, 1, 2 or 3, got 4"),
    ("deepspeed.adam_betas=[0.9, 0.99, 0.999]",
     "deepspeed.adam_betas must be two numbers in [0, 1), got [0.9, 0.99, 0.999]"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1, got 0"),
    ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps must be >= 1, got 0"),
    ("train.log_every=0", "train.log_every must be >= 1, got 0"),
    ("train.checkpoint_every=-1", "train.checkpoint_every must be >= 0, got -1"),
    ("train.process_group_timeout_s=0", "train.process_group_timeout_s must be > 0, got 0"),
    ("deepspeed.scheduler.warmup_steps=-1", "deepspeed.scheduler.warmup_steps must be >= 0, got -1"),
    ("deepspeed.scheduler.warmup_min_ratio=1.5", "deepspeed.scheduler.warmup_min_ratio must be in [0, 1], got 1.5"),
    ("deepspeed.scheduler.min_ratio=-0.1", "deepspeed.scheduler.min_ratio must be in [0, 1], got -0.1"),
    ("comera.tensorize.max_rank=0", "comera.tensorize.max_rank must be >= 1, got 0"),
    ("comera.pruning.min_rank=0", "comera.pruning.min_rank must be >= 1, got 0"),
    ("deepspeed.adam_betas=[0.9, 1.0]", "deepspeed.adam_betas must be two numbers in [0, 1), got [0.9, 1.0]"),
    ("deepspeed.adam_eps=0", "deepspeed.adam_eps must be > 0, got 0"),
    ("deepspeed.gradient_clipping=-1", "deepspeed.gradient_clipping must be >= 0, got -1"),
    ("deepspeed.stage3_param_persistence_threshold=-1",
     "deepspeed.stage3_param_persistence_threshold must be >= 0, got -1"),
    ("deepspeed.micro_batch_size_per_gpu=0", "deepspeed.micro_batch_size_per_gpu must be >= 1 or null, got 0"),
])
def test_out_of_range_values_name_their_key(tmp_path, setting, message):
    """By its full dotted key, once: a section's check names its key from the section (``scheduler.warmup_steps``),
    and the message said the section twice (``deepspeed.scheduler: scheduler.warmup_steps ...``)."""
    with pytest.raises(ConfigError) as e:
        load_run_config(_write(tmp_path), [setting])
    assert f"--set {setting}: {message}" in str(e.value), str(e.value)


def test_compile_is_refused_at_zero3(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.compile=true needs deepspeed\.zero_stage 0, 1 or 2 \(got 3\)"):
        load_run_config(_write(tmp_path), ["train.compile=true", "deepspeed.zero_stage=3"])
    assert load_run_config(_write(tmp_path), ["train.compile=true", "deepspeed.zero_stage=2"]).train.compile


@pytest.mark.parametrize("without", ["comera.enabled=false", "comera.tensorize.embedding=false"])
def test_an_embedding_threshold_without_a_tt_embedding_is_refused(tmp_path, without):
    with pytest.raises(ConfigError, match=rf"comera\.controller\.embedding_tau=0\.2 would change nothing: the model "
                                          rf"has no TT embedding \(.*{without.replace('.', '[.]')}"):
        load_run_config(_write(tmp_path), ["comera.controller.embedding_tau=0.2", without])
    assert load_run_config(_write(tmp_path), ["comera.controller.embedding_tau=0.2"]).comera.controller.embedding_tau == 0.2


@pytest.mark.parametrize(("sets", "got"), [(["deepspeed.zero_stage=1"], "train.compile=false, deepspeed.zero_stage=1"),
                                           (["train.compile=true", "deepspeed.zero_stage=0"],
                                            "train.compile=true, deepspeed.zero_stage=0")])
def test_compile_optimizer_needs_compile_and_a_zero_optimizer(tmp_path, sets, got):
    with pytest.raises(ConfigError, match=rf"train\.compile_optimizer=true needs train\.compile=true and "
                                          rf"deepspeed\.zero_stage 1 or 2 \(got {got}\)"):
        load_run_config(_write(tmp_path), ["train.compile_optimizer=true", *sets])
    ok = load_run_config(_write(tmp_path), ["train.compile_optimizer=true", "train.compile=true", "deepspeed.zero_stage=2"])
    assert ok.train.compile_optimizer


@pytest.mark.parametrize("key", ["first_scrape_timeout_s", "final_scrape_timeout_s"])
def test_a_scrape_wait_must_end_before_the_process_group_timeout(tmp_path, key):
    with pytest.raises(ConfigError, match=rf"metrics\.{key}=60\.0 must be below train\.process_group_timeout_s=60\.0"):
        load_run_config(_write(tmp_path), [f"metrics.{key}=60.0"])
    assert getattr(load_run_config(_write(tmp_path), [f"metrics.{key}=59.0"]).metrics, key) == 59.0
    # nothing waits without the exporter, and a longer timeout allows a longer wait
    load_run_config(_write(tmp_path), [f"metrics.{key}=90.0", "metrics.prometheus=false"])
    load_run_config(_write(tmp_path), [f"metrics.{key}=90.0", "train.process_group_timeout_s=120"])


def test_deepspeed_json_is_generated():
    section = DeepSpeedSection(zero_stage=3, micro_batch_size_per_gpu=2, precision="bf16",
                               stage3_param_persistence_threshold=0)
    ds = to_deepspeed_dict(section, 2, total_steps=10, group_lrs=[1e-4, 1e-3], weight_decay=0.0)
    assert ds["train_batch_size"] == 4 and ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["weight_decay"] == 0.0
    assert ds["scheduler"]["params"]["warmup_max_lr"] == [1e-4, 1e-3]
    assert ds["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}  # no device syncs per step


@pytest.mark.parametrize("kind", ["warmup_decay", "warmup_cosine"])
def test_a_schedule_without_warmup_gives_deepspeed_one_step(kind):
    """DeepSpeed's warmup schedulers refuse ``warmup_num_steps`` 0 (``WarmupCosineLR`` raises), so the default
    ``warmup_steps: 0`` becomes 1; a longer warmup is passed as configured."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from comera_dist.engine.config import SchedulerConfig

    def params(warmup: int) -> dict:
        section = DeepSpeedSection(micro_batch_size_per_gpu=1, scheduler=SchedulerConfig(kind=kind, warmup_steps=warmup))
        return to_deepspeed_dict(section, 1, total_steps=5, group_lrs=[1e-3])["scheduler"]["params"]

    assert params(0)["warmup_num_steps"] == 1 and params(3)["warmup_num_steps"] == 3
    with pytest.raises(ValueError):  # why: the raw 0 would stop the run at its engine's creation
        WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1e-3), total_num_steps=5,
                       warmup_num_steps=0)


def test_the_warmup_starts_at_each_groups_own_fraction():
    from comera_dist.engine.config import SchedulerConfig

    section = DeepSpeedSection(micro_batch_size_per_gpu=1, scheduler=SchedulerConfig(warmup_steps=2, warmup_min_ratio=0.1))
    params = to_deepspeed_dict(section, 1, total_steps=5, group_lrs=[1e-4, 1e-3])["scheduler"]["params"]
    assert params["warmup_min_lr"] == pytest.approx([1e-5, 1e-4]) and params["warmup_max_lr"] == [1e-4, 1e-3]


def test_a_float_written_as_yaml_reads_a_string_is_taken(tmp_path):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; a float key takes it. Words stay refused, ``nan`` too."""
    lr = load_run_config(_write(tmp_path), ["comera.lr.cores=1e-3", "comera.lr.gates=2E-2"]).comera.lr
    assert (lr.cores, lr.gates) == (1e-3, 0.02)
    for word in ("fast", "nan", "inf"):
        with pytest.raises(ConfigError, match=rf"comera\.lr\.cores: expected a number, got str \('{word}'\)"):
            load_run_config(_write(tmp_path), [f"comera.lr.cores={word}"])
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer, got str \('1e3'\)"):
        load_run_config(_write(tmp_path), ["train.steps=1e3"])  # an integer key is not a float's


@pytest.mark.parametrize(("sets", "bounds"), [
    ([], "comera.tensorize.max_rank=4 and comera.tensorize.embedding_max_rank=4"),
    (["comera.tensorize.embedding=false"], "comera.tensorize.max_rank=4,"),
    (["comera.tensorize.attention=false", "comera.tensorize.ffn=false"], "comera.tensorize.embedding_max_rank=4,")])
def test_a_prune_floor_at_every_bonds_cap_is_refused(tmp_path, sets, bounds):
    """A bond has at most its kind's max_rank ranks and keeps min_rank of them: prunes would slice nothing."""
    caps = ["comera.tensorize.max_rank=4", "comera.tensorize.embedding_max_rank=4", "comera.pruning.every=5"]
    with pytest.raises(ConfigError, match=rf"comera\.pruning\.min_rank=4 would prune nothing: no bond has more "
                                          rf"ranks than {re.escape(bounds)}"):
        load_run_config(_write(tmp_path), [*caps, *sets, "comera.pruning.min_rank=4"])
    load_run_config(_write(tmp_path), [*caps, *sets, "comera.pruning.min_rank=3"])
    load_run_config(_write(tmp_path), [*caps, *sets, "comera.pruning.min_rank=4", "comera.pruning.every=0"])
    # one kind still prunable is enough: the embedding's cap above the floor
    load_run_config(_write(tmp_path), [*caps, "comera.tensorize.embedding_max_rank=5", "comera.pruning.min_rank=4"])


@pytest.mark.parametrize(("sets", "warned"), [
    (["train.steps=20", "deepspeed.scheduler.warmup_steps=30", "deepspeed.scheduler.warmup_min_ratio=0.1"],
     ("deepspeed.scheduler.warmup_steps=30 exceeds train.steps=20: the learning rate rises for the whole run, to "
     "about 70% of its peak, and never decays (warmup_decay)")),
    (["train.steps=20", "deepspeed.scheduler.warmup_steps=20"], None),
    (["train.steps=20", "deepspeed.scheduler.warmup_steps=30", "deepspeed.scheduler.kind=constant"], None)])
def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, sets, warned):
    from comera_dist.config import run_warnings

    assert run_warnings(load_run_config(_write(tmp_path), sets)) == ([warned] if warned else [])

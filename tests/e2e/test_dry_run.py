"""``comera pretrain --dry-run [--json]``: the paper's six-encoder sizes, the resolved DeepSpeed JSON,
``--help`` coverage, and config errors as one stderr line with exit status 2 (all in-process, fast)."""

from __future__ import annotations

import json

import pytest

from comera_dist import cli


def _dry_run(capsys, *args: str) -> dict:
    rc = cli.main(["pretrain", "--config", "configs/six-encoder.yaml", "--dry-run", "--json", *args])
    captured = capsys.readouterr()
    # the paper's six-encoder is a classifier: its sizes are shown, and pretrain would refuse it (exit 2)
    assert rc == 2 and captured.err.count("\n") == 1, captured.err
    assert "model.arch=six_encoder_cls is not pretrained" in captured.err and "inspection only" in captured.err
    return json.loads(captured.out)


def test_six_encoder_dry_run_sizes(capsys):
    s = _dry_run(capsys, "--world-size", "8")
    kinds = s["tt_params_by_kind"]
    # comera-method.md section 6: TTM embedding [16,20,10,10]x[4,4,8,6] at rank 32; Q/K/V/out
    # [12,8,8]x[8,8,12] and the FFNs at rank 30 (ranks capped by the mode products).
    assert kinds["embedding"]["active_params_each"] == [167_808]
    assert kinds["embedding"]["dense_params"] == 30522 * 768
    assert kinds["attention"]["count"] == 24 and set(kinds["attention"]["active_params_each"]) == {20_448}
    assert kinds["ffn_in"]["count"] == 6 and set(kinds["ffn_in"]["active_params_each"]) == {28_960}
    assert kinds["ffn_out"]["count"] == 6 and set(kinds["ffn_out"]["active_params_each"]) == {28_960}
    assert s["encoder_tt_params"] == 838_272
    assert s["encoder_dense_params"] == 42_467_328
    ratio = s["encoder_dense_params"] / s["encoder_tt_params"]
    assert round(ratio, 1) == 50.7
    assert s["compression"]["ratio_model"] > 40
    assert s["flops_per_token"]["forward"] < s["flops_per_token"]["forward_dense"] / 10


def test_dry_run_counts_the_recomputed_blocks_in_the_training_flops(capsys):
    plain = _dry_run(capsys)["flops_per_token"]
    f = _dry_run(capsys, "--set", "model.activation_checkpointing=true")["flops_per_token"]
    assert plain["recomputed"] == 0 and plain["train"] == 3 * plain["forward"]
    # the blocks' forward (TT projections and attention products) once more; embedding, pooler, head not
    assert f["forward"] == plain["forward"] and 0 < f["recomputed"] < f["forward"]
    assert f["train"] == 3 * f["forward"] + f["recomputed"]
    attn = 4 * 128 * 768 * 6  # score and value products, seq 128, d 768, 6 blocks
    assert f["recomputed"] > attn


def test_dry_run_resolves_deepspeed_for_world_size(capsys):
    s = _dry_run(capsys, "--world-size", "8")
    ds = s["deepspeed"]
    assert ds["train_batch_size"] == 256 and ds["train_micro_batch_size_per_gpu"] == 32
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert ds["optimizer"]["params"]["torch_adam"] is True
    # Same config on 2 ranks: the accumulation absorbs the difference.
    assert _dry_run(capsys, "--world-size", "2")["deepspeed"]["gradient_accumulation_steps"] == 4
    assert s["config"]["comera"]["tensorize"]["max_rank"] == 30


def test_dry_run_human_readable(capsys):
    rc = cli.main(["pretrain", "--config", "configs/six-encoder.yaml", "--dry-run", "--world-size", "8"])
    out = capsys.readouterr().out
    assert rc == 2  # a classifier: shown, not pretrained (test_six_encoder_dry_run_sizes)
    assert "encoder TT params 838,272 vs dense 42,467,328" in out
    rc = cli.main(["pretrain", "--config", "configs/six-encoder-mlm.yaml", "--dry-run", "--world-size", "8"])
    assert rc == 0 and "encoder TT params" in capsys.readouterr().out
    assert '"train_batch_size": 256' in out
    for extra, says in (([], "recomputed (+"), (["--set", "model.recompute_factors=true"], "TT factors remade in it")):
        rc = cli.main(["pretrain", "--config", "configs/six-encoder-mlm.yaml", "--dry-run", "--set",
                       "model.activation_checkpointing=true", *extra])
        flops = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("FLOPs/token"))
        assert rc == 0 and says in flops and ("remade" in flops) == bool(extra), flops


@pytest.mark.parametrize("args", [["pretrain"], ["evaluate"], ["export"]])
def test_help_explains_every_option(args, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[args[0]]
    for action in sub._actions:
        assert action.help, f"{args[0]} option {action.option_strings} has no help text"
        for opt in action.option_strings:
            assert opt in out
    if args == ["pretrain"]:  # the exit statuses a Slurm script branches on, as the trainer returns them
        from comera_dist.engine import trainer

        for code in (trainer.EXIT_OK, cli.EXIT_BAD_INPUT, trainer.EXIT_NONFINITE, trainer.EXIT_COLLAPSED):
            assert f"\n  {code}  " in out, out


@pytest.mark.parametrize(("args", "needle"), [
    (["--config", "configs/no-such.yaml"], "config file not found: configs/no-such.yaml"),
    (["--config", "configs"], "config configs is a directory, not a YAML file; it holds codebert-tiny-cpu.yaml, "),
    (["--config", "configs/tiny-cpu.yaml", "--set", "train.stepz=3"],
     "configs/tiny-cpu.yaml with --set train.stepz=3 train.output_dir="),
    (["--config", "configs/tiny-cpu.yaml", "--set", "train.stepz=3"], "did you mean 'steps'"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "train.steps=many"], "train.steps"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "data.seq_len=4096"], "data.seq_len=4096"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "train.data_build_timeout_s=0"],
     "train.data_build_timeout_s must be > 0, got 0"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "comera.tensorize.modes.attention=[[4,4],[4,4]]"],
     "comera.tensorize.modes.attention"),
    (["--config", "configs/tiny-cpu.yaml", "--world-size", "3", "--set", "deepspeed.train_batch_size=8"],
     "train_batch_size"),
    # the validation pass is shared among the ranks: one block per rank at least, or a rank's shard is empty
    (["--config", "configs/tiny-cpu.yaml", "--world-size", "2", "--set", "train.eval_batches=1",
      "--set", "deepspeed.micro_batch_size_per_gpu=1", "--set", "deepspeed.gradient_accumulation_steps=1",
      "--set", "deepspeed.train_batch_size=null"],
     "train.eval_batches=1 x micro_batch_size_per_gpu=1 = 1 validation blocks, fewer than the world size 2"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "model.recompute_factors=true"],
     "model.recompute_factors needs model.activation_checkpointing: true"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "model.vocab_size=128", "--set", "data.tokenizer.vocab_size=128"],
     "tokenizer.vocab_size must be >= 261 for kind bpe (its 256 byte tokens and 5 special tokens), got 128"),
    # YAML drops " #..." as a comment: the run read another directory than the one named
    (["--config", "configs/tiny-cpu.yaml", "--set", "train.resume=/tmp/runs/a #1"],
     "override train.resume: YAML reads '/tmp/runs/a #1' as '/tmp/runs/a', the rest being a comment"),
])
def test_bad_config_is_one_line_exit_2(args, needle, capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc = cli.main(["pretrain", *args, "--set", f"train.output_dir={out_dir}", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("comera pretrain: error: ")
    assert not out_dir.exists()


@pytest.mark.parametrize("mode", ["--dry-run", "--check-config"])
def test_a_config_that_is_no_text_is_one_line_exit_2(mode, capsys, tmp_path):
    """A binary file (a plot beside the config, say) raised UnicodeDecodeError: a traceback and exit 1."""
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    rc = cli.main(["pretrain", "--config", str(png), mode])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert err.startswith(f"comera pretrain: error: {png}: not a UTF-8 text file (invalid start byte at byte 0)"), err


def test_a_quoted_override_keeps_its_hash():
    from comera_dist.config import apply_overrides

    assert apply_overrides({}, ['train.output_dir="/tmp/run #1"', "train.steps=5 "]) == {
        "train": {"output_dir": "/tmp/run #1", "steps": 5}}


_BAD_SETTINGS = [
    ("COMERA_KERNELS", "bogus", "COMERA_KERNELS='bogus' is not one of ['auto', 'torch', 'triton']"),
    ("COMERA_RANK_ALIGN", "abc", "COMERA_RANK_ALIGN='abc' must be a positive integer"),
    ("COMERA_FFN_ROWS", "-3", "COMERA_FFN_ROWS must be auto, off, all or a positive row count, got '-3'"),
]


# a training rank reads WORLD_SIZE from its launcher (engine.distributed); a dry run reads it for the batch arithmetic
@pytest.mark.parametrize(("var", "value", "needle", "mode"), [
    *[(*case, mode) for case in _BAD_SETTINGS for mode in ("--dry-run", "--check-config", None)],
    ("WORLD_SIZE", "abc", "WORLD_SIZE='abc' (environment) must be a positive integer", "--dry-run"),
])
def test_a_bad_environment_setting_is_one_line_exit_2(var, value, needle, mode, capsys, tmp_path, monkeypatch):
    """Checked before anything starts, by a dry run and a config check too (they were a traceback at the first
    step, exit 1)."""
    monkeypatch.setenv(var, value)
    out_dir = tmp_path / "run"
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out_dir}",
                   *([mode] if mode else [])])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT and needle in err, err
    assert err.count("\n") == 1 and err.startswith("comera pretrain: error: ")
    assert not out_dir.exists()


# valid for the job it was written for (4 nodes x 8 ranks: 32 x 2 x 32 = 2048), refused at any other world size
_SIZED_FOR_32 = ["--config", "configs/codebert.yaml", "--set", "deepspeed.gradient_accumulation_steps=2"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--config", "configs/tiny-cpu.yaml", "--set", "train.stepz=3"], "did you mean 'steps'"),
    (["--config", "configs/six-encoder.yaml"], "model.arch=six_encoder_cls is not pretrained"),
    ([*_SIZED_FOR_32, "--set", "model.recompute_factors=true"], "model.recompute_factors needs"),
    # the local inputs the run reads once its ranks are up
    (["--config", "configs/tiny-cpu.yaml", "--set", "data.source=files", "--set", "data.files=[/no/such/corpus]"],
     "data.files: no such file or directory: /no/such/corpus"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "data.source=files", "--set", "data.files=[pyproject.toml]"],
     "data.builder: cannot infer a builder for extensions ['.toml']"),
    (["--config", "configs/tiny-cpu.yaml", "--set", "data.tokenizer.pretrained=/no/such/tok"],
     "data.tokenizer.pretrained: no such directory: /no/such/tok"),
    (["--config", "configs/tiny-cpu.yaml", "--resume", "/no/such/run"],
     "train.resume=/no/such/run: no such checkpoint or run directory"),
])
def test_check_config_refuses_what_pretrain_would_in_one_line(args, needle, capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc = cli.main(["pretrain", *args, "--set", f"train.output_dir={out_dir}", "--check-config"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT and needle in err, err
    assert err.count("\n") == 1 and err.startswith("comera pretrain: error: ")
    assert not out_dir.exists()


def test_check_config_refuses_a_vocabulary_below_the_tokenizers(capsys, tmp_path):
    """The run refused it at its start, after a queue wait; the configured vocabulary bounds it already."""
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", "model.vocab_size=256", "--set",
                   f"train.output_dir={tmp_path / 'run'}", "--check-config"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert "model vocab_size=256 is smaller than data.tokenizer.vocab_size=512" in err


@pytest.mark.parametrize("key, under", [("train.output_dir", "sub"), ("train.output_dir", ""), ("data.cache_dir", "")])
@pytest.mark.parametrize("mode", ["--check-config", "--dry-run"])
def test_a_directory_that_is_a_file_is_one_line_exit_2(key, under, mode, capsys, tmp_path):
    """It was a FileExistsError traceback (exit 1) at the run's first write, on every rank."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    path = afile / under if under else afile
    sets = ["--set", f"{key}={path}"] + ([] if key == "train.output_dir" else ["--set", f"train.output_dir={tmp_path}"])
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", *sets, mode])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT and f"{key}={path}: {afile} is a file, not a directory" in err, err
    assert afile.read_text() == "not a directory"


@pytest.mark.parametrize(("args", "needle"), [
    (["--json"], "--json: only with --dry-run or --check-config"),
    (["--world-size", "3"], "--world-size: only with --dry-run"),
    (["--json", "--world-size", "3", "--check-config"], "--world-size: only with --dry-run"),
    (["--dry-run", "--check-config"], "--dry-run and --check-config are two checks"),
])
def test_dry_run_options_without_a_dry_run_are_refused(args, needle, capsys, tmp_path):
    """``--json`` or ``--world-size`` without ``--dry-run`` started a training run (or a check passed that the job's
    world size fails), the option dropped."""
    out_dir = tmp_path / "run"
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out_dir}", *args])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT and needle in err and err.count("\n") == 1, err
    assert not out_dir.exists()


@pytest.mark.parametrize("path", ["/tmp/ck #1", "2024", "run: 3", "auto"])
def test_resume_takes_its_path_as_written(path):
    """``--resume`` went into the config as YAML: ``#1`` was a comment and ``2024`` a number."""
    from comera_dist.config import load_run_config

    args = cli.build_parser().parse_args(["pretrain", "--config", "configs/tiny-cpu.yaml", "--resume", path])
    assert load_run_config(args.config, cli._overrides(args)).train.resume == path


def test_check_config_leaves_the_batch_arithmetic_to_the_world_size(capsys, tmp_path, monkeypatch):
    """``slurm/pretrain.sh --dry-run`` outside an allocation: the config is checked, the batch is not (the node
    count is sbatch's, still to come), where a dry run at the default world size refuses it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = ["--set", f"train.output_dir={tmp_path / 'run'}"]
    assert cli.main(["pretrain", *_SIZED_FOR_32, *out, "--check-config"]) == 0
    assert "config accepted" in capsys.readouterr().out
    assert cli.main(["pretrain", *_SIZED_FOR_32, *out, "--dry-run"]) == cli.EXIT_BAD_INPUT
    assert "train_batch_size" in capsys.readouterr().err
    assert cli.main(["pretrain", *_SIZED_FOR_32, *out, "--dry-run", "--world-size", "32"]) == 0
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", [["--check-config"], ["--dry-run", "--json"]])
def test_a_warmup_longer_than_the_run_is_taken_and_said(mode, capsys, tmp_path):
    """A smoke run's --set train.steps=20 on a config with 1000 warmup steps: accepted, with one warning line on
    stderr (a dry run's JSON on stdout stays one object)."""
    rc = cli.main(["pretrain", "--config", "configs/six-encoder-mlm.yaml", "--set", "train.steps=20", "--set",
                   f"train.output_dir={tmp_path / 'run'}", *mode])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == ("comera pretrain: warning: deepspeed.scheduler.warmup_steps=1000 exceeds train.steps=20: "
                            "the learning rate rises for the whole run, to about 2% of its peak, and never decays "
                            "(warmup_decay)\n"), captured.err
    if "--json" in mode:
        assert json.loads(captured.out)["config"]["train"]["steps"] == 20


def test_a_dry_run_names_a_missing_input_after_its_summary(capsys, tmp_path):
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={tmp_path / 'run'}",
                   "--resume", str(tmp_path / "gone"), "--dry-run", "--json"])
    captured = capsys.readouterr()
    assert rc == cli.EXIT_BAD_INPUT and captured.err.count("\n") == 1, captured.err
    assert f"train.resume={tmp_path / 'gone'}: no such checkpoint" in captured.err and "inspection only" in captured.err
    assert json.loads(captured.out)["config"]["train"]["resume"] == str(tmp_path / "gone")


def test_check_config_takes_existing_local_inputs(capsys, tmp_path):
    """A resume path is checked against the config (``test_check_config_resume.py``)."""
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", "data.source=files", "--set",
                   "data.files=[comera_dist/*.py]", "--set", f"train.output_dir={tmp_path / 'run'}", "--check-config"])
    assert rc == 0, capsys.readouterr().err


def test_a_requeued_job_is_not_refused_for_a_resume_path_retention_deleted(capsys, tmp_path, monkeypatch):
    """slurm/pretrain.sh checks at every start; a requeued job resumes its own newest checkpoint instead."""
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    rc = cli.main(["pretrain", "--config", "configs/tiny-cpu.yaml", "--resume", str(tmp_path / "deleted"),
                   "--check-config"])
    assert rc == 0, capsys.readouterr().err

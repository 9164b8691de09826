"""``comera evaluate``/``export`` refuse bad input before reading any weights, and a refused checkpoint's error
names the newest other one that verifies. No DeepSpeed here: the checkpoints are hand-made files with a real
manifest, which is all that ``checkpoint.check`` and the ``weights_only`` gate read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_testlib import CodeRunningPayload, revouch

from comera_dist.config import load_run_config, resolved_dict
from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine.errors import InputError
from comera_dist.engine.evaluate import evaluate_checkpoint, export_checkpoint, load_run
from comera_dist.engine.model_factory import build_run_model

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(root: Path, step: int, shard: object, *, meta: str = "{}", config: dict | None = None) -> Path:
    path = root / ckpt.tag_for(step)
    path.mkdir(parents=True)
    (path / ckpt.META).write_text(meta)
    if config is not None:
        (path / ckpt.CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    torch.save(shard, path / "mp_rank_00_model_states.pt")
    revouch(path)
    return path


@pytest.mark.parametrize(("kwargs", "needle"), [({"batch_size": 0}, "--batch-size must be >= 1, got 0"),
                                                ({"max_batches": 0}, "--max-batches must be >= 1")])
def test_evaluate_names_a_bad_flag_before_the_checkpoint(tmp_path, kwargs, needle):
    with pytest.raises(InputError, match=needle):
        evaluate_checkpoint(tmp_path / "absent", [str(tmp_path)], **kwargs)


def test_export_names_a_bad_format_and_a_taken_out_before_the_checkpoint(tmp_path):
    with pytest.raises(InputError, match=r"--format 'onnx' is not one of dense-hf, tt, consolidated"):
        export_checkpoint(tmp_path / "absent", tmp_path / "out", fmt="onnx")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("kept")
    with pytest.raises(InputError, match="--out .*taken: exists and is not an empty directory"):
        export_checkpoint(tmp_path / "absent", tmp_path / "taken")


def test_a_refused_checkpoint_names_the_newest_other_one_that_verifies(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _checkpoint(root, 1, {"w": torch.ones(2)})
    good = _checkpoint(root, 2, {"w": torch.ones(2)})
    corrupted = _checkpoint(root, 4, {"w": torch.ones(2)})
    torch.save({"w": torch.zeros(2)}, corrupted / "mp_rank_00_model_states.pt")  # same size, other digest
    flag = tmp_path / "code-ran"
    refused = _checkpoint(root, 6, {"w": torch.ones(2), "evil": CodeRunningPayload(flag)})  # verifies; the gate refuses it
    with pytest.raises(InputError) as e:
        load_run(refused)
    assert not flag.exists(), "load_run unpickled the payload"
    msg = str(e.value)
    assert f"checkpoint {refused} is refused" in msg and "does not load with weights_only=True" in msg, msg
    assert msg.endswith(f"the newest checkpoint there that verifies is {good}: pass --checkpoint {good} to use it"), msg


def _zero0_checkpoint(tmp_path: Path, edit) -> tuple[Path, torch.nn.Module]:
    """A ZeRO-0 checkpoint of tiny-cpu (the whole module in one file, so no DeepSpeed is needed to write it)
    whose module state went through ``edit``, and the model it was taken from."""
    cfg = load_run_config(REPO / "configs" / "tiny-cpu.yaml",
                          ["deepspeed.zero_stage=0", f"train.output_dir={tmp_path / 'run'}"])
    model = build_run_model(cfg)
    state = dict(model.state_dict())
    edit(state)
    path = _checkpoint(tmp_path / "run" / "checkpoints", 2, {"module": state}, meta='{"zero_stage": 0}',
                       config=resolved_dict(cfg))
    return path, model


@pytest.mark.parametrize("change", ["a weight missing", "a weight unexpected"])
def test_weights_that_do_not_fit_the_saved_config_are_refused_naming_the_key(tmp_path, change):
    """A checkpoint whose shard lacks one of its config's weights, or holds one the model has not, would load
    with the model's random init (or drop the extra) silently: ``load_run`` names the key."""
    missing, extra = "embeddings.word.core", "head.extra.weight"
    if change == "a weight missing":
        path, _ = _zero0_checkpoint(tmp_path, lambda state: state.pop(missing))
    else:
        path, _ = _zero0_checkpoint(tmp_path, lambda state: state.update({extra: torch.zeros(2)}))
    with pytest.raises(InputError, match=f"checkpoint {path} does not match its config's model: ") as e:
        load_run(path)
    assert (f"missing ['{missing}']" if change == "a weight missing" else f"unexpected ['{extra}']") in str(e.value)


def test_a_checkpoint_loads_for_evaluation_whatever_metrics_its_run_configured(tmp_path):
    """The saved config's ``metrics`` section is the training run's outputs: a key renamed or removed since
    must not make the checkpoint unreadable. The model comes back in eval mode (dropout off)."""
    path, model = _zero0_checkpoint(tmp_path, lambda state: None)
    saved = yaml.safe_load((path / ckpt.CONFIG).read_text())
    saved["metrics"]["grafana_panel"] = "compression"  # a key this version does not know
    (path / ckpt.CONFIG).write_text(yaml.safe_dump(saved, sort_keys=False))
    revouch(path)
    run = load_run(path)
    assert not run.model.training and not any(m.training for m in run.model.modules())
    assert torch.equal(run.model.get_parameter("blocks.0.attn.query.core"), model.get_parameter("blocks.0.attn.query.core"))


def test_a_checkpoint_with_an_unreadable_config_or_no_model_file_is_named(tmp_path):
    path, _ = _zero0_checkpoint(tmp_path, lambda state: None)
    (path / ckpt.CONFIG).write_text("model: [unclosed\n")
    revouch(path)
    with pytest.raises(InputError, match=f"checkpoint {path}: while parsing"):
        load_run(path)
    path, _ = _zero0_checkpoint(tmp_path / "second", lambda state: None)
    (path / "mp_rank_00_model_states.pt").rename(path / "model_states.pt.bak")
    revouch(path)
    with pytest.raises(InputError, match=f"checkpoint {path}: no mp_rank_\\*_model_states.pt"):
        load_run(path)


@pytest.mark.parametrize("edit", ["binary", "unknown-key"])
def test_a_config_yaml_changed_after_the_save_is_named_before_it_is_read(tmp_path, edit):
    """Damaged (a traceback, exit 1) or edited by hand ("unknown config key", naming no file): both read the
    config before anything checked it against the manifest."""
    path, _ = _zero0_checkpoint(tmp_path, lambda state: None)
    if edit == "binary":
        (path / ckpt.CONFIG).write_bytes(b"\x89PNG\r\n\x1a\n")
    else:
        saved = yaml.safe_load((path / ckpt.CONFIG).read_text())
        saved["train"]["new_knob"] = 1
        (path / ckpt.CONFIG).write_text(yaml.safe_dump(saved, sort_keys=False))
    said = f"checkpoint {path} fails verification: {path / ckpt.CONFIG}: "
    for call in (lambda: evaluate_checkpoint(path, [str(tmp_path)]), lambda: export_checkpoint(path, tmp_path / "x"),
                 lambda: load_run(path)):
        with pytest.raises(InputError) as e:
            call()
        assert str(e.value).startswith(said) and "no other checkpoint" in str(e.value), e.value
    assert not (tmp_path / "x").exists()


def test_a_bad_config_yaml_the_manifest_vouches_for_is_named_with_its_file(tmp_path):
    """A checkpoint whose manifest was written over such a config (or a pre-manifest one)."""
    path, _ = _zero0_checkpoint(tmp_path, lambda state: None)
    (path / ckpt.CONFIG).write_bytes(b"\x89PNG\r\n\x1a\n")
    revouch(path)
    with pytest.raises(InputError, match=f"checkpoint {path}: 'utf-8' codec can't decode byte 0x89"):
        load_run(path)
    path, _ = _zero0_checkpoint(tmp_path / "second", lambda state: None)
    config = yaml.safe_load((path / ckpt.CONFIG).read_text())
    config["train"]["new_knob"] = 1
    (path / ckpt.CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    revouch(path)
    with pytest.raises(InputError, match=f"checkpoint {path}: its config.yaml: unknown config key 'train.new_knob'"):
        load_run(path)


def test_a_file_given_as_the_checkpoint_is_named_a_file(tmp_path):
    (tmp_path / "shard.pt").write_bytes(b"x")
    with pytest.raises(InputError, match="shard.pt: a file, not a directory: give the run directory"):
        load_run(tmp_path / "shard.pt")
    with pytest.raises(InputError, match="absent: no such directory"):
        load_run(tmp_path / "absent")


def test_a_checkpoint_without_a_buffer_loads_it_from_the_config(tmp_path):
    """The buffers (a layer's threshold ``tau``, its bond sizes) follow from the config and the prune plans the
    model is rebuilt with: a checkpoint written before one existed still loads, with the rebuilt model's."""
    path, model = _zero0_checkpoint(tmp_path, lambda state: state.pop("blocks.0.attn.query.tau"))
    run = load_run(path)
    assert torch.equal(run.model.get_buffer("blocks.0.attn.query.tau"), model.get_buffer("blocks.0.attn.query.tau"))
    assert torch.equal(run.model.get_parameter("blocks.0.attn.query.core"),
                       model.get_parameter("blocks.0.attn.query.core"))

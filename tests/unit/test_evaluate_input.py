"""``comera evaluate``/``export`` refuse bad input before reading any weights, and a refused checkpoint's error
names the newest other one that verifies. No DeepSpeed here: the checkpoints are hand-made files with a real
manifest, which is all that ``checkpoint.check`` and the ``weights_only`` gate read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_testlib import CodeRunningPayload, revouch

from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine.errors import InputError
from comera_dist.engine.evaluate import evaluate_checkpoint, export_checkpoint, load_run


def _checkpoint(root: Path, step: int, shard: object) -> Path:
    path = root / ckpt.tag_for(step)
    path.mkdir(parents=True)
    (path / ckpt.META).write_text("{}")
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

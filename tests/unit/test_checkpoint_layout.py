"""``engine.checkpoint_layout`` on hand-made checkpoint directories (its marker and meta files only): which
checkpoint a resume finds, what a crash between a re-save's renames leaves published, a requeued job's resume
spec, and the identity a checkpoint must share with the run loading it.

No torch or DeepSpeed here, as in the module; the real ``save`` writes these files in
test_checkpoint_retention.py and test_ckpt_safety_publish.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from comera_dist.config import load_run_config
from comera_dist.engine import checkpoint_layout as layout
from comera_dist.engine.manifest import MARKER


def _complete(path: Path, meta: dict | None = None) -> Path:
    """A directory with what ``is_complete`` looks for: the manifest marker and the side meta."""
    path.mkdir(parents=True)
    (path / MARKER).write_text("{}")
    (path / layout.META).write_text(json.dumps(meta or {}))
    return path


def _at(root: Path, step: int, meta: dict | None = None) -> Path:
    return _complete(root / layout.tag_for(step), meta)


def _point(root: Path, step: int) -> None:
    (root / layout.LATEST).write_text(layout.tag_for(step))


def test_a_checkpoint_without_its_meta_is_not_complete(tmp_path):
    """Its meta is in the manifest: a copy that lost it cannot verify, and ``--check-config`` cannot read it."""
    kept, lost = _at(tmp_path, 3), _at(tmp_path, 6)
    (lost / layout.META).unlink()
    assert not layout.is_complete(lost)
    assert layout.complete_checkpoints(tmp_path) == [kept]


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    """Without a ``latest`` (a crash before its first write, or it was deleted), the newest step leads."""
    for step in (12, 3, 100, 21):
        _at(tmp_path, step)
    assert [layout.step_of(p) for p in layout.complete_checkpoints(tmp_path)] == [3, 12, 21, 100]
    assert layout.latest_complete(tmp_path) == tmp_path / layout.tag_for(100)


def test_the_checkpoint_latest_names_leads_once(tmp_path):
    """``choose`` verifies each candidate in turn: one listed twice would be verified (every shard hashed) twice."""
    for step in (3, 6, 9):
        _at(tmp_path, step)
    _point(tmp_path, 6)
    assert layout.candidates_auto(tmp_path) == [tmp_path / layout.tag_for(s) for s in (6, 9, 3)]


def test_an_unfinished_resave_leaves_the_replaced_copy_to_publish(tmp_path):
    """A re-save of step 6 moved the old copy aside and died before the new one's manifest: the new copy's
    directory has files but no marker. The old, complete copy is what a resume must find, not the torso."""
    _at(tmp_path, 3)
    torso = tmp_path / (layout.TMP_PREFIX + layout.tag_for(6))
    torso.mkdir()
    (torso / "mp_rank_00_model_states.pt").write_bytes(b"half")
    replaced = _complete(tmp_path / f"{layout.TMP_PREFIX}replaced-{layout.tag_for(6)}", {"step": 6})
    _point(tmp_path, 6)
    assert layout.interrupted(tmp_path) == replaced
    assert layout.finish_interrupted(tmp_path) == tmp_path / layout.tag_for(6)
    assert layout.read_meta(tmp_path / layout.tag_for(6)) == {"step": 6}
    assert torso.is_dir() and not replaced.exists()


def test_a_latest_that_names_no_step_publishes_nothing(tmp_path):
    """``latest`` is a file anyone can write; only a step tag's temporary copy is ever renamed."""
    stray = _complete(tmp_path / (layout.TMP_PREFIX + "notes"))
    (tmp_path / layout.LATEST).write_text("notes")
    assert layout.interrupted(tmp_path) is None and layout.finish_interrupted(tmp_path) is None
    assert stray.is_dir() and not (tmp_path / "notes").exists()


def test_a_rank_that_loses_the_publishing_race_takes_the_published_checkpoint(tmp_path, monkeypatch):
    """Every rank runs ``finish_interrupted`` at once: the one whose rename fails because another's won must
    resume that checkpoint, not start over."""
    pending = _complete(tmp_path / (layout.TMP_PREFIX + layout.tag_for(6)))
    _point(tmp_path, 6)
    rename = os.rename

    def another_rank_first(src, dst):
        rename(src, dst)  # the other rank's rename
        raise FileNotFoundError(2, "No such file or directory", str(src))

    monkeypatch.setattr(layout.os, "rename", another_rank_first)
    assert layout.finish_interrupted(tmp_path) == tmp_path / layout.tag_for(6)
    assert not pending.exists()


def test_a_reader_given_a_run_directory_publishes_nothing(tmp_path):
    """``comera evaluate`` on a live run (``finish=False``) takes the newest published checkpoint and leaves a
    crash's pending copy to the job, whose own rename it would race."""
    root = tmp_path / "run" / "checkpoints"
    older = _at(root, 3)
    pending = _complete(root / (layout.TMP_PREFIX + layout.tag_for(6)))
    _point(root, 6)
    assert layout.resolve(str(tmp_path / "run"), root, finish=False) == older
    assert pending.is_dir() and not (root / layout.tag_for(6)).exists()


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_requeue_takes_auto_only_once_its_own_job_has_checkpointed(restarts, tmp_path):
    """Restart count 0 (a first start, or a second ``srun comera pretrain`` in the same allocation, whose job id is
    the same) keeps its spec; a requeue resumes the job's own newest checkpoint, not an older job's."""
    _at(tmp_path, 3, {"slurm_job_id": "5"})
    _at(tmp_path, 6, {"slurm_job_id": "7"})
    _point(tmp_path, 6)
    assert layout.requeued_spec("none", tmp_path, restarts, "7") == ("auto" if restarts else "none")
    assert layout.requeued_spec("none", tmp_path, restarts, "5") == "none"


def test_a_meta_that_is_missing_is_a_checkpoint_error_naming_it(tmp_path):
    (tmp_path / "step00000003").mkdir()
    with pytest.raises(layout.CheckpointError, match=f"cannot read {tmp_path / 'step00000003' / layout.META}"):
        layout.read_meta(tmp_path / "step00000003")


def test_a_key_on_one_side_only_is_a_difference(tmp_path):
    """A checkpoint whose identity lacks a key the config has (or the reverse) was not shown to fit."""
    with pytest.raises(layout.CheckpointError, match=r"model\.hidden_size: checkpoint None vs config 32"):
        layout.check_compatible({"identity": {"model": {}}}, {"model": {"hidden_size": 32}}, tmp_path)
    with pytest.raises(layout.CheckpointError, match=r"model\.hidden_size: checkpoint 32 vs config None"):
        layout.check_compatible({"identity": {"model": {"hidden_size": 32}}}, {"model": {}}, tmp_path)
    layout.check_compatible({"identity": {"model": {"hidden_size": 32}}}, {"model": {"hidden_size": 32}}, tmp_path)


@pytest.mark.parametrize("change", ["comera.enabled=false", "model.tie_word_embeddings=false"],
                         ids=["dense-vs-tt", "tied-vs-untied-head"])
def test_the_identity_holds_what_changes_the_parameters(change, tmp_path):
    """A dense run's checkpoint has no TT cores for a CoMERA run; an untied head has a weight a tied one lacks."""
    base = load_run_config("configs/gpt-small.yaml")
    other = load_run_config("configs/gpt-small.yaml", [change])
    with pytest.raises(layout.CheckpointError, match=r"(comera_enabled|model\.tie_word_embeddings): checkpoint"):
        layout.check_compatible({"identity": layout.identity(other)}, layout.identity(base), tmp_path)

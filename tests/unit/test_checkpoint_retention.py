"""``engine.checkpoint`` file logic through the real ``save``: re-saving a step (and a crash while it does),
a stale temporary tag, retention by ``keep`` alone, ``latest`` naming a missing or incomplete checkpoint,
and ``resolve`` / ``choose`` given a checkpoints root or one checkpoint.

A real DeepSpeed engine (ZeRO 0, CPU, one linear layer) as rank 0 of a one-process gloo group (the
``engine`` fixture of tests/unit/conftest.py), so ``save`` runs its real collectives and DeepSpeed writes
its real files. Retention with
``keep_every`` and ``latest`` protection is in test_checkpoint_manifest.py; 2-rank saves, corruption
and resume in tests/distributed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comera_dist.engine import checkpoint as ckpt

MODEL = "mp_rank_00_model_states.pt"


def _save(engine, root: Path, step: int, weight: float = 0.0, *, keep: int = 10, retain: bool = True) -> Path:
    with torch.no_grad():
        engine.module.weight.fill_(weight)  # tells the saves apart
    return ckpt.save(engine, root, step, client_state={"step": step}, meta={}, resolved_config={},
                     keep=keep, retain=retain)


def _weight(path: Path) -> float:
    return float(torch.load(path / MODEL, weights_only=False)["module"]["weight"][0, 0])


def _steps(root: Path) -> list[int]:
    return [ckpt.step_of(p) for p in ckpt.complete_checkpoints(root)]


def test_resaving_a_step_replaces_it(engine, tmp_path):
    _save(engine, tmp_path, 4, weight=1.0)
    path = _save(engine, tmp_path, 4, weight=2.0)  # e.g. the same step again after a resume
    assert _weight(path) == 2.0 and ckpt.check(path) == [] and _steps(tmp_path) == [4]
    assert (tmp_path / ckpt.LATEST).read_text() == ckpt.tag_for(4)
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))


@pytest.mark.parametrize("crash_at_rename", [1, 2])
def test_a_crash_while_resaving_a_step_loses_neither_copy(engine, tmp_path, monkeypatch, crash_at_rename):
    """Killed at the first rename (the old copy aside) or the second (the new one in): ``resume auto`` still
    finds step 4, the old copy or the new one, verified, and never starts over."""
    first = _save(engine, tmp_path, 4, weight=1.0)
    rename, calls = ckpt.os.rename, []

    def crash(src, dst):
        calls.append((src, dst))
        if len(calls) == crash_at_rename:
            raise KeyboardInterrupt("killed")  # nothing after this line of save runs
        rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "rename", crash)
        with pytest.raises(KeyboardInterrupt):
            _save(engine, tmp_path, 4, weight=2.0)
    assert (tmp_path / ckpt.LATEST).read_text() == ckpt.tag_for(4)
    assert first.exists() == (crash_at_rename == 1)
    assert ckpt.choose("auto", tmp_path) == first and ckpt.check(first) == []
    assert _weight(first) == (1.0 if crash_at_rename == 1 else 2.0)
    path = _save(engine, tmp_path, 5, weight=3.0)  # the next save sweeps what the crash left
    assert _steps(tmp_path) == [4, 5] and _weight(path) == 3.0
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))


def test_stale_temporary_tags_are_never_published_and_are_swept(engine, tmp_path):
    for step in (2, 4):  # leftovers of two crashed saves
        stale = tmp_path / f"{ckpt.TMP_PREFIX}{ckpt.tag_for(step)}"
        stale.mkdir()
        (stale / "stale.pt").write_bytes(b"from the crashed attempt")
    path = _save(engine, tmp_path, 4)
    assert not (path / "stale.pt").exists() and "stale.pt" not in ckpt.manifest.read(path)["files"]
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))  # the other tag's leftover too


def test_retention_by_keep_alone(engine, tmp_path):
    for step in (1, 2, 3):
        _save(engine, tmp_path, step, keep=2, retain=step != 3)
    assert _steps(tmp_path) == [1, 2, 3]  # retain=False deleted nothing
    _save(engine, tmp_path, 4, keep=2)
    assert _steps(tmp_path) == [3, 4]
    assert ckpt.remove_old(tmp_path, keep=1) == [tmp_path / ckpt.tag_for(3)] and _steps(tmp_path) == [4]


@pytest.mark.parametrize("named", ["incomplete", "missing", "garbage"])
def test_latest_naming_an_unusable_checkpoint_falls_back_to_the_newest_complete(engine, tmp_path, named, caplog):
    for step in (100, 200):
        _save(engine, tmp_path, step)
    if named == "incomplete":  # a checkpoint directory without its manifest
        (tmp_path / ckpt.tag_for(300)).mkdir()
        (tmp_path / ckpt.tag_for(300) / MODEL).write_bytes(b"half")
    pointed = "\x00\x00garbage" if named == "garbage" else ckpt.tag_for(300)
    (tmp_path / ckpt.LATEST).write_text(pointed)
    newest = tmp_path / ckpt.tag_for(200)
    assert ckpt.candidates_auto(tmp_path) == [newest, tmp_path / ckpt.tag_for(100)]
    assert ckpt.latest_complete(tmp_path) == newest and ckpt.resolve("auto", tmp_path) == newest
    with caplog.at_level("WARNING", logger="comera_dist.engine.checkpoint"):
        assert ckpt.choose("auto", tmp_path) == newest
    assert f"{tmp_path / ckpt.LATEST} names {pointed!r}, not a complete checkpoint there" in caplog.text


def test_resolve_and_choose_take_a_checkpoints_root_or_one_checkpoint(engine, tmp_path):
    root, elsewhere = tmp_path / "run" / "checkpoints", tmp_path / "other"
    for step in (100, 200):
        _save(engine, root, step)
    (root / ckpt.LATEST).write_text(ckpt.tag_for(100))  # the root resolves to what `latest` names
    first, second = root / ckpt.tag_for(100), root / ckpt.tag_for(200)
    assert ckpt.resolve(str(root), elsewhere) == first and ckpt.choose(str(root), elsewhere) == first
    assert ckpt.resolve(str(second), elsewhere) == second and ckpt.choose(str(second), elsewhere) == second
    assert ckpt.resolve("auto", elsewhere) is None and ckpt.choose("auto", elsewhere) is None
    run = root.parent  # the run directory (train.output_dir), as `comera evaluate` takes it; it was "COMPLETE: missing"
    assert ckpt.resolve(str(run), elsewhere) == first and ckpt.choose(str(run), elsewhere) == first
    with pytest.raises(ckpt.CheckpointError, match="COMPLETE"):  # a directory holding no checkpoint is still refused
        ckpt.choose(str(tmp_path), elsewhere)


def test_retention_removes_a_checkpoint_whose_earlier_delete_left_its_renamed_copy(engine, tmp_path, caplog):
    """A failed delete leaves ``.tmp-removing-<tag>``; once that step is saved again and old, its rename met the
    leftover (ENOTEMPTY) and raised on rank 0 after publication, the other ranks waiting at the closing barrier."""
    _save(engine, tmp_path, 2)
    _save(engine, tmp_path, 4)
    leftover = tmp_path / f"{ckpt.TMP_PREFIX}removing-{ckpt.tag_for(2)}"  # after the last sweep, as if it had failed
    leftover.mkdir()
    (leftover / MODEL).write_text("the earlier copy's remains")
    _save(engine, tmp_path, 6, keep=1)
    assert _steps(tmp_path) == [6] and not leftover.exists()
    assert "retention: could not remove" not in caplog.text


def test_a_checkpoint_retention_cannot_remove_is_kept_with_a_warning(engine, tmp_path, caplog, monkeypatch):
    _save(engine, tmp_path, 2)
    real_rename = ckpt.os.rename

    def rename(src, dst):
        if Path(dst).name.startswith(f"{ckpt.TMP_PREFIX}removing-"):
            raise PermissionError(13, "Permission denied", str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    path = _save(engine, tmp_path, 4, keep=1)  # published and verified: the save succeeds
    assert path.name == ckpt.tag_for(4) and _steps(tmp_path) == [2, 4]
    assert f"retention: could not remove {tmp_path / ckpt.tag_for(2)}" in caplog.text


def test_auto_names_a_checkpoint_it_passes_over_for_lacking_its_marker(engine, tmp_path, caplog):
    """The README's promise: a skipped incomplete checkpoint gets a log line (one with its COMPLETE marker removed
    was passed over without a word)."""
    first, second = _save(engine, tmp_path, 1), _save(engine, tmp_path, 2)
    (second / ckpt.MARKER).unlink()
    with caplog.at_level("WARNING", logger=ckpt.log.name):
        assert ckpt.choose("auto", tmp_path) == first
    assert f"resume auto: skipping checkpoint {second}, it is incomplete (no {ckpt.MARKER})" in caplog.text
    assert str(first) not in caplog.text


def test_a_callers_meta_cannot_replace_the_step_or_tag(engine, tmp_path):
    """The step and tag in a checkpoint's meta are where it was saved, whatever the caller's meta holds."""
    path = ckpt.save(engine, tmp_path, 4, client_state={}, meta={"step": 99, "tag": "x", "kept": 1},
                     resolved_config={}, keep=1)
    assert ckpt.read_meta(path) == {"step": 4, "tag": ckpt.tag_for(4), "kept": 1}


def test_the_consolidated_state_is_written_and_a_missing_one_named(engine, tmp_path):
    """``full_state`` is what an elastic resume loads; a checkpoint without it says it cannot do that."""
    path = ckpt.save(engine, tmp_path, 2, client_state={}, meta={}, resolved_config={}, keep=2,
                     full_state={"weights": torch.arange(3.0)})
    assert torch.equal(ckpt.read_full_state(path)["weights"], torch.arange(3.0))
    bare = _save(engine, tmp_path, 3)
    with pytest.raises(ckpt.CheckpointError, match=f"{bare / ckpt.FULL_STATE} is missing: .* predates elastic"):
        ckpt.read_full_state(bare)


def test_auto_refuses_to_start_over_when_no_checkpoint_verifies(engine, tmp_path):
    """Starting over would silently discard the run; the error names the way to do it on purpose."""
    path = _save(engine, tmp_path, 3)
    data = bytearray((path / MODEL).read_bytes())
    data[-10] ^= 0xFF
    (path / MODEL).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="none of the 1 checkpoints .* pass --resume none to start over"):
        ckpt.choose("auto", tmp_path)

"""``engine.checkpoint.save`` never loses the last good copy: a re-save whose read-back fails puts the copy it
replaced back (and a crash at each step of that leaves ``resume auto`` a verified step), and every file of a
checkpoint reaches the disk (fsync) before its manifest vouches for it.

A real DeepSpeed engine (ZeRO 0, CPU, one linear layer) as rank 0 of a one-process gloo group (the ``engine``
fixture of tests/unit/conftest.py), so ``save`` runs its real collectives and DeepSpeed writes its real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from comera_dist.engine import checkpoint as ckpt

MODEL = "mp_rank_00_model_states.pt"


def _save(engine, root: Path, step: int, weight: float) -> Path:
    with torch.no_grad():
        engine.module.weight.fill_(weight)  # tells the saves apart
    return ckpt.save(engine, root, step, client_state={"step": step}, meta={}, resolved_config={}, keep=1)


def _weight(path: Path) -> float:
    return float(torch.load(path / MODEL, weights_only=False)["module"]["weight"][0, 0])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _resave_with_bad_read_back(engine, root: Path, monkeypatch, crash_at_rename: int = 0) -> None:
    """Re-save step 4 (weight 2.0) while a bad write corrupts the new copy once it is published (the second
    rename puts it in place); ``crash_at_rename`` kills the save at that rename (1-based, 0: never)."""
    rename, calls = ckpt.os.rename, []

    def bad_disk(src, dst):
        calls.append((src, dst))
        if len(calls) == crash_at_rename:
            raise KeyboardInterrupt("killed")  # nothing after this line of save runs
        rename(src, dst)
        if len(calls) == 2:
            _flip(Path(dst) / MODEL)

    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "rename", bad_disk)
        _save(engine, root, 4, weight=2.0)


def test_a_resave_that_fails_its_read_back_puts_the_replaced_copy_back(engine, tmp_path, monkeypatch):
    first = _save(engine, tmp_path, 4, weight=1.0)  # the run's only checkpoint (keep=1)
    with pytest.raises(ckpt.CheckpointError, match="back in place") as err:
        _resave_with_bad_read_back(engine, tmp_path, monkeypatch)
    assert f"{ckpt.tag_for(4)}/{MODEL}" in str(err.value) and "digest differs" in str(err.value)
    assert (tmp_path / ckpt.LATEST).read_text() == ckpt.tag_for(4)
    assert ckpt.check(first) == [] and _weight(first) == 1.0  # `latest` names the good copy
    assert ckpt.choose("auto", tmp_path) == first
    path = _save(engine, tmp_path, 5, weight=3.0)  # the next save sweeps the failed copy
    assert [ckpt.step_of(p) for p in ckpt.complete_checkpoints(tmp_path)] == [5] and _weight(path) == 3.0
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))


@pytest.mark.parametrize("crash_at_rename", [3, 4])
def test_a_crash_while_putting_the_replaced_copy_back_loses_it_not(engine, tmp_path, monkeypatch, crash_at_rename):
    """Killed while moving the failed copy aside (rename 3) or the old one back (rename 4): ``resume auto``
    finds the old copy of step 4, verified, never the failed one."""
    first = _save(engine, tmp_path, 4, weight=1.0)
    with pytest.raises(KeyboardInterrupt):
        _resave_with_bad_read_back(engine, tmp_path, monkeypatch, crash_at_rename)
    assert first.exists() == (crash_at_rename == 3)  # at 3 the failed copy is still in place
    assert ckpt.choose("auto", tmp_path) == first and ckpt.check(first) == [] and _weight(first) == 1.0
    assert (tmp_path / ckpt.LATEST).read_text() == ckpt.tag_for(4)


def test_a_crash_during_the_read_back_of_a_resave_keeps_a_verified_step(engine, tmp_path, monkeypatch):
    """Killed while the ranks read the new copy back: it is whole (fsynced, described) and ``resume auto``
    takes it; the old copy set aside goes with the next save."""
    _save(engine, tmp_path, 4, weight=1.0)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(ckpt.manifest, "verify", killed)
        _save(engine, tmp_path, 4, weight=2.0)
    found = ckpt.choose("auto", tmp_path)
    assert found == tmp_path / ckpt.tag_for(4) and _weight(found) == 2.0
    _save(engine, tmp_path, 5, weight=3.0)
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))


def test_every_file_reaches_the_disk_before_the_manifest(engine, tmp_path, monkeypatch):
    """Each data file and the checkpoint's directory are fsynced before the ``COMPLETE`` marker is (whose
    inode the rename into place keeps), so a power loss never leaves a manifest vouching for lost bytes."""
    _save(engine, tmp_path, 3, weight=1.0)  # a retained older checkpoint: the power-loss case deletes it
    fsync, synced = os.fsync, []

    def recording(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "fsync", recording)
        path = _save(engine, tmp_path, 4, weight=2.0)

    def inode(p: Path) -> tuple[int, int]:
        st = p.stat()
        return st.st_dev, st.st_ino

    marker = synced.index(inode(path / ckpt.MARKER))
    data = [path / n for n in ckpt.manifest.checkpoint_files(path)]
    assert len(data) >= 3  # DeepSpeed's shard(s), the meta and the config
    late = [str(p) for p in [*data, path] if inode(p) not in synced[:marker]]
    assert not late, f"fsynced only after the manifest, or never: {late}"
    latest = synced.index(inode(tmp_path / ckpt.LATEST))  # its new name too: a power loss keeps the old pointer
    assert inode(tmp_path) in synced[latest + 1:], "`latest` was replaced, its directory never fsynced after"


def test_side_files_are_published_under_the_manifest(engine, tmp_path):
    """``side_files`` (the metrics history) land inside the checkpoint, listed and verified like its own files,
    so no crash can publish the checkpoint without them; they may not replace the checkpoint's own files."""
    path = ckpt.save(engine, tmp_path, 2, client_state={}, meta={}, resolved_config={}, keep=1,
                     side_files={"metrics_history.json": '{"step": 2}'})
    assert (path / "metrics_history.json").read_text() == '{"step": 2}'
    assert "metrics_history.json" in ckpt.manifest.read(path)["files"]
    (path / "metrics_history.json").write_text('{"step": 1}')
    assert any("metrics_history.json" in p for p in ckpt.manifest.verify(path, ckpt.manifest.read(path),
                                                                          ckpt.manifest.checkpoint_files(path)))
    for own in (ckpt.MARKER, ckpt.META, ckpt.CONFIG, ckpt.FULL_STATE):
        with pytest.raises(ValueError, match=f"side_files may not replace the checkpoint's own \\['{own}'\\]"):
            ckpt.save(engine, tmp_path, 3, client_state={}, meta={}, resolved_config={}, keep=1,
                      side_files={own: "x"})


NAMES = ["comera_full_state.pt", "comera_meta.json", "config.yaml", "metrics_history.json",
         "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_10_mp_rank_00_model_states.pt"]


def test_each_checkpoint_file_has_one_writer():
    """The rank that fsyncs a file before the hashing (tests/distributed/test_ckpt_writer_fsync.py)."""
    assert ckpt.written_by(NAMES, 1) == ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert ckpt.written_by(NAMES, 10) == ["zero_pp_rank_10_mp_rank_00_model_states.pt"]  # not rank 1's
    assert ckpt.written_by(NAMES, 0) == NAMES[:6]  # its shard, and every file not named for a rank
    assert ckpt.written_by(NAMES, 2) == []


def test_a_stale_replaced_copy_is_not_put_back_by_a_failed_save(engine, tmp_path, monkeypatch):
    """A ``.tmp-replaced-<tag>`` that an earlier crash left, with no checkpoint of that step in place: a save of
    the step whose read-back fails must not publish the stale copy as the step, nor claim it put it back."""
    _save(engine, tmp_path, 3, weight=1.0)
    stale = tmp_path / f"{ckpt.TMP_PREFIX}replaced-{ckpt.tag_for(4)}"
    stale.mkdir()
    (stale / "stale").write_text("an older run's")
    with monkeypatch.context() as m, pytest.raises(ckpt.CheckpointError, match="`latest` and older checkpoints"):
        m.setattr(ckpt.manifest, "verify", lambda path, found, names=None: [f"{path}: digest differs"])
        _save(engine, tmp_path, 4, weight=2.0)
    assert not (tmp_path / ckpt.tag_for(4) / "stale").exists()
    assert (tmp_path / ckpt.LATEST).read_text() == ckpt.tag_for(3)

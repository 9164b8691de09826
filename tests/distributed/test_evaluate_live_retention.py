"""``comera evaluate`` / ``export`` on a live run (``evaluate.load_run`` of a run directory): the run's retention
may delete the newest checkpoint while it is being read, because the run has just published a newer one.
The reader then locates and reads the newest again, instead of failing (a missing file, or DeepSpeed's
traceback). A checkpoint directory named explicitly is read once, and its deletion is a clear error.

The checkpoints come from two spawned ranks (a real DeepSpeed engine at ZeRO 1, an optimizer shard per rank);
the save-then-retain of the live run is played, at the moment the reader has located its checkpoint, by the
same publish and ``checkpoint.remove_old`` the run uses.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from dist_helpers import run_ranks
from engine_cases import batch, factory, tiny_config


def _write(rank: int, world_size: int, outdir: str) -> list[str]:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    cfg = tiny_config(outdir, zero_stage=1, steps=3)  # keeps 3 checkpoints
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    paths = []
    for step in (1, 2, 3):
        s.train_step([batch(step, rank)])
        paths.append(str(s.save(step)))
    s.close()
    return paths


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live_eval")
    return [Path(p) for p in run_ranks(_write, tmp / "w", str(tmp / "run"), world_size=2)[0]]


@pytest.fixture
def live_run(written, tmp_path):
    """A copy of the run at step 2 whose step-2 checkpoint is not yet published: ``latest`` names step 1."""
    from comera_dist.engine import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(written[0].parent.parent, run)
    root = run / "checkpoints"
    shutil.rmtree(root / written[2].name)
    os.rename(root / written[1].name, root / (ckpt.TMP_PREFIX + written[1].name))
    (root / ckpt.LATEST).write_text(written[0].name)
    return run


def _publish_and_retain_on_first_read(monkeypatch, root: Path, newer: str) -> list[Path]:
    """When the reader first checks a checkpoint, the live run publishes ``newer`` and its retention (keep 1)
    deletes the older one. Returns the checkpoints the reader checked."""
    from comera_dist.engine import checkpoint as ckpt

    checked, real_check = [], ckpt.check

    def check(path: Path) -> list[str]:
        checked.append(Path(path))
        if len(checked) == 1:
            os.rename(root / (ckpt.TMP_PREFIX + newer), root / newer)
            (root / ckpt.LATEST).write_text(newer)
            assert ckpt.remove_old(root, keep=1) == [Path(path)]
        return real_check(path)

    monkeypatch.setattr(ckpt, "check", check)
    return checked


def test_a_live_runs_newest_checkpoint_deleted_while_read_is_located_and_read_again(written, live_run,
                                                                                     monkeypatch, caplog):
    from comera_dist.engine.evaluate import load_run

    root = live_run / "checkpoints"
    checked = _publish_and_retain_on_first_read(monkeypatch, root, written[1].name)
    loaded = load_run(live_run)
    assert [p.name for p in checked] == [written[0].name, written[1].name]
    assert loaded.path == root / written[1].name and loaded.model is not None
    assert "deleted while it was read" in caplog.text


def test_a_checkpoint_named_explicitly_is_read_once_and_its_deletion_is_a_clear_error(written, live_run,
                                                                                      monkeypatch):
    from comera_dist.engine.errors import InputError
    from comera_dist.engine.evaluate import load_run

    root = live_run / "checkpoints"
    checked = _publish_and_retain_on_first_read(monkeypatch, root, written[1].name)
    with pytest.raises(InputError, match="was deleted while it was read"):
        load_run(root / written[0].name)
    assert [p.name for p in checked] == [written[0].name]


def test_retention_takes_a_checkpoint_out_of_sight_before_deleting_it(written, tmp_path, monkeypatch):
    """A reader must never find a checkpoint half-deleted: it is renamed to a temporary tag in one step, then
    deleted; what a failed delete leaves is swept by the next retention."""
    from comera_dist.engine import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    shutil.copytree(written[0].parent, root)
    seen = []
    real_rmtree = shutil.rmtree

    def failing_rmtree(path, *args, **kwargs):  # a delete that fails (e.g. a file held open on NFS)
        seen.append((Path(path).name, [p.name for p in ckpt.complete_checkpoints(root)]))

    monkeypatch.setattr(ckpt.shutil, "rmtree", failing_rmtree)
    assert ckpt.remove_old(root, keep=1) == [root / written[0].name, root / written[1].name]
    doomed = [ckpt.TMP_PREFIX + "removing-" + p.name for p in written[:2]]
    # each one was already out of sight when its delete began
    assert seen[:2] == [(doomed[0], [written[1].name, written[2].name]), (doomed[1], [written[2].name])]
    assert ckpt.latest_complete(root, finish=False) == root / written[2].name
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert ckpt.remove_old(root, keep=1) == []  # the next retention sweeps what the failed deletes left
    assert not list(root.glob(ckpt.TMP_PREFIX + "*")) and [p.name for p in root.glob("step*")] == [written[2].name]


def test_a_reader_that_loses_the_race_every_time_stops_with_a_clear_error(written, tmp_path, monkeypatch):
    """Bounded: each located checkpoint is deleted while read (a run saving faster than one can be read)."""
    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine import evaluate
    from comera_dist.engine.errors import InputError

    run = tmp_path / "run"
    shutil.copytree(written[0].parent.parent, run)
    checked, real_check = [], ckpt.check

    def check(path: Path) -> list[str]:
        checked.append(Path(path).name)
        (Path(path) / ckpt.MARKER).unlink()  # retention took it as soon as it was located
        shutil.rmtree(path)
        return real_check(path)

    monkeypatch.setattr(ckpt, "check", check)
    monkeypatch.setattr(evaluate, "READ_ATTEMPTS", 2)
    with pytest.raises(InputError, match="deleted while it was read, 2 times in a row"):
        evaluate.load_run(run)
    assert checked == [written[2].name, written[1].name]  # the newest, then the newest left; never a third

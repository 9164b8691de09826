"""``Metrics.history_files``/``restore_history``: the history travels inside the checkpoint it belongs to, so a
resume reads the one of the checkpoint it loaded; a checkpoint from an older version (no history inside) still
finds the history its version wrote beside the report."""

from __future__ import annotations

import json

from comera_dist.metrics.config import MetricsConfig
from comera_dist.metrics.core import HISTORY_FILE, Metrics


def _metrics(out, rank=0):
    return Metrics(MetricsConfig(prometheus=False, progress=False, report=False), rank=rank, local_rank=0,
                   world_size=2, total_steps=10, output_dir=out, run_name="run")


def _save_at(m, ckpt, step):
    for name, text in m.history_files(step).items():
        (ckpt / name).write_text(text)


def test_a_resume_continues_the_history_inside_its_checkpoint(tmp_path):
    m = _metrics(tmp_path)
    step4, step6 = tmp_path / "step4", tmp_path / "step6"
    step4.mkdir(), step6.mkdir()
    for step in range(1, 7):
        m.log({"train_loss": 10.0 - step}, step)
        if step == 2:  # the older place, one checkpoint behind, as a crash before its write at step 4 left it
            (tmp_path / HISTORY_FILE).write_text(json.dumps({"step": 2, "history": m.history.state()}))
        if step in (4, 6):
            _save_at(m, tmp_path / f"step{step}", step)
            m.checkpoint_saved(True, step)
    resumed = _metrics(tmp_path)
    resumed.restore_history(4, step4)
    assert resumed.history.scalars["train_loss"] == [(s, 10.0 - s) for s in range(1, 5)]
    assert [(s, ok) for s, ok, _ in resumed.history.checkpoints] == [(4, True)]  # its own record is inside


def _history_beside_the_report(tmp_path, last: int) -> None:
    """A run that logged ``train_loss`` for steps 1..``last`` and wrote its history beside the report, and an
    ``old`` checkpoint directory that holds none (written before checkpoints carried it)."""
    m = _metrics(tmp_path)
    for step in range(1, last + 1):
        m.log({"train_loss": float(step)}, step)
    (tmp_path / HISTORY_FILE).write_text(json.dumps({"step": last, "history": m.history.state()}))
    (tmp_path / "old").mkdir()


def test_a_checkpoint_without_a_history_reads_the_one_beside_the_report(tmp_path, caplog):
    _history_beside_the_report(tmp_path, 4)
    resumed = _metrics(tmp_path)
    resumed.restore_history(4, tmp_path / "old")
    assert [s for s, _ in resumed.history.scalars["train_loss"]] == [1, 2, 3, 4]
    earlier = _metrics(tmp_path)  # resumed from an older checkpoint: what that file logged after it is not the run's
    earlier.restore_history(2, tmp_path / "old")
    assert [s for s, _ in earlier.history.scalars["train_loss"]] == [1, 2]
    (tmp_path / HISTORY_FILE).unlink()
    alone = _metrics(tmp_path)
    alone.restore_history(4, tmp_path / "old")
    assert alone.history.scalars == {} and "the report covers this job's steps only" in caplog.text


def test_other_ranks_write_no_history(tmp_path):
    assert _metrics(tmp_path, rank=1).history_files(3) == {}
    assert set(_metrics(tmp_path).history_files(3)) == {HISTORY_FILE}


def test_a_history_older_than_the_checkpoint_is_used_and_named_in_the_log(tmp_path, caplog):
    _history_beside_the_report(tmp_path, 2)
    exact = _metrics(tmp_path)
    exact.restore_history(2, tmp_path / "old")
    assert "misses the steps between" not in caplog.text
    later = _metrics(tmp_path)
    later.restore_history(4, tmp_path / "old")
    assert [s for s, _ in later.history.scalars["train_loss"]] == [1, 2]
    assert "ends at step 2, the resumed checkpoint is step 4: the report misses the steps between" in caplog.text


def test_a_resume_before_a_series_began_still_writes_the_report(tmp_path):
    """The file beside the report is newer than the resumed checkpoint and holds a series that began after it."""
    m = _metrics(tmp_path)
    for step in range(1, 7):
        m.log({"train_loss": 10.0 - step, **({"val_loss": 3.0} if step >= 5 else {})}, step)
    (tmp_path / HISTORY_FILE).write_text(json.dumps({"step": 6, "history": m.history.state()}))
    (tmp_path / "old").mkdir()
    resumed = Metrics(MetricsConfig(prometheus=False, progress=False), rank=0, local_rank=0, world_size=2,
                      total_steps=10, output_dir=tmp_path, run_name="run")
    resumed.restore_history(3, tmp_path / "old")
    resumed.log({"train_loss": 6.5}, 4)
    resumed.close()
    md = (tmp_path / "report.md").read_text()
    assert "| train_loss | 9 | 6.5 | 6.5 | 9 |" in md and "val_loss" not in md

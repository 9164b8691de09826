"""``comera evaluate``/``export`` find a run's checkpoint without touching it: the run may be live, and a
re-save between its two renames (``latest`` naming no directory beside a complete ``.tmp-<tag>``) is the
job's to finish. Publishing it from outside would race the job's own rename and crash its save."""

from __future__ import annotations

from pathlib import Path

from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine.evaluate import locate


def _complete(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / ckpt.MARKER).write_text("manifest")
    (path / ckpt.META).write_text("{}")
    return path


def test_locate_reads_a_run_in_the_middle_of_a_resave_and_renames_nothing(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    older = _complete(root / ckpt.tag_for(2))
    pending = _complete(root / f"{ckpt.TMP_PREFIX}{ckpt.tag_for(4)}")  # the job renames it in next
    (root / ckpt.LATEST).write_text(ckpt.tag_for(4))
    assert locate(tmp_path / "run") == older
    assert pending.is_dir() and not (root / ckpt.tag_for(4)).exists()
    assert ckpt.latest_complete(root) == root / ckpt.tag_for(4)  # the job's own lookup still finishes it

"""``models.atomic.atomic_dir``: what is on disk after a save, a replaced save, a stale temporary, a file."""

from __future__ import annotations

import os

import pytest

from comera_dist.models.atomic import atomic_dir


def _write(out, text):
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text(text)


def test_replacing_a_directory_leaves_only_the_new_one(tmp_path):
    out = tmp_path / "out"
    _write(out, "one")
    _write(out, "two")
    assert (out / "a.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .old-/.tmp- sibling left


def test_a_stale_temporary_of_the_same_pid_is_cleared(tmp_path):
    """A crashed earlier run with the same pid (pid 1 in every container) left its temporary behind."""
    stale = tmp_path / f".out.tmp-{os.getpid()}"
    stale.mkdir()
    (stale / "junk").write_text("x")
    _write(tmp_path / "out", "new")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_existing_file_at_the_output_path_is_an_error_and_stays(tmp_path):
    out = tmp_path / "out"
    out.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        _write(out, "new")
    assert out.read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

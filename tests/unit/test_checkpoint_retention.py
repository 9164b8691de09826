"""``engine.checkpoint`` file logic through the real ``save``: re-saving a step, a stale temporary tag,
retention by ``keep`` alone, ``latest`` naming a missing or incomplete checkpoint, and ``resolve`` /
``choose`` given a checkpoints root or one checkpoint.

One rank: ``checkpoint.dist`` is a single-process stand-in and the engine writes one model file, as
DeepSpeed's ``save_checkpoint`` does under the temporary tag. Retention with ``keep_every`` and
``latest`` protection is in test_checkpoint_manifest.py; 2-rank saves in tests/distributed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from comera_dist.engine import checkpoint as ckpt

MODEL = "mp_rank_00_model_states.pt"


class _Engine:
    """Writes what DeepSpeed's ``save_checkpoint`` would: a directory named by the tag, one model file."""

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def save_checkpoint(self, root: str, tag: str, client_state: dict, save_latest: bool) -> None:
        assert not save_latest  # ``latest`` is ours to move, after verification
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"module": {"w": torch.full((4,), self.weight)}, **client_state}, Path(root) / tag / MODEL)


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.setattr(ckpt, "dist", SimpleNamespace(
        get_rank=lambda: 0, get_world_size=lambda: 1, barrier=lambda: None,
        all_gather_object=lambda out, obj: out.__setitem__(0, obj)))


def _save(root: Path, step: int, weight: float = 0.0, *, keep: int = 10, retain: bool = True) -> Path:
    return ckpt.save(_Engine(weight), root, step, client_state={"step": step}, meta={}, resolved_config={},
                     keep=keep, retain=retain)


def _weight(path: Path) -> float:
    return float(torch.load(path / MODEL, weights_only=True)["module"]["w"][0])


def _steps(root: Path) -> list[int]:
    return [ckpt.step_of(p) for p in ckpt.complete_checkpoints(root)]


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 4, weight=1.0)
    path = _save(tmp_path, 4, weight=2.0)  # e.g. the same step again after a resume
    assert _weight(path) == 2.0 and ckpt.check(path) == [] and _steps(tmp_path) == [4]
    assert (tmp_path / ckpt.LATEST).read_text() == ckpt.tag_for(4)
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))


def test_stale_temporary_tags_are_never_published_and_are_swept(tmp_path):
    for step in (2, 4):  # leftovers of two crashed saves
        stale = tmp_path / f"{ckpt.TMP_PREFIX}{ckpt.tag_for(step)}"
        stale.mkdir()
        (stale / "stale.pt").write_bytes(b"from the crashed attempt")
    path = _save(tmp_path, 4)
    assert not (path / "stale.pt").exists() and "stale.pt" not in ckpt.manifest.read(path)["files"]
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))  # the other tag's leftover too


def test_retention_by_keep_alone(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=2, retain=step != 3)
    assert _steps(tmp_path) == [1, 2, 3]  # retain=False deleted nothing
    _save(tmp_path, 4, keep=2)
    assert _steps(tmp_path) == [3, 4]
    assert ckpt.remove_old(tmp_path, keep=1) == [tmp_path / ckpt.tag_for(3)] and _steps(tmp_path) == [4]


@pytest.mark.parametrize("named", ["incomplete", "missing"])
def test_latest_naming_an_unusable_checkpoint_falls_back_to_the_newest_complete(tmp_path, named):
    for step in (100, 200):
        _save(tmp_path, step)
    if named == "incomplete":  # a checkpoint directory without its manifest
        (tmp_path / ckpt.tag_for(300)).mkdir()
        (tmp_path / ckpt.tag_for(300) / MODEL).write_bytes(b"half")
    (tmp_path / ckpt.LATEST).write_text(ckpt.tag_for(300))
    newest = tmp_path / ckpt.tag_for(200)
    assert ckpt.candidates_auto(tmp_path) == [newest, tmp_path / ckpt.tag_for(100)]
    assert ckpt.latest_complete(tmp_path) == newest and ckpt.resolve("auto", tmp_path) == newest
    assert ckpt.choose("auto", tmp_path) == newest


def test_resolve_and_choose_take_a_checkpoints_root_or_one_checkpoint(tmp_path):
    root, elsewhere = tmp_path / "run" / "checkpoints", tmp_path / "other"
    for step in (100, 200):
        _save(root, step)
    (root / ckpt.LATEST).write_text(ckpt.tag_for(100))  # the root resolves to what `latest` names
    first, second = root / ckpt.tag_for(100), root / ckpt.tag_for(200)
    assert ckpt.resolve(str(root), elsewhere) == first and ckpt.choose(str(root), elsewhere) == first
    assert ckpt.resolve(str(second), elsewhere) == second and ckpt.choose(str(second), elsewhere) == second
    assert ckpt.resolve("auto", elsewhere) is None and ckpt.choose("auto", elsewhere) is None

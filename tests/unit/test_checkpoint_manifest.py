"""The checkpoint manifest (sizes, digests, legacy markers), retention with keep/keep_every, the
non-finite check of a consolidated state, and the ``train.keep_every`` field. Pure file logic."""

from __future__ import annotations

import pytest
import torch
from checkpoint_testlib import revouch

from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine import manifest
from comera_dist.engine.config import TrainConfig
from comera_dist.engine.elastic import nonfinite_entries


def _checkpoint(root, step: int, files: dict[str, bytes]):
    path = root / ckpt.tag_for(step)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    (path / ckpt.META).write_text("{}")
    revouch(path)
    return path


def test_manifest_lists_every_file_and_catches_flip_truncation_missing(tmp_path):
    path = _checkpoint(tmp_path, 1, {"a.pt": bytes(range(256)) * 40, "sub/b.pt": b"xyz"})
    found = manifest.read(path)
    assert set(found["files"]) == {"a.pt", "sub/b.pt", ckpt.META} and found["algorithm"] == "xxh3_128"
    assert found["files"]["a.pt"]["size"] == 10240
    assert manifest.verify(path, found) == [] and ckpt.check(path) == []

    data = bytearray((path / "a.pt").read_bytes())
    data[5000] ^= 0x01  # one bit
    (path / "a.pt").write_bytes(bytes(data))
    assert ckpt.check(path) == [f"{path / 'a.pt'}: xxh3_128 digest differs from the manifest (corrupted)"]
    (path / "a.pt").write_bytes(bytes(data[:100]))
    assert "a.pt: size 100 bytes, the manifest says 10240" in ckpt.check(path)[0]
    (path / "sub" / "b.pt").unlink()
    problems = ckpt.check(path)
    assert len(problems) == 2 and problems[1] == f"{path / 'sub' / 'b.pt'}: missing (listed in the manifest)"


def test_sha256_manifest_still_verifies(tmp_path):
    path = _checkpoint(tmp_path, 3, {"a.pt": b"abc" * 100})
    files = {"a.pt": {"size": 300, "digest": manifest.digest(path / "a.pt", "sha256")}}
    found = {"format": 1, "tag": path.name, "algorithm": "sha256", "files": files}
    assert manifest.verify(path, found) == []
    (path / "a.pt").write_bytes(b"abd" * 100)
    assert manifest.verify(path, found) == [f"{path / 'a.pt'}: sha256 digest differs from the manifest (corrupted)"]


def test_legacy_marker_passes_with_a_warning_damaged_marker_fails(tmp_path, caplog):
    path = _checkpoint(tmp_path, 2, {"a.pt": b"abc"})
    (path / manifest.MARKER).write_text(f"{path.name}\n")  # the pre-manifest marker
    assert manifest.read(path) == manifest.LEGACY
    aside = path.rename(path.with_name(f".tmp-replaced-{path.name}"))  # a re-save's copy of it, kept until verified
    assert manifest.read(aside) == manifest.LEGACY
    aside.rename(path)
    with caplog.at_level("WARNING"):
        assert ckpt.check(path) == []
    assert "written before checkpoint manifests" in caplog.text and "cannot be verified" in caplog.text
    (path / ckpt.META).unlink()  # nothing vouches for a legacy checkpoint's files: its meta at least must be there
    assert ckpt.check(path) == [f"{path / ckpt.META}: missing"]
    (path / manifest.MARKER).write_text('{"format": 1, "files": {')
    assert "damaged manifest" in ckpt.check(path)[0]
    for text in ("", "\n", "step00000001\n", "00002\n", "\x00" * 4096):  # a crash's zero-length or zeroed file, another tag, a tail
        (path / manifest.MARKER).write_text(text)
        want = (f"{path / manifest.MARKER}: damaged manifest ({len(text.encode())} bytes, neither JSON nor the "
                f"pre-manifest marker {path.name!r})")
        assert ckpt.check(path) == [want], text
    (path / manifest.MARKER).unlink()
    assert ckpt.check(path) == [f"{path / manifest.MARKER}: missing (the save was interrupted before publication)"]


def test_retention_keeps_newest_every_nth_and_latest(tmp_path):
    for step in range(100, 800, 100):
        _checkpoint(tmp_path, step, {"a.pt": b"x"})
    (tmp_path / ckpt.LATEST).write_text(ckpt.tag_for(300))  # e.g. the newest one that verified
    (tmp_path / ".tmp-step00000800").mkdir()
    removed = ckpt.remove_old(tmp_path, keep=2, keep_every=200)
    assert sorted(p.name for p in removed) == [ckpt.tag_for(s) for s in (100, 500)]
    left = [ckpt.step_of(p) for p in ckpt.complete_checkpoints(tmp_path)]
    assert left == [200, 300, 400, 600, 700] and not (tmp_path / ".tmp-step00000800").exists()
    assert ckpt.candidates_auto(tmp_path)[0].name == ckpt.tag_for(300)  # `latest` is tried first


def test_nonfinite_entries_names_params_and_moments():
    good = {"params": {"w": torch.ones(3), "ids": torch.arange(3)}, "moments": {"w": {"exp_avg": torch.zeros(3)}}}
    assert nonfinite_entries(good) == []
    bad = {"params": {"w": torch.tensor([1.0, float("nan")]), "v": torch.ones(2)},
           "moments": {"v": {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.tensor([float("inf"), 0.0])}}}
    assert nonfinite_entries(bad) == ["v.exp_avg_sq", "w"]


def test_keep_every_validated():
    assert TrainConfig(keep_every=100).keep_every == 100
    with pytest.raises(ValueError, match="train.keep_every must be >= 0, got -1"):
        TrainConfig(keep_every=-1)


def test_a_flip_past_the_first_read_chunk_is_caught(tmp_path):
    """Shards are GBs, read in 1 MiB chunks: every chunk goes into the digest, the last one too."""
    path = _checkpoint(tmp_path, 1, {"big.pt": bytes(range(256)) * (10 << 10)})  # 2.5 MiB
    data = bytearray((path / "big.pt").read_bytes())
    data[-1] ^= 0xFF
    (path / "big.pt").write_bytes(bytes(data))
    assert ckpt.check(path) == [f"{path / 'big.pt'}: xxh3_128 digest differs from the manifest (corrupted)"]


def test_describing_for_a_save_fsyncs_each_file(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, 1, {"a.pt": b"abc", "sub/b.pt": b"xyz"})
    fsync, synced = manifest.os.fsync, []

    def recording(fd):
        synced.append(manifest.os.fstat(fd).st_ino)
        fsync(fd)

    monkeypatch.setattr(manifest.os, "fsync", recording)
    manifest.describe(path, ["a.pt", "sub/b.pt"])
    assert synced == []
    manifest.describe(path, ["a.pt", "sub/b.pt"], sync=True)
    assert synced == [(path / "a.pt").stat().st_ino, (path / "sub" / "b.pt").stat().st_ino]


def test_a_manifest_is_read_as_one_whatever_leads_it_and_must_list_files(tmp_path):
    """A marker with a leading newline is still a manifest to verify (not a legacy marker passed unchecked); one
    without ``files`` is damaged."""
    path = _checkpoint(tmp_path, 1, {"a.pt": b"abc"})
    text = (path / manifest.MARKER).read_text()
    (path / manifest.MARKER).write_text("\n" + text)
    (path / "a.pt").write_bytes(b"abd")
    assert ckpt.check(path) == [f"{path / 'a.pt'}: xxh3_128 digest differs from the manifest (corrupted)"]
    (path / manifest.MARKER).write_text('{"format": 1, "tag": "step00000001", "algorithm": "xxh3_128"}')
    with pytest.raises(ValueError, match="manifest lacks 'files' or 'algorithm'"):
        manifest.read(path)


def test_a_rank_with_no_share_verifies_nothing(tmp_path):
    """More ranks than files: a rank's share is empty, and it reads nothing (the others read every file)."""
    path = _checkpoint(tmp_path, 1, {"a.pt": b"abc"})
    (path / "a.pt").write_bytes(b"abd")
    assert manifest.verify(path, manifest.read(path), []) == []
    assert len(manifest.verify(path, manifest.read(path))) == 1


def test_a_shared_check_reads_each_file_once_across_the_ranks_and_sizes_everywhere(tmp_path, monkeypatch):
    """A resume's check on W ranks: every rank checks presence and size of every file, but digests only its
    share, so the all-gathered verdicts read the checkpoint once, not W times."""
    path = _checkpoint(tmp_path, 2, {f"zero_pp_rank_{r}_optim_states.pt": bytes([r]) * 300 for r in range(5)})
    read: list[str] = []
    real = manifest.digest
    monkeypatch.setattr(manifest, "digest", lambda p, *a, **k: read.append(p.name) or real(p, *a, **k))
    world = 3
    assert [ckpt.check(path, (r, world)) for r in range(world)] == [[], [], []]
    assert sorted(read) == sorted(manifest.read(path)["files"])  # each of the 6 files once, over the 3 ranks

    flipped = path / "zero_pp_rank_3_optim_states.pt"
    flipped.write_bytes(b"\xff" * 300)  # same size: only the rank that digests it can tell
    verdicts = [ckpt.check(path, (r, world)) for r in range(world)]
    assert sorted(len(v) for v in verdicts) == [0, 0, 1]
    assert [p for v in verdicts for p in v] == [f"{flipped}: xxh3_128 digest differs from the manifest (corrupted)"]
    gone = path / "zero_pp_rank_0_optim_states.pt"
    gone.unlink()  # missing where a rank looks: every rank says so, whoever digests it
    for r in range(world):
        assert f"{gone}: missing (listed in the manifest)" in ckpt.check(path, (r, world))

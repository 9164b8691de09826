"""Checkpoint-side config checks: identity mismatch is a clear error; shards must load weights_only."""

from __future__ import annotations

import os

import pytest
import torch

from comera_dist.engine import checkpoint as ckpt


def test_incompatible_identity_names_every_key(tmp_path):
    saved = {"identity": {"model": {"hidden_size": 16, "vocab_size": 64}, "tensorize": {"num_cores": 4}}}
    ckpt.check_compatible(saved, saved["identity"], tmp_path)  # same config: fine
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.check_compatible(saved, {"model": {"hidden_size": 32, "vocab_size": 64},
                                      "tensorize": {"num_cores": 6}}, tmp_path)
    assert "model.hidden_size: checkpoint 16 vs config 32" in str(e.value)
    assert "tensorize.num_cores: checkpoint 4 vs config 6" in str(e.value)
    assert str(e.value).endswith(f"\nresume it with the config that wrote it ({tmp_path / 'config.yaml'}), or train "
                                 "this config in another train.output_dir"), str(e.value)


class Payload:
    def __reduce__(self):
        return (os.getcwd, ())


def test_weights_only_gate_refuses_pickled_objects(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    torch.save({"module": {"w": torch.ones(2)}, "client_state": {"step": 3, "rng": [1, 2]}}, good / "a.pt")
    ckpt.verify_weights_only(good)
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({"module": {"w": torch.ones(2)}, "evil": Payload()}, bad / "a.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"a\.pt does not load with weights_only=True"):
        ckpt.verify_weights_only(bad)


def test_resolve_rejects_incomplete_and_missing(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.resolve(str(tmp_path / "nope"), tmp_path)
    partial = tmp_path / "step00000003"
    partial.mkdir()
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.resolve(str(partial), tmp_path)
    assert ckpt.resolve("auto", tmp_path) is None and ckpt.resolve("none", tmp_path) is None

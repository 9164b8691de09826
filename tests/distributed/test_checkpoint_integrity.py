"""Checkpoint integrity on real 2-rank ZeRO-1 sessions: a bit flip, a truncated shard, a missing shard, damage
only one rank sees, and a pre-manifest marker, each met by ``resume auto`` (walk back, say why, the same
verdict on every rank) and by an explicit path (an error naming the file); a save whose files change before publication never moves ``latest`` nor deletes older
checkpoints; a state with non-finite tensors is never written."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from dist_helpers import LogLines, run_ranks
from engine_cases import batch, factory, tiny_config

from comera_dist.engine.checkpoint import tag_for

SHARD0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
SHARD1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


def _session(outdir: str):
    from comera_dist.engine.session import TrainSession

    cfg = tiny_config(outdir, zero_stage=1, steps=10)
    cfg.train.keep_checkpoints = 2
    return TrainSession.create(cfg, factory(cfg), world_size=2)


def _flip(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (the issue's reproduction)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _write(rank: int, world_size: int, outdir: str) -> dict:
    from deepspeed.utils import safe_set_full_fp32_param

    from comera_dist.engine.checkpoint import CheckpointError
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.packing import NAMES

    init_distributed(60)
    s = _session(outdir)
    for step in range(1, 7):
        s.train_step([batch(step, rank)])
        if step % 2 == 0:
            s.save(step, {"at": step})
    out: dict = {}
    s.train_step([batch(7, rank)])
    try:  # a shard changes between hashing and publication: the read-back must refuse it
        s.save(8, before_publish=lambda tmp: _flip(tmp / SHARD1, 8))
        out["corrupt_save"] = None
    except CheckpointError as e:
        out["corrupt_save"] = str(e)
    gates = ("gate", NAMES["gates"])  # a layer's gate vector, or all of them packed (engine.packing)
    name, p = next((n, p) for n, p in s.module.named_parameters() if n.split(".")[-1] in gates)
    safe_set_full_fp32_param(p, torch.full(p.ds_shape if hasattr(p, "ds_shape") else p.shape, float("nan")))
    out["nonfinite_save"] = s.save(10)
    out["poisoned"] = name
    s.close()
    return out


def _sees_damage_alone(bad: Path) -> None:
    """This rank alone finds ``bad`` damaged (as with node-local storage or a flaky read): the ranks must
    still agree, or one would load step 6 and the other step 4."""
    from comera_dist.engine import checkpoint

    real = checkpoint.check
    checkpoint.check = lambda path, share=None: real(path, share) + (
        [f"{bad / SHARD0}: seen by rank 1 only"] if path == bad else [])


def _resume_variants(rank: int, world_size: int, roots: dict[str, str]) -> dict:
    from comera_dist.engine.checkpoint import CheckpointError
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    records = LogLines(logging.WARNING)
    logging.getLogger("comera_dist.engine.checkpoint").addHandler(records)
    out = {}
    for variant, outdir in roots.items():
        if variant == "one_rank" and rank == 1:
            _sees_damage_alone(Path(outdir) / "checkpoints" / tag_for(6))
        s = _session(outdir)
        explicit = None
        try:
            s.resume(str(Path(outdir) / "checkpoints" / tag_for(6)))
        except CheckpointError as e:
            explicit = str(e)
        records.lines.clear()
        client = s.resume("auto")
        loss = s.train_step([batch(client["step"] + 1, rank)]).task_loss
        out[variant] = {"explicit": explicit, "client": client, "log": list(records.lines), "loss": loss}
        s.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    good = tmp / "good"
    written = run_ranks(_write, tmp / "w1", str(good))
    roots = {}
    for variant in ("flip", "truncate", "missing", "legacy", "one_rank"):
        shutil.copytree(good, tmp / variant)
        roots[variant] = str(tmp / variant)
    step6 = {v: tmp / v / "checkpoints" / tag_for(6) for v in roots}
    _flip(step6["flip"] / SHARD0)
    with open(step6["truncate"] / MODEL, "r+b") as f:
        f.truncate((step6["truncate"] / MODEL).stat().st_size // 2)
    (step6["missing"] / SHARD1).unlink()
    (step6["legacy"] / "COMPLETE").write_text(f"{tag_for(6)}\n")  # as written before the manifest
    resumed = run_ranks(_resume_variants, tmp / "w2", roots)
    return good, written, resumed, step6


def test_corrupt_save_keeps_latest_and_older_nonfinite_never_written(runs):
    good, written, _, _ = runs
    root = good / "checkpoints"
    for r in written:
        assert r["corrupt_save"] is not None and f"{tag_for(8)}/{SHARD1}" in r["corrupt_save"], r
        assert "digest differs" in r["corrupt_save"]
        assert r["nonfinite_save"] is None
    # keep_checkpoints=2: step 2 went when step 6 verified; the failed step-8 save deleted nothing
    # and `latest` stays on step 6; the poisoned state was never written.
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [tag_for(s) for s in (4, 6, 8)]
    assert (root / "latest").read_text() == tag_for(6)
    assert not (root / tag_for(10)).exists() and not list(root.glob(".tmp-*10"))


@pytest.mark.parametrize("variant,bad_file,why", [
    ("flip", SHARD0, "digest differs from the manifest"),
    ("truncate", MODEL, "the manifest says"),
    ("missing", SHARD1, "missing (listed in the manifest)"),
    ("one_rank", SHARD0, "seen by rank 1 only"),  # one rank's verdict is every rank's
])
def test_auto_walks_back_explicit_path_names_the_file(runs, variant, bad_file, why):
    _, _, resumed, step6 = runs
    for rank, r in enumerate(resumed):
        case = r[variant]
        assert case["explicit"] is not None and f"{step6[variant] / bad_file}: " in case["explicit"]
        assert why in case["explicit"]
        # step 6 (named by `latest`) and step 8 (corrupt since its save) are skipped, step 4 loads
        assert case["client"] == {"at": 4, "step": 4, "checkpoint_dir": step6[variant].parent / tag_for(4)}
        assert torch.isfinite(torch.tensor(case["loss"]))
        if rank == 0:
            skips = [line for line in case["log"] if line.startswith("resume auto: skipping")]
            assert len(skips) == 2 and tag_for(6) in skips[0] and bad_file in skips[0], case["log"]
            assert tag_for(8) in skips[1] and SHARD1 in skips[1]


def test_pre_manifest_checkpoint_loads_with_warning(runs):
    _, _, resumed, step6 = runs
    for r in resumed:
        case = r["legacy"]
        assert case["explicit"] is None  # the explicit path loaded
        assert case["client"] == {"at": 6, "step": 6, "checkpoint_dir": step6["legacy"]}
        assert any("written before checkpoint manifests" in line and "cannot be verified" in line
                   for line in case["log"]), case["log"]
